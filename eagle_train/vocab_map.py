"""The draft vocabulary map: which target ids a draft head may propose, and how its ids map to them.

The draft ids are the `k` target ids seen most often among loss-masked tokens (ties, the ids the data
never shows among them, go to those more frequent in wider text when its counts are given, then to the
lower id), sorted ascending. `d2t[j]` is the offset from draft id j to its target id
(`target_id = j + d2t[j]`, the form the engines read); `t2d[t]` is True for the target ids in the
draft vocabulary, and follows from `d2t`.
"""

import torch

DRAFT_VOCAB_SIZE = 32000  # the default draft vocabulary size, that of the published EAGLE-3 heads


def check_draft_vocab_size(draft_vocab_size: int, vocab_size: int, hint: str = "") -> None:
    """A draft vocabulary is a subset of the target's; `hint` follows the fix in the message."""
    if draft_vocab_size > vocab_size:
        raise ValueError(
            f"draft_vocab_size {draft_vocab_size} is larger than the target vocabulary {vocab_size}; "
            f"use at most {vocab_size}{hint}"
        )


def t2d_from_d2t(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [vocab_size]: True at the target ids the draft ids of `d2t` map to."""
    t2d = torch.zeros(vocab_size, dtype=torch.bool, device=d2t.device)
    t2d[torch.arange(len(d2t), device=d2t.device) + d2t] = True
    return t2d


def top_k_vocab_map(counts: torch.Tensor, k: int, fill: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """`d2t` / `t2d` of the `k` most frequent ids of `counts` [V] (all V when k >= V); equal counts go by
    `fill` [V] (counts of wider text: a small dataset leaves many ids at 0), then to the lower id."""
    order = torch.arange(len(counts), device=counts.device)
    if fill is not None:
        order = torch.sort(-fill, stable=True).indices  # stable: equal counts stay in id order
    ids = order[torch.sort(-counts[order], stable=True).indices][:k].sort().values
    d2t = ids - torch.arange(len(ids), device=ids.device)
    return {"d2t": d2t, "t2d": t2d_from_d2t(d2t, len(counts))}
