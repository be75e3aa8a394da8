"""A training checkpoint: what it holds on disk, how it is saved and restored, which one a run resumes
and why one cannot be. The only place that spells the format:

    <output_dir>/checkpoint-<step>/
        head/                  the head (config.json, model.safetensors): what export and init_from read
        optimizer.pt           the whole AdamW state (one process or DDP), or
        optimizer-rank<r>.pt   one per process (FSDP shards, ZeRO partitions): resumed with the same count
        scheduler.pt           the LR schedule
        rng-rank<r>.pt         each process's RNG states
        trainer_state.json     step, data position, process count, optimizer layout and the run config;
                               written last, so a checkpoint without it is one whose save did not finish

How each optimizer layout saves and loads its state is its `Backend`'s; the file names come from here.
"""

import json
import random
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from eagle_train.backend import BACKENDS, Backend
from eagle_train.files import write_json, write_safetensors
from eagle_train.head import non_finite_values
from eagle_train.train_config import TrainConfig

PREFIX = "checkpoint-"
HEAD = "head"
STATE_FILE = "trainer_state.json"
SCHEDULER = "scheduler.pt"
WHOLE_OPTIMIZER = "optimizer.pt"
POSITION = ("step", "epoch", "epoch_samples", "samples_consumed", "tokens_consumed")  # what a resume continues


def optimizer_shard(rank: int) -> str:
    return f"optimizer-rank{rank}.pt"


def rng_file(rank: int) -> str:
    return f"rng-rank{rank}.pt"


def checkpoint_step(path: Path) -> int | None:
    """The step in a `checkpoint-<step>` directory name; None for any other name."""
    step = Path(path).name.removeprefix(PREFIX)
    return int(step) if Path(path).name.startswith(PREFIX) and step.isdigit() else None


def finished_checkpoints(output_dir) -> list[Path]:
    """The checkpoints whose save finished (their state file is written last), oldest first."""
    found = [
        p for p in Path(output_dir).glob(f"{PREFIX}*") if checkpoint_step(p) is not None and (p / STATE_FILE).is_file()
    ]
    return sorted(found, key=checkpoint_step)


def read_state(checkpoint) -> dict | None:
    """A checkpoint's trainer state (step, data position, process count, optimizer layout, config);
    None where there is none: a head directory, or a save that did not finish."""
    state_file = Path(checkpoint) / STATE_FILE
    return json.loads(state_file.read_text()) if state_file.is_file() else None


def newest_checkpoint(output_dir, after_step: int = -1) -> tuple[Path, dict] | None:
    """The newest finished checkpoint of a run and its state, if it is past `after_step`."""
    found = finished_checkpoints(output_dir)
    if not found:
        return None
    state = read_state(found[-1])
    return (found[-1], state) if state["step"] > after_step else None


def finished_at(checkpoint) -> float:
    """When the checkpoint's save finished (the time its state file was written)."""
    return (Path(checkpoint) / STATE_FILE).stat().st_mtime


def optimizer_files(checkpoint: Path, state: dict) -> list[Path]:
    """The optimizer file(s) a checkpoint holds: the whole state, else one per saving process."""
    if (checkpoint / WHOLE_OPTIMIZER).is_file():
        return [checkpoint / WHOLE_OPTIMIZER]
    return [checkpoint / optimizer_shard(r) for r in range(state["num_processes"])]


# ------------------------------------------------------------------------------------ resumability


def checkpoint_damage(path: Path) -> str:
    """Why `path` cannot be resumed ("" when it can): a file a resume reads is missing, empty, truncated
    or not what it should be. Cheap: safetensors headers and the zip directories torch.save writes last."""
    state_file = path / STATE_FILE
    if not state_file.is_file():
        return f"it has no {STATE_FILE} (its save did not finish)"
    try:
        saved = json.loads(state_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return f"{STATE_FILE} is {'empty' if state_file.stat().st_size == 0 else 'not JSON'}"
    if not isinstance(saved, dict) or not all(isinstance(saved.get(k), int) for k in (*POSITION, "num_processes")):
        return f"{STATE_FILE} lacks the step and data position"
    for name in (f"{HEAD}/config.json", f"{HEAD}/model.safetensors"):
        if not (path / name).is_file():
            return f"{name} is missing"
    try:
        json.loads((path / HEAD / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return f"{HEAD}/config.json is not JSON"
    try:
        with safe_open(str(path / HEAD / "model.safetensors"), framework="pt"):
            pass
    except SafetensorError as e:
        return f"{HEAD}/model.safetensors is truncated or unreadable ({e})"
    ranks = range(saved["num_processes"])
    whole = saved.get("optimizer_layout", "whole") == "whole"
    optimizer = [WHOLE_OPTIMIZER] if whole else [optimizer_shard(r) for r in ranks]
    for name in [SCHEDULER, *optimizer, *(rng_file(r) for r in ranks)]:
        if not (path / name).is_file():
            return f"{name} is missing"
        if not zipfile.is_zipfile(path / name):
            return f"{name} is truncated or unreadable"
    return ""


def check_resumable(checkpoint: Path, world: int, layout: str) -> None:
    """Refuse a resume the checkpoint cannot give this launch: an optimizer saved by another backend (a
    whole AdamW state, FSDP shards and ZeRO partitions are different things), or one saved in shards
    under another process count."""
    saved = read_state(checkpoint)
    shards = sorted(checkpoint.glob(optimizer_shard("*")))
    whole = (checkpoint / WHOLE_OPTIMIZER).is_file()
    was = saved.get("optimizer_layout", "whole" if whole else None)  # None: shards saved before layouts were named
    weights_only = f"or start a new run from its weights with init_from={checkpoint / HEAD}"
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


def resolve_resume(cfg: TrainConfig, world: int, layout: str) -> tuple[Path | None, list[str]]:
    """The checkpoint this launch continues (None for a fresh run, whose output_dir must hold no
    checkpoints) and a line for each damaged newer checkpoint resume=auto passed over; refuses,
    before the target loads, a checkpoint that is damaged or that this launch cannot resume."""
    skipped = []
    if cfg.resume == "auto":
        for path in reversed(finished_checkpoints(cfg.output_dir)):
            damage = checkpoint_damage(path)
            if not damage:
                check_resumable(path, world, layout)
                return path, skipped
            skipped.append(f"skipping {path}: {damage}")
        if skipped:
            raise ValueError(
                f"no checkpoint in {cfg.output_dir} can be resumed ({'; '.join(skipped)}): move them away to "
                "start afresh, or choose another output_dir"
            )
        return None, []
    if cfg.resume:
        path = Path(cfg.resume)
        damage = checkpoint_damage(path)
        if damage:
            raise ValueError(
                f"resume checkpoint {path} cannot be resumed: {damage}; resume from an earlier {PREFIX}<step> "
                "(resume=auto takes the newest one that is whole)"
            )
        check_resumable(path, world, layout)
        return path, []
    if finished_checkpoints(cfg.output_dir):
        raise ValueError(
            f"output_dir {cfg.output_dir} holds checkpoints of an earlier run: continue it with "
            "resume=auto, or choose another output_dir"
        )
    return None, []


def last_good_checkpoint(output_dir) -> str:
    """Where a stopped run can be taken up, for its error message."""
    found = finished_checkpoints(output_dir)
    return f"the last good checkpoint is {found[-1]}" if found else "no checkpoint was saved"


# ------------------------------------------------------------------------------------ save and restore


@dataclass
class Resumable:
    """The part of a training run a checkpoint saves and a resume restores, with the accelerator and backend
    that gather and scatter it across processes. Declared beside the format so that saving needs nothing of
    the trainer: the trainer's `Run` is one, with its data besides."""

    cfg: TrainConfig  # where the checkpoints go, how many stay; saved whole in the state file
    accelerator: object
    backend: Backend  # how the optimizer's state is saved and loaded
    model: nn.Module  # the wrapped head runner (`model.head` once unwrapped)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    state: dict  # step, data position and counters (`POSITION` is what a resume continues)


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(run: Resumable) -> Path:
    """Write `checkpoint-<step>` of the run's current step (every process calls it), then drop this
    run's checkpoints beyond the newest `keep_checkpoints`."""
    accelerator, state, cfg = run.accelerator, run.state, run.cfg
    path = Path(cfg.output_dir) / f"{PREFIX}{state['step']}"
    full = accelerator.get_state_dict(run.model)  # gathers FSDP/ZeRO-3 shards; every process must call it
    head = accelerator.unwrap_model(run.model).head
    tensors, bad = {}, ""
    if accelerator.is_main_process:
        saved = head.saved_state_dict()  # EAGLE-3 leaves the frozen target embedding out, P-EAGLE keeps its own
        tensors = {
            k.removeprefix("head."): v.detach().contiguous().cpu()
            for k, v in full.items()
            if k.removeprefix("head.") in saved
        }
        bad = non_finite_values(tensors)
    if accelerator.reduce(torch.tensor([float(bool(bad))], device=accelerator.device), "sum").item():
        raise ValueError(
            f"step {state['step']}: the head holds non-finite values ({bad or 'see the main process'}) after "
            f"the step: not saving {path.name}; lower learning_rate ({last_good_checkpoint(cfg.output_dir)})"
        )
    if accelerator.is_main_process:
        (path / HEAD).mkdir(parents=True, exist_ok=True)
        head.config.save(path / HEAD)
        write_safetensors(path / HEAD / "model.safetensors", tensors)
        torch.save(run.scheduler.state_dict(), path / SCHEDULER)
    accelerator.wait_for_everyone()
    files = [path / optimizer_shard(r) for r in range(accelerator.num_processes)]
    run.backend.save_optimizer(accelerator, run.optimizer, files if run.backend.sharded else [path / WHOLE_OPTIMIZER])
    torch.save(rng_state(), path / rng_file(accelerator.process_index))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        write_json(path / STATE_FILE, {**state, "config": cfg.to_dict()})
        # this run's checkpoints only: a newer one is another run's that resume passed over as damaged
        ours = [p for p in finished_checkpoints(cfg.output_dir) if checkpoint_step(p) <= state["step"]]
        for old in ours[: -cfg.keep_checkpoints]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return path


def restore(run: Resumable, checkpoint: Path) -> None:
    """Continue from `checkpoint`: its step and data position, optimizer, LR schedule and RNG state
    (the head's weights were loaded before the model was wrapped, in the trainer's `build_model`)."""
    rank = run.accelerator.process_index
    saved = read_state(checkpoint)
    run.state.update({k: saved[k] for k in POSITION})
    run.optimizer.load_state_dict(run.backend.optimizer_state(optimizer_files(checkpoint, saved), rank))
    run.scheduler.load_state_dict(torch.load(checkpoint / SCHEDULER, weights_only=False))
    if (checkpoint / rng_file(rank)).is_file():  # a process the saving run did not have starts from the seed
        set_rng_state(torch.load(checkpoint / rng_file(rank), weights_only=False))
    run.accelerator.print(
        f"resumed from {checkpoint}: step {run.state['step']}, {run.state['samples_consumed']} "
        f"samples consumed (saved by {saved['num_processes']} processes, now "
        f"{run.accelerator.num_processes})"
    )
