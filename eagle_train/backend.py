"""The distributed backend of a training launch: what it changes in the trainer's loop.

`accelerate launch` picks how the head's AdamW state is held, its optimizer layout (recorded in the
checkpoint's state): whole (one process or DDP), fsdp, zero2 or zero3. A `Backend` owns what
differs between them, so the loop asks it instead of testing names: how the head and its optimizer
are prepared, whether each process saves its own optimizer shard, how it saves and loads its
optimizer state (into and from the files `eagle_train.train_checkpoint` names), where a step's
gradient norm comes from, and how a launch that resumes it is described.
"""

import math
from pathlib import Path

import torch

from eagle_train.bf16 import bf16_is_fast
from eagle_train.launch import launched_with
from eagle_train.train_config import TrainConfig


class Backend:
    """One process or DDP: every process holds the whole AdamW state, saved once by the main process."""

    layout = "whole"
    title = "one process or DDP"
    resume_with = "1 process or --multi_gpu / ddp.yaml, with any process count"
    sharded = False  # True: each process saves its own optimizer file, and a resume needs the same count

    def prepare(self, accelerator, runner, adamw):
        """(model, optimizer, the unwrapped optimizer the LR schedule drives). The model is wrapped
        first: FSDP replaces the parameters when it wraps, and the optimizer must see the wrapped ones."""
        model = accelerator.prepare(runner)
        raw_optimizer = adamw(model)
        return model, accelerator.prepare(raw_optimizer), raw_optimizer

    def save_optimizer(self, accelerator, optimizer, files: list[Path]) -> None:
        """Save the optimizer state into `files` (every process calls it): the one whole file, written
        by the main process, or one file per process, each written by its own."""
        if self.sharded:
            torch.save(optimizer.state_dict(), files[accelerator.process_index])
        elif accelerator.is_main_process:
            torch.save(optimizer.state_dict(), files[0])

    def optimizer_state(self, files: list[Path], rank: int):
        """What this process's optimizer.load_state_dict takes from a checkpoint's optimizer files."""
        return torch.load(files[0], map_location="cpu", weights_only=False)

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

    def optimizer_state(self, files: list[Path], rank: int):
        """This process's own shard."""
        return torch.load(files[rank], map_location="cpu", weights_only=False)


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

    def optimizer_state(self, files: list[Path], rank: int):
        """Every process's partition: ZeRO's load_state_dict reads its own entry of the list."""
        return [torch.load(f, map_location="cpu", mmap=True, weights_only=False) for f in files]

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


def make_accelerator(cfg: TrainConfig, log_with: list):
    """The Accelerator of `accelerate launch`'s config, with precision and clipping from the run config
    and the trackers `log_with` (TensorBoard writes under <output_dir>/tensorboard).

    Under DeepSpeed the head keeps fp32 weights and bf16 runs as autocast (DeepSpeed's torch_autocast),
    as under DDP and FSDP, and DeepSpeed clips to max_grad_norm itself inside backward. Accelerate
    finds no DeepSpeed backend on a machine without CUDA unless told gloo (DeepSpeed's CPU accelerator)."""
    from accelerate import Accelerator, InitProcessGroupKwargs
    from accelerate.utils import ProjectConfiguration
    from transformers.integrations import unset_hf_deepspeed_config

    cuda = torch.cuda.is_available()
    mixed = precision(cfg)
    if launched_with("FSDP") and not cuda:
        raise ValueError(
            "this launch asks for FSDP, which accelerate runs on GPUs only: without one it would silently train "
            "plain DDP, every process holding the whole head and optimizer. Here, launch with --multi_gpu (DDP "
            "over gloo) or configs/accelerate/deepspeed_zero2.yaml / deepspeed_zero3.yaml (ZeRO shards on the CPU too)"
        )
    out = Path(cfg.output_dir)
    logging = {"log_with": log_with, "project_config": ProjectConfiguration(out, logging_dir=out / "tensorboard")}
    if not launched_with("DEEPSPEED"):
        return Accelerator(cpu=not cuda, mixed_precision=mixed, **logging)
    accelerator = Accelerator(
        mixed_precision="no", kwargs_handlers=[] if cuda else [InitProcessGroupKwargs(backend="gloo")], **logging
    )
    unset_hf_deepspeed_config()  # ZeRO-3 partitions the head only: the frozen target loads whole
    ds = accelerator.state.deepspeed_plugin.deepspeed_config
    ds["bf16"] = {"enabled": False}
    ds["torch_autocast"] = {"enabled": mixed == "bf16", "dtype": "bfloat16"}
    ds["gradient_clipping"] = cfg.max_grad_norm
    return accelerator
