"""Conversations -> a tokenized dataset directory (ids + assistant loss masks, no hidden states).

This is what capture and online training read. It uses the store's shard layout
(`eagle_train.store`, format "eagle-tokenized"), so the trainer needs no dataset readers.
"""

import multiprocessing
import os
from pathlib import Path

import torch

from data_prep.chat import MAX_LENGTH, SkipSample, tokenize_conversation
from data_prep.readers import ReadReport, read_conversations
from data_prep.vocab import build_vocab_map, count_tokens
from eagle_train.store import (
    MANIFEST,
    TOKENIZED_FORMAT,
    StoreWriter,
    chat_template_fingerprint,
    finalize_manifest,
    list_shards,
    target_identity,
    write_vocab_map,
)
from eagle_train.target import load_target_config, load_tokenizer
from eagle_train.vocab_map import DRAFT_VOCAB_SIZE


def clear_dir(path: Path) -> None:
    """Remove a previous dataset's shards and manifest (only files this toolkit writes)."""
    for _, name in list_shards(path):
        os.remove(path / name)
    (path / MANIFEST).unlink(missing_ok=True)


_WORKER: dict = {}


def _init_worker(tokenizer, max_length, system_prompt):
    _WORKER.update(tokenizer=tokenizer, max_length=max_length, system_prompt=system_prompt)


def _tokenize_or_skip(conv):
    """A sample as numpy arrays (cheap to send between processes), or (the SkipSample reason, the conversation's id)."""
    try:
        sample = tokenize_conversation(
            _WORKER["tokenizer"], conv["messages"], _WORKER["max_length"], _WORKER["system_prompt"]
        )
    except SkipSample as e:
        return str(e), conv["id"]
    return {k: v.numpy() for k, v in sample.items()}


def tokenize_dataset(
    source: str,
    out: str,
    target: str,
    max_length: int = MAX_LENGTH,
    limit: int | None = None,
    system_prompt: str | None = None,
    draft_vocab_size: int = DRAFT_VOCAB_SIZE,
    shard_tokens: int = 1 << 20,
    split: str = "train",
    tokenizer=None,
    workers: int = 1,
) -> tuple[dict, ReadReport, dict]:
    """Read, render and mask up to `limit` conversations; write shards, manifest and vocab map.

    Returns (manifest, ReadReport, vocab map); conversations that cannot be used are reported, not fatal.
    `workers` > 1 renders and tokenizes in that many forked processes (same output, in order).
    """
    tokenizer = tokenizer or load_tokenizer(target)
    config = load_target_config(target)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    clear_dir(out)
    report = ReadReport()
    samples, shard, tokens, n = [], 0, 0, 0
    counts = torch.zeros(config.vocab_size, dtype=torch.int64)
    # `limit` counts usable samples, so it is applied here, after tokenization skips, not by the reader
    convs = read_conversations(source, report=report, split=split)
    pool = None
    if workers > 1:
        pool = multiprocessing.get_context("fork").Pool(workers, _init_worker, (tokenizer, max_length, system_prompt))
        results = pool.imap(_tokenize_or_skip, convs, chunksize=16)
    else:
        _init_worker(tokenizer, max_length, system_prompt)
        results = map(_tokenize_or_skip, convs)
    with StoreWriter(out) as writer:
        for result in results:
            if isinstance(result, tuple):
                reason, conversation_id = result
                report.kept -= 1
                report.skip(reason, f"conversation {conversation_id}")
                continue
            sample = {k: torch.from_numpy(v) for k, v in result.items()}
            samples.append(sample)
            counts += count_tokens([sample], config.vocab_size)
            tokens += len(sample["input_ids"])
            if tokens >= shard_tokens:
                writer.add_shard(shard, samples, range(n, n + len(samples)))
                n, shard, samples, tokens = n + len(samples), shard + 1, [], 0
            if limit is not None and n + len(samples) >= limit:
                break
        if samples:
            writer.add_shard(shard, samples, range(n, n + len(samples)))
    if pool is not None:
        pool.terminate()  # it may have read ahead past `limit`
        pool.join()
    report.kept = n + len(samples)
    report.read = report.kept + sum(report.skipped.values())  # workers read ahead: count what was used
    if report.kept == 0:
        raise ValueError(f"no usable conversations in {source!r}:\n{report.summary()}")
    vmap = build_vocab_map(counts, draft_vocab_size)
    write_vocab_map(out, vmap["d2t"], vmap["t2d"], vmap["counts"])
    manifest = finalize_manifest(
        out,
        {
            "format": TOKENIZED_FORMAT,
            "target": {**target_identity(config), "given": str(target)},
            "tokenizer": str(target),
            "chat_template_fingerprint": chat_template_fingerprint(tokenizer.chat_template),
            "system_prompt": system_prompt,
            "max_length": max_length,
            "source": str(source),
            "records_read": report.read,
            "skipped": dict(report.skipped),
        },
    )
    return manifest, report, vmap
