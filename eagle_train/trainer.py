"""The training loop every method shares: EAGLE-3, P-EAGLE and the block drafters DFlash and DSpark.

`train(cfg, build_head, objective)` owns everything but the method:

- `build_head(cfg, target_model, vocab_map) -> nn.Module` makes the draft head (vocab_map is the
  data's `read_vocab_map` dict, None with `init_from`);
- `objective(model, batch, backward) -> dict` runs one micro-batch. `model(fn, *args)` returns
  `fn(head, *args)` computed inside the distributed wrapper's forward (DDP/FSDP hook there, so
  every forward must go through it); `backward(loss)` is `accelerator.backward` scaled for
  gradient accumulation. An objective may run several forward+backward passes (P-EAGLE's sequence
  partitioning). `batch` holds `input_ids` [B,T], `loss_mask` [B,T], `aux_hidden` [B,T,3H],
  `target_probs` [B,T,Vd], `in_draft` [B,T] (`eagle_train.training_parts.target_distribution`) and the
  `generator` for any random draws, seeded per micro-batch (`draw_seed`). The
  returned metrics are detached scalars; `acc_i` / `loss_i` are pooled weighted by `count_i`,
  `count_*` summed, anything else averaged; `sim_al` is derived from the `acc_i`, and `chain_al` from
  `count_chain_tokens / count_rounds` (EAGLE-3's chain walk, `eagle_train.training_parts.chain_rounds`).

Data order: every epoch is a seeded permutation of the training samples, cut into length-grouped
micro-batches of at most `tokens_per_batch` padded tokens. That list depends on the seed and the
data only, never on the process count; step s hands micro-batches [s*W*A, (s+1)*W*A) round-robin
to the W processes (A = gradient accumulation). The data position saved in a checkpoint is the
number of samples consumed, so a resumed run, with any process count, continues where it stopped.
Micro-batches are right-padded without a key mask: attention is causal, so real positions never
see the padding, and padded positions are never supervised.

Garbage stops the run at once: a step whose loss or gradient norm (both pooled over the processes, so
every process sees the same) is not finite raises before the optimizer applies it, naming the step,
the store samples of the micro-batches at fault and the last good checkpoint; skipping such steps
would hide broken data or a learning rate that diverges. No checkpoint or final head is ever written
with nan or inf in it. (DeepSpeed steps inside backward: there the check comes after its step, and
the run still stops before saving it.)
"""

import contextlib
import json
import math
import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from accelerate.tracking import GeneralTracker
from accelerate.utils import is_tensorboard_available
from torch import nn
from tqdm import tqdm

from eagle_train.backend import backend_of, make_accelerator, precision
from eagle_train.batching import epoch_batches, pack_by_length
from eagle_train.checkpoint import load_draft_head
from eagle_train.files import write_text
from eagle_train.hidden_states import TargetLogits, target_hidden_states
from eagle_train.sample_buffer import BufferedSamples
from eagle_train.store import (
    HIDDEN_FORMAT,
    ShardedSamples,
    check_store_matches,
    read_manifest,
    read_vocab_map,
    target_fingerprint,
)
from eagle_train.target import load_target, load_target_config, load_target_ends
from eagle_train.train_checkpoint import Resumable, last_good_checkpoint, resolve_resume, restore, save_checkpoint
from eagle_train.train_config import TrainConfig, runs_the_target, validate
from eagle_train.training_parts import shift_left, simulated_acceptance_length, target_distribution
from eagle_train.vocab_map import top_k_vocab_map

# ------------------------------------------------------------------------------------ data order


def split_indices(n: int, eval_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train, eval) sample indices: a seeded held-out share, at least one sample when asked for any."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    n_eval = min(n - 1, max(1, round(n * eval_fraction))) if eval_fraction > 0 and n > 1 else 0
    return sorted(perm[n_eval:]), sorted(perm[:n_eval])


def pad_samples(samples: list[dict], max_length: int) -> dict[str, torch.Tensor]:
    """Right-pad (and truncate to max_length) a list of store items into [B, T] / [B, T, D] tensors."""
    longest = max(min(len(s["input_ids"]), max_length) for s in samples)
    out = {}
    for key, value in samples[0].items():
        shape = (len(samples), longest, *value.shape[1:])
        out[key] = torch.zeros(shape, dtype=value.dtype)
        for b, s in enumerate(samples):
            n = min(len(s[key]), max_length)
            out[key][b, :n] = s[key][:n]
    lengths = torch.tensor([min(len(s["input_ids"]), max_length) for s in samples])
    out["attention_mask"] = (torch.arange(longest)[None] < lengths[:, None]).long()
    return out


def draw_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of micro-batch `index` of `epoch` (-1: the eval batches) for an objective's random
    draws: a function of the run and the batch, never of the process layout, so 2 processes or a
    resume with another count draw what 1 process draws."""
    return hash((seed, epoch, index)) % 2**63  # int tuples hash the same in every process


def micro_batch(samples: list[dict], sample_ids: list[int], max_length: int, seed: int) -> dict:
    """What `BatchSource` takes: the store items `sample_ids` padded, their ids and the batch's draw seed."""
    return {**pad_samples(samples, max_length), "sample_ids": torch.tensor(sample_ids), "draw_seed": seed}


class MicroBatches(torch.utils.data.Dataset):
    """Item k = micro-batch k of a list, padded, with its draw seed; lets a DataLoader prefetch them in workers."""

    def __init__(self, data: ShardedSamples, batches: list[list[int]], seeds: list[int], max_length: int, with_hidden):
        self.data, self.batches, self.seeds = data, batches, seeds
        self.max_length, self.with_hidden = max_length, with_hidden

    def __len__(self):
        return len(self.batches)

    def __getitem__(self, k):
        read = self.data.__getitem__ if self.with_hidden else self.data.tokens
        ids = self.batches[k]
        return micro_batch([read(i) for i in ids], ids, self.max_length, self.seeds[k])


def loader(data, batches, seeds, cfg: TrainConfig, with_hidden: bool):
    return torch.utils.data.DataLoader(
        MicroBatches(data, batches, seeds, cfg.max_length, with_hidden),
        batch_size=None,
        shuffle=False,
        num_workers=cfg.num_workers,
    )


# ------------------------------------------------------------------------------------ model side


class HeadRunner(nn.Module):
    """Wraps the head so a distributed wrapper (DDP, FSDP) sees each pass: forward(fn, *a) = fn(head, *a)."""

    def __init__(self, head: nn.Module):
        super().__init__()
        self.head = head

    def forward(self, fn, *args, **kwargs):
        return fn(self.head, *args, **kwargs)


class BatchSource:
    """Turns padded micro-batches into objective batches: aux states and the target distribution,
    from the store (offline) or from running the target (online).

    Where the target's argmax is a draft token (`in_draft`) is kept per sample after its first batch:
    later epochs run only the draft vocabulary's rows of the target's lm_head. A distilled store's answers
    are the target's greedy tokens (`greedy_answers`), so there the next token says where the argmax is, and
    the target's whole vocabulary never runs."""

    def __init__(self, cfg: TrainConfig, target_model, t2d, aux_layer_ids, device, greedy_answers: bool = False):
        self.online = runs_the_target(cfg)
        self.greedy_answers = greedy_answers
        self.target = target_model if self.online else None  # offline keeps no reference to it
        self.aux_layer_ids = aux_layer_ids
        self.target_logits = TargetLogits.of(target_model, device, torch.float32)
        self.t2d = t2d.to(device)
        self.draft_logits = self.target_logits.restricted(self.t2d)
        self.in_draft = {}  # sample id -> in_draft over its positions
        self.device = device

    def __call__(self, padded: dict) -> dict:
        ids = padded["input_ids"].to(self.device)
        if self.online:
            aux, final = target_hidden_states(
                self.target, ids, padded["attention_mask"].to(self.device), self.aux_layer_ids
            )
        else:
            aux, final = padded["aux_hidden"].to(self.device), padded["final_hidden"].to(self.device)
        loss_mask = padded["loss_mask"].to(self.device)
        samples = padded["sample_ids"].tolist()
        if self.greedy_answers:
            in_draft = shift_left(loss_mask.bool(), 1, False) & self.t2d[shift_left(ids, 1)]
            probs, in_draft = target_distribution(final, self.draft_logits, self.t2d, loss_mask, in_draft)
        elif all(i in self.in_draft for i in samples):
            in_draft = torch.zeros(loss_mask.shape, dtype=torch.bool)
            for b, i in enumerate(samples):
                in_draft[b, : len(self.in_draft[i])] = self.in_draft[i]
            in_draft = in_draft.to(self.device)
            probs, in_draft = target_distribution(final, self.draft_logits, self.t2d, loss_mask, in_draft)
        else:
            probs, in_draft = target_distribution(final, self.target_logits, self.t2d, loss_mask)
            for b, (i, n) in enumerate(zip(samples, padded["attention_mask"].sum(1).tolist())):
                self.in_draft[i] = in_draft[b, :n].to("cpu", copy=True)  # host memory: a byte per token of the data
        return {
            "input_ids": ids,
            "loss_mask": loss_mask,
            "aux_hidden": aux.float(),
            "target_probs": probs,
            "in_draft": in_draft,
            "generator": torch.Generator().manual_seed(padded["draw_seed"]),
        }


def vocab_map_of_size(vmap: dict, size: int) -> dict:
    """The `size` most frequent ids of a vocab map's counts (ties by its fill, then to the lower id), sorted
    ascending: the docs/design.md section 3 rule, so a run can use a smaller (faster) draft vocabulary than
    the data's map."""
    if size == len(vmap["d2t"]):
        return vmap
    return {**vmap, **top_k_vocab_map(vmap["counts"], size, vmap.get("fill"))}


def count_weighted(key: str, metrics: dict) -> str | None:
    """The count_i that weights `acc_i` / `loss_i`, if present."""
    name, _, i = key.rpartition("_")
    return f"count_{i}" if name in ("acc", "loss") and f"count_{i}" in metrics else None


def pool_metrics(per_batch: list[dict], accelerator, keys=None) -> dict[str, float]:
    """Pool micro-batch metrics over batches and processes (see the module docstring); a process
    with no batches passes the `keys` the others report and contributes nothing."""
    keys = sorted(keys or per_batch[0])
    sums = torch.zeros(2 * len(keys), dtype=torch.float64)
    for m in per_batch:
        for k, key in enumerate(keys):
            w = float(m[count_weighted(key, m)]) if count_weighted(key, m) else 1.0
            sums[2 * k] += float(m[key]) * (1.0 if key.startswith("count_") else w)
            sums[2 * k + 1] += 0.0 if key.startswith("count_") else w
    sums = accelerator.reduce(sums.to(accelerator.device), "sum").cpu()
    out = {
        key: float(sums[2 * k] / sums[2 * k + 1]) if not key.startswith("count_") else float(sums[2 * k])
        for k, key in enumerate(keys)
        if key.startswith("count_") or sums[2 * k + 1] > 0
    }
    accs = [out[f"acc_{i}"] for i in range(len(keys)) if f"acc_{i}" in out]
    if accs:
        out["sim_al"] = simulated_acceptance_length(accs)
    if out.get("count_rounds"):
        out["chain_al"] = out["count_chain_tokens"] / out["count_rounds"]
    return out


def cosine_with_warmup(warmup: int, total: int, min_ratio: float):
    def factor(step):
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


# ------------------------------------------------------------------------------------ logging


class MetricsFile(GeneralTracker):
    """<output_dir>/metrics.jsonl, a line per step and split ({"step", "split", metric: value}): the run's
    curve that scripts read back, and that a resume trims to the resumed step (`keep_metrics_through`);
    accelerate has no local-file tracker. Opened at each line, so nothing is written before the first."""

    name = "metrics.jsonl"
    requires_logging_directory = False

    def __init__(self, output_dir):
        super().__init__()
        self.path = Path(output_dir) / "metrics.jsonl"

    @property
    def tracker(self):
        return self.path

    def log(self, values: dict, step: int | None = None, **kwargs):
        """`values` are `split/name` (what TensorBoard and wandb show): one line per split."""
        lines = {}
        for key, value in values.items():
            split, _, name = key.partition("/")
            lines.setdefault(split, {"step": step, "split": split})[name] = value
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.writelines(json.dumps(line) + "\n" for line in lines.values())


def keep_metrics_through(output_dir, step: int) -> None:
    """Drop the metrics.jsonl lines an earlier invocation logged after `step` (all of them for a fresh
    run, step -1), so the file holds each step once per split; a line a kill cut short goes too."""
    path = Path(output_dir) / "metrics.jsonl"
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines() if logged_step(line) <= step]
    if kept:
        write_text(path, "".join(line + "\n" for line in kept))
    else:
        path.unlink()


def logged_step(line: str) -> float:
    """The step of a metrics.jsonl line; inf for a line a kill cut short."""
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return math.inf


def trackers(cfg: TrainConfig) -> list:
    """What the run logs to: metrics.jsonl always, and TensorBoard or wandb as `report_to` says."""
    return [MetricsFile(cfg.output_dir), *([cfg.report_to] if cfg.report_to != "none" else [])]


def log_metrics(run: "Run", metrics: dict, split: str) -> None:
    """Log `metrics` at the run's step as `split/name`. The trackers start with the first line (main
    process only), so a run that fails before it leaves no output_dir behind."""
    accelerator, cfg = run.accelerator, run.cfg
    if not accelerator.is_main_process:
        return
    if not accelerator.trackers:
        if cfg.report_to == "wandb" and not os.environ.get("WANDB_API_KEY"):
            os.environ.setdefault("WANDB_MODE", "offline")
        wandb = {"name": cfg.run_name or None, "config": cfg.to_dict(), "dir": cfg.output_dir}
        project = "eagle-train" if cfg.report_to == "wandb" else cfg.run_name or "run"  # TensorBoard's subdirectory
        accelerator.init_trackers(project, init_kwargs={"wandb": wandb})
    accelerator.log({f"{split}/{k}": v for k, v in metrics.items()}, step=run.state["step"])


def summary(metrics: dict, steps: int = 3) -> str:
    accs = " ".join(f"{metrics[f'acc_{i}']:.3f}" for i in range(steps) if f"acc_{i}" in metrics)
    chain = f" | chain AL {metrics['chain_al']:.3f}" if "chain_al" in metrics else ""
    return f"loss {metrics['loss']:.4f} | acc {accs} | sim AL {metrics.get('sim_al', float('nan')):.3f}{chain}"


# ------------------------------------------------------------------------------------ the run


@dataclass
class Run(Resumable):
    """What one training run holds: what a checkpoint saves and a resume restores (`Resumable`'s fields) and
    the data it steps through. Built by `set_up`, advanced by `optimizer_step`."""

    data: ShardedSamples | BufferedSamples  # a store's samples, or those an engine writes as the run reads them
    lengths: list[int]  # tokens per sample after truncation to max_length
    train_ids: list[int]
    eval_ids: list[int]
    epochs: list[list[list[int]]]  # the micro-batches of epochs 0..num_epochs-1
    source: BatchSource
    params: list[nn.Parameter]
    total_steps: int

    @property
    def per_step(self) -> int:
        """Micro-batches per optimizer step, over all processes."""
        return self.accelerator.num_processes * self.cfg.gradient_accumulation_steps


def build_model(cfg: TrainConfig, build_head, resume_from: Path | None, device) -> tuple[nn.Module, BatchSource]:
    """The head in fp32 (new, from init_from, or with a resumed checkpoint's weights) and the
    source that turns micro-batches into its training batches."""
    online = runs_the_target(cfg)
    if online:
        target_model, _ = load_target(cfg.target, device=device)
    else:  # the states come with the data: the target's embedding, norm and lm_head are all it reads
        target_model = load_target_ends(cfg.target)
    if resume_from is not None:
        head = load_draft_head(resume_from, target_model)  # the checkpoint's config, vocab map and weights
    else:
        vocab_map = None
        if not cfg.init_from:
            vocab_map = read_vocab_map(cfg.data_path)
            vocab_map = vocab_map_of_size(vocab_map, cfg.draft_vocab_size or len(vocab_map["d2t"]))
        head = build_head(cfg, target_model, vocab_map)
    aux_ids = list(head.config.aux_layer_ids)
    manifest = read_manifest(cfg.data_path)
    if manifest["format"] == HIDDEN_FORMAT and not online:
        if manifest["aux_layer_ids"] != aux_ids:
            raise ValueError(
                f"the head reads aux layers {aux_ids} but {cfg.data_path} holds {manifest['aux_layer_ids']}: "
                "train online or capture a store with the head's layers"
            )
        check_store_matches(manifest, target_model.config, aux_ids, target_fingerprint(target_model))
    head.float()
    greedy_answers = not online and "distil" in manifest.get("plan", {})  # data_prep.distil: greedy, every turn
    return head, BatchSource(cfg, target_model, head.t2d, aux_ids, device, greedy_answers)


def set_up(cfg: TrainConfig, accelerator, build_head, resume_from: Path | None, data=None) -> Run:
    """Seed, then the data (`data`, else the store at data_path) and its epochs, the wrapped head, the optimizer and
    the LR schedule."""
    backend = backend_of(accelerator)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    data = data if data is not None else ShardedSamples(cfg.data_path, dtype=torch.float32)
    lengths = [min(n, cfg.max_length) for n in data.lengths()]
    train_ids, eval_ids = split_indices(len(data), cfg.eval_fraction, cfg.seed)
    head, source = build_model(cfg, build_head, resume_from, accelerator.device)

    runner = HeadRunner(head)

    def adamw(module):
        trainable = [p for p in module.parameters() if p.requires_grad]
        return torch.optim.AdamW(
            trainable, lr=cfg.learning_rate, betas=tuple(cfg.adam_betas), weight_decay=cfg.weight_decay
        )

    model, optimizer, raw_optimizer = backend.prepare(accelerator, runner, adamw)
    params = [p for p in model.parameters() if p.requires_grad]
    world, accum = accelerator.num_processes, cfg.gradient_accumulation_steps
    per_step = world * accum
    epochs = [epoch_batches(train_ids, lengths, cfg.tokens_per_batch, cfg.seed, e) for e in range(cfg.num_epochs)]
    total_steps = cfg.max_steps if cfg.max_steps > 0 else sum(len(b) // per_step for b in epochs)
    if total_steps == 0 or len(epochs[0]) < per_step:
        raise ValueError(
            f"{len(train_ids)} training samples make {len(epochs[0])} micro-batches of "
            f"<= {cfg.tokens_per_batch} tokens, fewer than one step needs ({world} processes x "
            f"{accum} accumulation): use more data or a smaller tokens_per_batch"
        )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        raw_optimizer, cosine_with_warmup(cfg.warmup_steps, total_steps, cfg.min_lr_ratio)
    )
    state = {
        "step": 0,
        "epoch": 0,
        "epoch_samples": 0,
        "samples_consumed": 0,
        "tokens_consumed": 0,
        "num_processes": world,
        "optimizer_layout": backend.layout,
        "total_steps": total_steps,
    }
    return Run(
        cfg=cfg,
        accelerator=accelerator,
        backend=backend,
        data=data,
        lengths=lengths,
        train_ids=train_ids,
        eval_ids=eval_ids,
        epochs=epochs,
        source=source,
        model=model,
        params=params,
        optimizer=optimizer,
        scheduler=scheduler,
        total_steps=total_steps,
        state=state,
    )


def batches_of_epoch(run: Run, e: int) -> list[list[int]]:
    return (
        run.epochs[e]
        if e < len(run.epochs)
        else epoch_batches(run.train_ids, run.lengths, run.cfg.tokens_per_batch, run.cfg.seed, e)
    )


def reading_order(run: Run) -> tuple[list[tuple[int, int]], int]:
    """Every read of the run in order, as (epoch, sample) (epoch -1: the held-out samples, read first), and where
    the run's data position is in it: what an engine that makes the samples as they are read must write, and from
    where. An epoch reads its micro-batches of whole steps in order (process r of W takes every W-th)."""
    order = [(-1, i) for i in run.eval_ids]
    position, steps, e = None, 0, 0
    while steps < run.total_steps:
        if e == run.state["epoch"]:
            position = len(order) + run.state["epoch_samples"]
        batches = batches_of_epoch(run, e)
        for s in range(len(batches) // run.per_step):
            if steps == run.total_steps:
                break
            order += [(e, i) for b in batches[s * run.per_step : (s + 1) * run.per_step] for i in b]
            steps += 1
        e += 1
    return order, len(order) if position is None else position


def epoch_steps(run: Run):
    """The steps left in the current epoch, from the data position in `run.state` (each step a group
    of `per_step` micro-batches), and an iterator over this process's padded share of them."""
    cfg, state, e = run.cfg, run.state, run.state["epoch"]
    batches = batches_of_epoch(run, e)
    done, skip = 0, 0
    while done < state["epoch_samples"] and skip < len(batches):
        done += len(batches[skip])
        skip += 1
    if done != state["epoch_samples"]:
        raise ValueError(
            f"checkpoint data position {state['epoch_samples']} in epoch {e} is not a batch "
            "boundary: the data, seed or tokens_per_batch changed since it was saved"
        )
    batches = batches[skip:]
    groups = [
        batches[s : s + run.per_step] for s in range(0, len(batches) // run.per_step * run.per_step, run.per_step)
    ]
    world, rank = run.accelerator.num_processes, run.accelerator.process_index
    mine = [
        (skip + s * run.per_step + j, b)
        for s, group in enumerate(groups)
        for j, b in enumerate(group)
        if j % world == rank
    ]
    seeds = [draw_seed(cfg.seed, e, index) for index, _ in mine]
    data = run.data.for_epoch(e) if isinstance(run.data, BufferedSamples) else run.data
    return groups, iter(loader(data, [b for _, b in mine], seeds, cfg, not run.source.online))


def optimizer_step(run: Run, objective, group: list[list[int]], stream) -> dict:
    """One step over the micro-batches of `group`: this process's share from `stream`, forward and
    backward each (gradients synced on the last), clip, step; advances the data position and
    returns the step's pooled metrics."""
    cfg, accelerator, state = run.cfg, run.accelerator, run.state
    accum = cfg.gradient_accumulation_steps
    start = time.perf_counter()

    def backward(loss):
        accelerator.backward(loss / accum)

    per_batch = []
    for j in range(accum):
        padded = next(stream)
        sync = contextlib.nullcontext() if j == accum - 1 else accelerator.no_sync(run.model)
        with sync:
            per_batch.append(objective(run.model, run.source(padded), backward))
        per_batch[-1]["count_tokens"] = padded["attention_mask"].sum()  # not run.lengths: an engine's are bounds
    grad_norm = run.backend.grad_norm(accelerator, run.model, run.params, cfg.max_grad_norm)
    metrics = pool_metrics(per_batch, accelerator)
    refuse_non_finite_step(run, metrics["loss"], grad_norm, group, [m["loss"] for m in per_batch])
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)

    tokens = int(metrics.pop("count_tokens"))
    state["step"] += 1
    state["epoch_samples"] += sum(len(b) for b in group)
    state["samples_consumed"] += sum(len(b) for b in group)
    state["tokens_consumed"] += tokens
    metrics.update(
        lr=run.scheduler.get_last_lr()[0], tokens=tokens, tokens_per_s=tokens / (time.perf_counter() - start)
    )
    if grad_norm is not None:
        metrics["grad_norm"] = float(grad_norm)
    return metrics


def refuse_non_finite_step(run: Run, loss: float, grad_norm, group: list[list[int]], my_losses: list) -> None:
    """Stop before the optimizer applies a step whose pooled loss or global gradient norm is not finite.
    Every process sees the same values, so all stop together; they then pool which micro-batches had a
    non-finite loss (`my_losses`: this process's, in the order it ran its share of `group`)."""
    grad_norm = None if grad_norm is None else float(grad_norm)
    problems = [f"loss is {loss}"] if not math.isfinite(loss) else []
    if grad_norm is not None and not math.isfinite(grad_norm):
        problems.append(f"the gradient norm is {grad_norm}")
    if not problems:
        return
    accelerator = run.accelerator
    world, rank = accelerator.num_processes, accelerator.process_index
    at_fault = torch.zeros(len(group), device=accelerator.device)
    for j, batch_loss in zip(range(rank, len(group), world), my_losses):
        at_fault[j] = float(not math.isfinite(float(batch_loss)))
    at_fault = accelerator.reduce(at_fault, "sum").cpu()
    blamed = [b for b, bad in zip(group, at_fault) if bad] or group  # a gradient alone does not say which
    samples = sorted(i for b in blamed for i in b)
    shown = ", ".join(map(str, samples[:10])) + (f" ... ({len(samples)} in all)" if len(samples) > 10 else "")
    raise ValueError(
        f"step {run.state['step'] + 1}: {' and '.join(problems)} (samples {shown} of {run.cfg.data_path}, "
        "in store order): the data holds broken values or learning_rate is too high; "
        + last_good_checkpoint(run.cfg.output_dir)
    )


def held_out_metrics(run: Run, objective, when: str) -> dict | None:
    """Pooled metrics over the eval micro-batches, split round-robin over processes, logged as
    `eval <when>`. Processes with fewer batches repeat one without counting it, so sharded models
    see the same number of passes."""
    batches = pack_by_length(run.eval_ids, run.lengths, run.cfg.tokens_per_batch)
    if not batches:
        return None
    accelerator = run.accelerator
    w, r = accelerator.num_processes, accelerator.process_index
    mine = batches[r::w]
    rounds = math.ceil(len(batches) / w)
    seeds = [draw_seed(run.cfg.seed, -1, k) for k in range(len(batches))]
    results = []
    padding = rounds - len(mine)  # a process without a batch of its own (fewer batches than processes) repeats one
    stream = loader(
        run.data, mine + batches[:1] * padding, seeds[r::w] + seeds[:1] * padding, run.cfg, not run.source.online
    )
    with torch.no_grad():
        for k, padded in enumerate(stream):
            metrics = objective(run.model, run.source(padded), lambda loss: None)
            if k < len(mine):
                results.append(metrics)
    pooled = pool_metrics(results, accelerator, keys=metrics.keys())
    if pooled:
        log_metrics(run, pooled, "eval")
        accelerator.print(f"eval {when}: {summary(pooled)}")
    return pooled


def show_step(bar, metrics: dict, run: Run) -> None:
    bar.update(1)
    bar.set_postfix(
        loss=f"{metrics['loss']:.3f}",
        acc0=f"{metrics.get('acc_0', 0):.3f}",
        al=f"{metrics.get('sim_al', 0):.2f}",
        tok_s=f"{metrics['tokens_per_s']:.0f}",
    )
    step = run.state["step"]
    if run.cfg.log_every and step % run.cfg.log_every == 0 and run.accelerator.is_main_process:
        feed = f" | {run.data.status()}" if isinstance(run.data, BufferedSamples) else ""
        bar.write(
            f"step {step}/{run.total_steps} | {summary(metrics)} | lr {metrics['lr']:.2e} | "
            f"{metrics['tokens_per_s']:.0f} tok/s{feed}"
        )


def write_final_head(run: Run, checkpoint: Path) -> None:
    """<output_dir>/final: the last checkpoint's head."""
    if run.accelerator.is_main_process:
        final = Path(run.cfg.output_dir) / "final"
        shutil.rmtree(final, ignore_errors=True)
        shutil.copytree(checkpoint / "head", final)
        print(f"final head: {final} ({run.state['step']} steps, {run.state['tokens_consumed']} tokens)")
    run.accelerator.wait_for_everyone()


def warn_idle_cores(accelerator, world: int) -> None:
    """On a CPU, `accelerate launch` without --cpu sets OMP_NUM_THREADS=1: say so when cores sit idle."""
    if accelerator.device.type != "cpu":
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if torch.get_num_threads() * world < cores:
        accelerator.print(
            f"warning: {torch.get_num_threads()} CPU thread(s) per process, {cores} cores: `accelerate launch` "
            "sets OMP_NUM_THREADS=1 unless given --num_cpu_threads_per_process N (or OMP_NUM_THREADS=N)"
        )


SUPERVISION_STEPS = 10  # steps of this invocation after which a run that supervised nothing stops


def check_supervised(history: list[dict], data_path, last: bool) -> None:
    """Stop a run whose first steps supervised no position: its loss is 0 and it would learn nothing."""
    checked = len(history) == SUPERVISION_STEPS or (last and len(history) < SUPERVISION_STEPS)
    if checked and sum(m.get("count_0", 0) for m in history) == 0:
        raise ValueError(
            f"{len(history)} steps supervised no position: no trained token of {data_path} is both loss-masked "
            "(within max_length) and a next token of the target inside the draft vocabulary. Check the loss masks "
            "(eagle-prep show-mask), max_length, and that the data's vocab map and store come from this target"
        )


def train(cfg: TrainConfig, build_head, objective, data=None) -> dict:
    """Run (or resume) training; returns {"history", "eval_before", "eval_after", "checkpoint", "world_size"}.

    `data`: the samples, when not the store at data_path: `BufferedSamples`, which an engine writes as they are read
    (it is told the run's reading order once the run is set up).

    `cfg.stop_after_step` ends this invocation right after that step's checkpoint, as a kill would:
    the schedule stays that of the whole run, and `resume=auto` continues it.
    """
    validate(cfg, load_target_config(cfg.target))  # before any compute
    accelerator = make_accelerator(cfg, trackers(cfg))
    if cfg.report_to == "tensorboard" and not is_tensorboard_available():  # accelerate drops it without a word
        accelerator.print("tensorboard is not installed: logging to the console and metrics.jsonl only")
    resume_from, skipped = resolve_resume(cfg, accelerator.num_processes, backend_of(accelerator).layout)
    run = set_up(cfg, accelerator, build_head, resume_from, data)
    for line in skipped:
        run.accelerator.print(line)
    if resume_from is not None:
        restore(run, resume_from)
    if isinstance(run.data, BufferedSamples):
        run.data.begin(*reading_order(run), main=run.accelerator.is_main_process)
    state, world = run.state, run.accelerator.num_processes
    if run.accelerator.is_main_process:
        keep_metrics_through(cfg.output_dir, state["step"] if resume_from is not None else -1)
    result = {"history": [], "eval_before": None, "eval_after": None, "world_size": world}
    run.accelerator.print(
        f"{cfg.method} on {cfg.target} ({cfg.mode}): {len(run.train_ids)} train / "
        f"{len(run.eval_ids)} eval samples, {run.total_steps} steps of {run.per_step} micro-batches "
        f"(<= {cfg.tokens_per_batch} tokens each), {world} process(es) on {run.accelerator.device}, "
        f"{'bf16 autocast' if precision(cfg) == 'bf16' else 'fp32'}"
    )
    warn_idle_cores(run.accelerator, world)
    if state["step"] == 0:
        result["eval_before"] = held_out_metrics(run, objective, "before training")

    # stopping is a kill right after that step's checkpoint: no final eval, no final head
    stopping = state["step"] < cfg.stop_after_step < run.total_steps
    end = cfg.stop_after_step if stopping else run.total_steps
    last_saved = None
    try:
        with tqdm(
            total=run.total_steps, initial=state["step"], disable=not run.accelerator.is_main_process, desc="train"
        ) as bar:
            while state["step"] < end:
                groups, stream = epoch_steps(run)
                for group in groups:
                    metrics = optimizer_step(run, objective, group, stream)
                    result["history"].append(metrics)
                    check_supervised(result["history"], cfg.data_path, last=state["step"] >= end)
                    log_metrics(run, metrics, "train")
                    show_step(bar, metrics, run)
                    if cfg.eval_every and state["step"] % cfg.eval_every == 0 and state["step"] < run.total_steps:
                        held_out_metrics(run, objective, f"step {state['step']}")
                    if cfg.save_every and state["step"] % cfg.save_every == 0:
                        last_saved = save_checkpoint(run)
                    if state["step"] >= end:
                        break
                if state["step"] < end:
                    state["epoch"] += 1
                    state["epoch_samples"] = 0

        if last_saved is None or last_saved.name != f"checkpoint-{state['step']}":
            last_saved = save_checkpoint(run)
        if not stopping:
            result["eval_after"] = held_out_metrics(run, objective, "after training")
            write_final_head(run, last_saved)
    finally:
        run.accelerator.end_training()  # what was logged reaches TensorBoard / wandb even when the run stops
    return {**result, "checkpoint": last_saved}
