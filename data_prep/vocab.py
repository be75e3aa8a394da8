"""Draft vocabulary: the target ids the draft head may propose, chosen by frequency.

The draft's lm_head covers only the `Vd` ids seen most often among loss-masked tokens (what the
draft is trained to predict), which cuts its largest matmul; docs/design.md section 3 fixes the map.
A small dataset leaves ids at count 0 (a store of 600 answers uses ~6k ids): answers from wider
text (`count_answer_tokens`) rank those, so the map fills with words answers elsewhere use.
"""

import itertools
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from data_prep.readers import read_conversations
from eagle_train.files import write_safetensors
from eagle_train.store import ShardedSamples, write_vocab_map
from eagle_train.vocab_map import DRAFT_VOCAB_SIZE, top_k_vocab_map


def count_tokens(samples, vocab_size: int) -> torch.Tensor:
    """Counts of each target id among loss-masked tokens; `samples` yield input_ids and loss_mask."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for s in samples:
        ids = s["input_ids"][s["loss_mask"]]
        counts += torch.bincount(ids, minlength=vocab_size)[:vocab_size]
    return counts


def count_answer_tokens(source: str, tokenizer, vocab_size: int, limit: int) -> torch.Tensor:
    """Counts of each target id in the assistant turns of the first `limit` conversations of `source`
    (any `read_conversations` source), each turn's text tokenized alone."""
    return count_turn_tokens(itertools.islice(read_conversations(source), limit), tokenizer, vocab_size, limit)


def count_turn_tokens(conversations, tokenizer, vocab_size: int, total: int | None = None) -> torch.Tensor:
    """`count_answer_tokens` of the conversations given (`total` of them, for the progress bar)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for conv in tqdm(conversations, total=total, unit="conv", desc="count"):
        for m in conv["messages"]:
            if m["role"] == "assistant":
                ids = torch.tensor(tokenizer(m["content"], add_special_tokens=False)["input_ids"], dtype=torch.int64)
                counts += torch.bincount(ids, minlength=vocab_size)[:vocab_size]
    return counts


FILL_COUNTS = "vocab_fill.safetensors"  # beside the vocab map, which every run of distil or tokenize rewrites


def write_fill_counts(path, fill: torch.Tensor, record: dict) -> None:
    """Keep `count_answer_tokens`' counts beside the data's vocab map, with what they counted (`record`), so a
    rerun takes them instead of counting again."""
    write_safetensors(Path(path) / FILL_COUNTS, {"fill": fill.contiguous()}, metadata=record)


def kept_fill_counts(path, record: dict) -> torch.Tensor | None:
    """The counts `write_fill_counts` kept at `path`, if they counted what `record` says; else None."""
    file = Path(path) / FILL_COUNTS
    if not file.is_file():
        return None
    with safe_open(str(file), framework="pt") as f:
        return f.get_tensor("fill") if f.metadata() == record else None


def build_vocab_map(counts: torch.Tensor, draft_vocab_size: int = DRAFT_VOCAB_SIZE, fill=None) -> dict:
    """Top-Vd ids by count (ties by `fill`'s counts when given, then to the lower id), sorted ascending, as
    `d2t`/`t2d`, plus coverage.

    `target_id = draft_id + d2t[draft_id]`; `t2d[target_id]` is true for ids in the draft vocab.
    `coverage` is the fraction of loss-masked tokens the draft vocabulary can express.
    """
    vmap = top_k_vocab_map(counts, draft_vocab_size, fill)
    total = int(counts.sum())
    coverage = float(counts[vmap["t2d"]].sum()) / total if total else 0.0
    return {**vmap, "counts": counts, "coverage": coverage, **({} if fill is None else {"fill": fill})}


def make_vocab_map(path, vocab_size: int, draft_vocab_size: int = DRAFT_VOCAB_SIZE, fill=None) -> dict:
    """Count a tokenized dataset or store at `path` and write its `vocab_map.safetensors` (with `fill`, the
    wider text's counts that rank its ties)."""
    data = ShardedSamples(path)
    counts = count_tokens((data.tokens(i) for i in range(len(data))), vocab_size)
    vmap = build_vocab_map(counts, draft_vocab_size, fill)
    write_vocab_map(path, vmap["d2t"], vmap["t2d"], vmap["counts"], fill)
    return vmap


def coverage_line(vmap: dict) -> str:
    n = int((vmap["counts"] > 0).sum())
    return (
        f"draft vocab {len(vmap['d2t'])} of {len(vmap['t2d'])} ids covers {100 * vmap['coverage']:.2f}% "
        f"of {int(vmap['counts'].sum())} loss-masked tokens ({n} distinct ids seen)"
    )
