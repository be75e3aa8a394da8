"""Hidden-state capture: run the target over a tokenized dataset once and keep what the draft reads.

The work is planned up front and deterministically: samples sorted by length (longest first, so
an out-of-memory shows up in the first batch, not after an hour), cut into batches bounded by a
padded-token budget, grouped into shards of about `shard_tokens`. The plan is the same on every
run and in every process, so:

- resuming after a kill skips planned shards whose files exist (checked sample by sample) and
  recomputes only the rest, giving the same store as an uninterrupted run;
- with W processes, process r captures the planned shards k with k % W == r; rank 0 writes the
  manifest after a barrier.

The forward is `eagle_train.hidden_states.target_hidden_states`, the same function online
training calls, so offline and online data cannot differ.
"""

import contextlib
import shutil
import time
from pathlib import Path

import torch
from tqdm import tqdm

from eagle_train.batching import pack_by_length
from eagle_train.bf16 import data_engine_dtype
from eagle_train.files import write_json
from eagle_train.hidden_states import default_aux_layer_ids, target_hidden_states
from eagle_train.store import (
    HIDDEN_FORMAT,
    MANIFEST,
    STORE_DTYPES,
    VOCAB_MAP,
    ShardedSamples,
    StoreWriter,
    check_store_matches,
    encode_checked,
    encode_hidden,
    finalize_manifest,
    list_shards,
    parse_manifest,
    recorded_sha256,
    shard_damage,
    shard_name,
    shard_sample_ids,
    target_fingerprint,
    target_identity,
)
from eagle_train.target import files_fingerprint, load_target_config


def plan_shards(lengths: list[int], token_budget: int, shard_tokens: int) -> list[list[list[int]]]:
    """Shards -> batches -> sample indices: all samples packed by `pack_by_length` within
    `token_budget`, longest first, then cut into shards of about `shard_tokens` real tokens."""
    shards, shard, tokens = [], [], 0
    for b in pack_by_length(list(range(len(lengths))), lengths, token_budget):
        shard.append(b)
        tokens += sum(lengths[i] for i in b)
        if tokens >= shard_tokens:
            shards.append(shard)
            shard, tokens = [], 0
    if shard:
        shards.append(shard)
    return shards


def pad_batch(samples: list[dict], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad input_ids into [B, L] with an attention mask."""
    longest = max(len(s["input_ids"]) for s in samples)
    ids = torch.full((len(samples), longest), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(samples), longest), dtype=torch.int64)
    for b, s in enumerate(samples):
        ids[b, : len(s["input_ids"])] = s["input_ids"]
        mask[b, : len(s["input_ids"])] = 1
    return ids.to(device), mask.to(device)


def capture_batch(
    model, samples: list[dict], aux_layer_ids, pad_id: int, dtype: str | None = None, sample_ids=None
) -> list[dict]:
    """One padded forward; per-sample dicts of input_ids, loss_mask and the hidden states, on the CPU,
    already in the store's form `dtype` (`encode_hidden`: cast or fp8-quantized on the target's device;
    None keeps the model's dtype). Hidden states with inf or nan are refused, naming `sample_ids`.

    Each tensor crosses to the host in one copy per batch, not one per sample (each is a GPU sync).
    """
    device = next(model.parameters()).device
    ids, mask = pad_batch(samples, pad_id, device)
    aux, final = target_hidden_states(model, ids, mask, aux_layer_ids)
    finite = torch.isfinite(aux).all(-1) & torch.isfinite(final).all(-1)
    broken = (mask.bool() & ~finite).any(-1).tolist()
    if any(broken):
        names = [sample_ids[b] if sample_ids is not None else b for b, bad in enumerate(broken) if bad]
        raise ValueError(
            f"the target computed non-finite hidden states (inf or nan) for samples {names} of the tokenized "
            f"dataset, and a store must hold finite ones: leave those samples out (does the target overflow in "
            f"{model.dtype}?)"
        )
    b, t = ids.shape
    if dtype is None:
        encoded = {"aux_hidden": aux, "final_hidden": final}
    else:
        encoded = encode_hidden(aux.flatten(0, 1), final.flatten(0, 1), dtype)
    hidden = {k: v.view(b, t, -1).cpu() for k, v in encoded.items()}
    out = []
    for i, s in enumerate(samples):
        n = len(s["input_ids"])
        out.append({**s, **{k: v[i, :n] for k, v in hidden.items()}})
    return out


def _read_header(out: Path) -> dict | None:
    file = out / MANIFEST
    return parse_manifest(file) if file.is_file() else None


def start_store(
    out: Path,
    header: dict,
    config,
    fingerprint: str,
    target_name: str,
    aux_layer_ids,
    dtype: str,
    world_size=1,
    rank=0,
    barrier=None,
) -> dict:
    """Check `out` against the store this run would write and write its unfinished manifest; return the header.

    `header` holds what the writer knows (tokenizer, template, max_length, source, plan); the
    target (its `config` and weights' `fingerprint`), aux layers and dtype are added here. An
    existing store of another target, aux layer set, dtype, source or plan is refused, so a resume
    can only continue the same store.
    """
    barrier = barrier or (lambda: None)
    header = {
        "format": HIDDEN_FORMAT,
        "target": {**target_identity(config), "given": target_name, "fingerprint": fingerprint},
        "aux_layer_ids": list(aux_layer_ids),
        "dtype": dtype,
        **header,
        "num_processes": world_size,
        "complete": False,
    }
    existing = _read_header(out)
    if existing is not None:
        check_store_matches(existing, config, aux_layer_ids, fingerprint)
        for key in ("dtype", "plan", "source"):
            if existing.get(key) != header[key]:
                raise ValueError(
                    f"{out} was captured with {key}={existing.get(key)!r}, not {header[key]!r}: "
                    "resume with the same settings or capture into a new directory"
                )
    barrier()  # every process has checked before rank 0 writes anything
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        if existing is None:
            write_json(out / MANIFEST, header)
    barrier()
    return header


def pending_shards(out: Path, planned: dict[int, list[int]]) -> list[int]:
    """The planned shards (index -> sample ids) not yet in `out`, in order; a shard already there
    must hold exactly its planned samples. A shard whose bytes no longer match the checksum written
    beside it is damaged: it is deleted, said so, and pending again."""
    done = {k for k, _ in list_shards(out)}
    for k in sorted(done & planned.keys()):
        shard = out / shard_name(k)
        recorded = recorded_sha256(shard)
        damage = shard_damage(shard, recorded) if recorded else None
        if damage:
            print(f"{shard} is damaged ({damage}): computing it again")
            shard.unlink()
            done.discard(k)
        elif shard_sample_ids(shard) != planned[k]:
            raise ValueError(f"{shard} holds other samples than this plan; write into a new directory")
    return [k for k in sorted(planned) if k not in done]


def finish_store(out: Path, header: dict, num_shards: int) -> dict:
    """Check that shards 0..num_shards-1 (and only they) exist and write the finished manifest."""
    have = {k for k, _ in list_shards(out)}
    if have != set(range(num_shards)):
        raise RuntimeError(
            f"{out}: shards {sorted(set(range(num_shards)) - have)} are missing, "
            f"unexpected {sorted(have - set(range(num_shards)))}"
        )
    return finalize_manifest(out, {k: v for k, v in header.items() if k != "complete"})


def engine_dtype(engine: str, model, engine_options: dict | None) -> str:
    """The dtype a data engine runs in, which a store's plan records: hf runs the loaded `model` in its own, vllm
    in its options' or the data engines' rule (`data_engine_dtype`)."""
    return data_engine_dtype(engine_options) if engine == "vllm" else str(model.dtype).removeprefix("torch.")


def capture(
    model,
    data: str | Path,
    out: str | Path,
    *,
    target_name: str,
    aux_layer_ids=None,
    dtype: str = "bfloat16",
    token_budget: int = 8192,
    shard_tokens: int = 1 << 16,
    rank: int = 0,
    world_size: int = 1,
    barrier=None,
    pad_id: int = 0,
    engine: str = "hf",
    engine_options: dict | None = None,
    progress: bool = True,
) -> tuple[dict | None, dict]:
    """Capture `data` (a tokenized dataset dir) into the store `out`.

    Returns (the manifest, by the process that finished the store, else None; this process's {"tokens",
    "seconds", "shards"} this run). Refuses an existing store of another target, aux layer set, dtype or plan.
    Process `rank` of `world_size` captures the planned shards k with k % world_size == rank. With a `barrier`
    (e.g. `accelerator.wait_for_everyone`) the processes are one launch and rank 0 finishes the store; without
    one they are independent runs (`--shard i/n`) and the one that finds every shard written finishes it.

    `engine`: "hf" runs `model` here, batch by batch within `token_budget`; "vllm" has a vLLM engine prefill each
    shard's samples together (`engines.vllm_data.HiddenStatesServer`, `engine_options` passed to it; `model` unused,
    may be None).
    """
    if dtype not in STORE_DTYPES:
        raise ValueError(f"store dtype {dtype!r} not in {sorted(STORE_DTYPES)}")
    config = model.config if model is not None else load_target_config(target_name)
    ids = tuple(aux_layer_ids) if aux_layer_ids is not None else default_aux_layer_ids(config.num_hidden_layers)
    source = ShardedSamples(data)
    if source.has_hidden:
        raise ValueError(f"{data} is a hidden-state store; capture reads a tokenized dataset (eagle-prep tokenize)")
    check_store_matches(source.manifest, config)  # same vocabulary as the tokenizer that made it
    out = Path(out)
    plan = plan_shards(source.lengths(), token_budget, shard_tokens)
    dtype_run = engine_dtype(engine, model, engine_options)
    header = {
        "tokenizer": source.manifest["tokenizer"],
        "chat_template_fingerprint": source.manifest["chat_template_fingerprint"],
        "max_length": source.manifest["max_length"],
        "source": str(data),
        "plan": {
            "token_budget": token_budget,
            "shard_tokens": shard_tokens,
            "num_shards": len(plan),
            "source_samples": len(source),
            "source_tokens": source.manifest["num_tokens"],
            "engine": engine,
            "engine_dtype": dtype_run,  # no resume mixes dtypes
        },
    }
    fingerprint = target_fingerprint(model) if model is not None else files_fingerprint(target_name)
    writes_header = rank if barrier is not None else 0  # independent runs each write it if it is missing
    header = start_store(out, header, config, fingerprint, target_name, ids, dtype, world_size, writes_header, barrier)

    todo = pending_shards(out, {k: [i for b in plan[k] for i in b] for k in range(rank, len(plan), world_size)})
    lengths = source.lengths()
    total = sum(lengths[i] for k in todo for batch in plan[k] for i in batch)
    bar = tqdm(
        total=total,
        unit="tok",
        unit_scale=True,
        disable=not progress,
        desc=f"capture r{rank}" if world_size > 1 else "capture",
    )
    start = time.perf_counter()
    if engine == "vllm" and todo:
        from engines.vllm_data import HiddenStatesServer

        server = HiddenStatesServer(target_name, ids, engine_options)

        def captured(samples, sample_ids):
            return prefill(server, samples, sample_ids, dtype)
    else:
        server = contextlib.nullcontext()

        def captured(samples, sample_ids):
            return capture_batch(model, samples, ids, pad_id, dtype, sample_ids)

    with server, StoreWriter(out, dtype, rank=rank) as writer:
        for k in todo:
            samples, sample_ids = [], [i for batch in plan[k] for i in batch]
            for batch in plan[k] if engine == "hf" else [sample_ids]:  # vLLM batches a shard's samples itself
                samples += captured([source.tokens(i) for i in batch], batch)
                bar.update(sum(lengths[i] for i in batch))
            writer.add_shard(k, samples, sample_ids)
    bar.close()
    stats = {"tokens": total, "seconds": time.perf_counter() - start, "shards": len(todo)}
    if barrier is not None:
        barrier()
        if rank != 0:
            return None, stats
    elif {k for k, _ in list_shards(out)} != set(range(len(plan))):
        return None, stats
    manifest = finish_store(out, header, len(plan))
    if (Path(data) / VOCAB_MAP).is_file():
        shutil.copyfile(Path(data) / VOCAB_MAP, out / VOCAB_MAP)
    return manifest, stats


def prefill(server, samples: list[dict], sample_ids: list[int], dtype: str) -> list[dict]:
    """`capture_batch` by a vLLM engine: one prefill of every sample (asking one new token, whose hidden states
    are not kept), their rows in the store's form."""
    answers = server.answer([s["input_ids"].tolist() for s in samples], 1)
    out = []
    for s, answer, i in zip(samples, answers, sample_ids):
        n = len(s["input_ids"])
        if answer["input_ids"][:n].tolist() != s["input_ids"].tolist() or len(answer["aux_hidden"]) != n:
            raise RuntimeError(f"vLLM returned the hidden states of other tokens than sample {i}'s")
        where = f"the target's hidden states of sample {i} of the tokenized dataset"
        out.append({**s, **encode_checked(answer["aux_hidden"], answer["final_hidden"], dtype, where)})
    return out
