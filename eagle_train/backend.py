"""The distributed backend of a training launch: what it changes in the trainer's loop.

`accelerate launch` picks how the head's AdamW state is held, its optimizer layout (recorded in
trainer_state.json): whole (one process or DDP), fsdp, zero2 or zero3. A `Backend` owns what
differs between them, so the loop asks it instead of testing names: how the head and its optimizer
are prepared, whether each process saves its own optimizer shard, how a checkpoint's optimizer is
loaded, where a step's gradient norm comes from, and which resumes are refused.
"""

import json
import math
from pathlib import Path

import torch

from eagle_train.bf16 import bf16_is_fast
from eagle_train.train_config import TrainConfig, launched_with


class Backend:
    """One process or DDP: every process holds the whole AdamW state, saved once as optimizer.pt."""

    layout = "whole"
    title = "one process or DDP"
    resume_with = "1 process or --multi_gpu / ddp.yaml, with any process count"
    sharded = False  # each process saves optimizer-rank<i>.pt, and a resume needs the same count

    def prepare(self, accelerator, runner, adamw):
        """(model, optimizer, the unwrapped optimizer the LR schedule drives). The model is wrapped
        first: FSDP replaces the parameters when it wraps, and the optimizer must see the wrapped ones."""
        model = accelerator.prepare(runner)
        raw_optimizer = adamw(model)
        return model, accelerator.prepare(raw_optimizer), raw_optimizer

    def optimizer_state(self, checkpoint: Path, saved_processes: int, rank: int):
        """What this process's optimizer.load_state_dict takes from `checkpoint`: its whole
        optimizer.pt where there is one, else the shards."""
        if (checkpoint / "optimizer.pt").is_file():
            return torch.load(checkpoint / "optimizer.pt", map_location="cpu", weights_only=False)
        return self.shard_state(checkpoint, saved_processes, rank)

    def shard_state(self, checkpoint: Path, saved_processes: int, rank: int):
        """This process's own optimizer-rank file."""
        return torch.load(checkpoint / f"optimizer-rank{rank}.pt", map_location="cpu", weights_only=False)

    def grad_norm(self, accelerator, model, params, max_grad_norm: float):
        """The step's gradient norm over all processes, clipping to `max_grad_norm` when > 0 (the norm is
        what tells a step with nan or inf gradients, so it is taken when the run does not clip too)."""
        return accelerator.clip_grad_norm_(params, max_grad_norm if max_grad_norm > 0 else math.inf)


class FSDP(Backend):
    """FSDP: the head and its AdamW state sharded over the processes, one optimizer file each."""

    layout = "fsdp"
    title = "FSDP"
    resume_with = "fsdp.yaml and the same process count"
    sharded = True


class ZeRO(Backend):
    """DeepSpeed ZeRO-2/3: the optimizer partitioned over the processes; DeepSpeed clips and steps
    inside backward."""

    sharded = True

    def __init__(self, stage: int):
        self.layout = f"zero{stage}"
        self.title = f"DeepSpeed ZeRO-{stage}"
        self.resume_with = f"deepspeed_zero{stage}.yaml and the same process count"

    def prepare(self, accelerator, runner, adamw):
        """deepspeed.initialize takes the model and its optimizer together."""
        raw_optimizer = adamw(runner)
        model, optimizer = accelerator.prepare(runner, raw_optimizer)
        return model, optimizer, raw_optimizer

    def shard_state(self, checkpoint: Path, saved_processes: int, rank: int):
        """Every rank's file: ZeRO's load_state_dict reads its own entry of the list."""
        return [
            torch.load(checkpoint / f"optimizer-rank{r}.pt", map_location="cpu", mmap=True, weights_only=False)
            for r in range(saved_processes)
        ]

    def grad_norm(self, accelerator, model, params, max_grad_norm: float):
        """The engine's: DeepSpeed clipped to max_grad_norm inside backward."""
        return model.get_global_grad_norm()


BACKENDS = {b.layout: b for b in (Backend(), FSDP(), ZeRO(2), ZeRO(3))}


def backend_of(accelerator) -> Backend:
    """The backend this launch runs under, from the Accelerator accelerate configured."""
    kind = accelerator.distributed_type.value
    if kind == "DEEPSPEED":
        return ZeRO(accelerator.state.deepspeed_plugin.zero_stage)
    return BACKENDS["fsdp" if kind == "FSDP" else "whole"]


def precision(cfg: TrainConfig) -> str:
    """The run's autocast: "bf16" or "no" (fp32), `mixed_precision: auto` resolved for this machine."""
    if cfg.mixed_precision != "auto":
        return cfg.mixed_precision
    return "bf16" if bf16_is_fast() else "no"


def make_accelerator(cfg: TrainConfig):
    """The Accelerator of `accelerate launch`'s config, with precision and clipping from the run config.

    Under DeepSpeed the head keeps fp32 weights and bf16 runs as autocast (DeepSpeed's torch_autocast),
    as under DDP and FSDP, and DeepSpeed clips to max_grad_norm itself inside backward. Accelerate
    finds no DeepSpeed backend on a machine without CUDA unless told gloo (DeepSpeed's CPU accelerator)."""
    from accelerate import Accelerator, InitProcessGroupKwargs
    from transformers.integrations import unset_hf_deepspeed_config

    cuda = torch.cuda.is_available()
    mixed = precision(cfg)
    if launched_with("FSDP") and not cuda:
        raise ValueError(
            "this launch asks for FSDP, which accelerate runs on GPUs only: without one it would silently train "
            "plain DDP, every process holding the whole head and optimizer. Here, launch with --multi_gpu (DDP "
            "over gloo) or configs/accelerate/deepspeed_zero2.yaml / deepspeed_zero3.yaml (ZeRO shards on the CPU too)"
        )
    if not launched_with("DEEPSPEED"):
        return Accelerator(cpu=not cuda, mixed_precision=mixed)
    accelerator = Accelerator(
        mixed_precision="no", kwargs_handlers=[] if cuda else [InitProcessGroupKwargs(backend="gloo")]
    )
    unset_hf_deepspeed_config()  # ZeRO-3 partitions the head only: the frozen target loads whole
    ds = accelerator.state.deepspeed_plugin.deepspeed_config
    ds["bf16"] = {"enabled": False}
    ds["torch_autocast"] = {"enabled": mixed == "bf16", "dtype": "bfloat16"}
    ds["gradient_clipping"] = cfg.max_grad_norm
    return accelerator


def check_resumable(checkpoint: Path, world: int, layout: str) -> None:
    """Refuse, before the target loads, a resume the checkpoint cannot give: an optimizer saved by
    another backend (a whole AdamW state, FSDP shards and ZeRO partitions are different things), or
    one saved in shards (optimizer-rank<i>.pt) under another process count."""
    saved = json.loads((checkpoint / "trainer_state.json").read_text())
    shards = sorted(checkpoint.glob("optimizer-rank*.pt"))
    whole = (checkpoint / "optimizer.pt").is_file()
    was = saved.get("optimizer_layout", "whole" if whole else None)
    weights_only = f"or start a new run from its weights with init_from={checkpoint / 'head'}"
    if was is not None and was != layout:
        saver, current = BACKENDS[was], BACKENDS[layout]
        raise ValueError(
            f"{checkpoint} holds an optimizer saved by {saver.title} and this launch is {current.title}: resume it "
            f"with {saver.resume_with}, {weights_only}"
        )
    if shards and not whole and (saved["num_processes"] != world or len(shards) != world):
        raise ValueError(
            f"{checkpoint} holds its optimizer sharded over {saved['num_processes']} processes ({len(shards)} "
            f"optimizer-rank files; FSDP or DeepSpeed ZeRO) and this run has {world}: resume it with "
            f"{saved['num_processes']} processes and the same accelerate config, {weights_only}"
        )
