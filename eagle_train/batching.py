"""Length-grouped batches under a padded-token budget: the trainer's micro-batches and capture's
forward batches, cut by one rule.

A batch is right-padded to its longest sample, so it costs count x longest tokens; sorting by
length before cutting keeps that close to the real token count.
"""

import torch

GROUP_SAMPLES = 512  # samples sorted by length together: big enough to pad little, small enough to mix


def pack_by_length(indices: list[int], lengths: list[int], tokens_per_batch: int) -> list[list[int]]:
    """Longest first, greedily: a batch's padded size (count x its longest) stays within the budget
    (a longer sample gets a batch of its own)."""
    batches, batch = [], []
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        if batch and (len(batch) + 1) * lengths[batch[0]] > tokens_per_batch:
            batches.append(batch)
            batch = []
        batch.append(i)
    return batches + ([batch] if batch else [])


def epoch_batches(indices: list[int], lengths: list[int], tokens_per_batch: int, seed: int, epoch: int):
    """Epoch `epoch`'s micro-batches: shuffle, length-group within blocks of GROUP_SAMPLES, shuffle batches."""
    g = torch.Generator().manual_seed(seed * 100_003 + epoch + 1)
    order = [indices[i] for i in torch.randperm(len(indices), generator=g).tolist()]
    batches = []
    for start in range(0, len(order), GROUP_SAMPLES):
        batches += pack_by_length(order[start : start + GROUP_SAMPLES], lengths, tokens_per_batch)
    return [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()]
