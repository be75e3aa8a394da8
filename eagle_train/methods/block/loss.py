"""The block drafters' training objective: blocks at random anchors, each drafting as the runtime would.

For tokens x_0..x_{T-1}, a block at anchor a reads x_a and the target's states at positions < a (what the
runtime has when the target last verified x_a) and drafts x_{a+1}..x_{a+D}. Draft j is trained toward the
target's distribution at a+j-1 (the one that predicts x_{a+j}); it is supervised iff x_{a+j} exists, is an
assistant token (loss_mask) and the target's argmax there lies in the draft vocabulary. Anchors are drawn per
sequence among the positions 1 <= a <= T-2 where x_a and x_{a+1} are assistant tokens (the runtime's blocks
start at an answer token: the prefill emits the answer's first): no block reads the state at a sequence's last
position (a vLLM store holds zeros there) or at its anchor.

loss = sum over supervised drafts of w_j x loss_j / sum of w_j, w_j = exp(-(j-1)/gamma): the first drafts
decide acceptance, so they weigh most. loss_j is `training_parts.loss_rows` (soft cross-entropy, mixed with total
variation by `tv_weight`), over logits carrying DSpark's Markov bias from the true previous token (what the
runtime reads whenever the drafts before j were accepted, the only case in which draft j matters); with a
confidence head, plus `confidence_weight` x the binary cross-entropy of its logit against draft j's chance
of acceptance when sampled, 1 - TV(draft, target) (DSpark's label; detached), weighted alike.
"""

import torch
import torch.nn.functional as F

from eagle_train.methods.block.config import CONFIDENCE_WEIGHT
from eagle_train.train_config import TV_WEIGHT
from eagle_train.training_parts import chain_rounds, loss_rows_on, target_distribution


def default_gamma(block_size: int) -> float:
    """The position-weight decay for a block size: 7 at 16 slots, 5 at 10, 4 at 8 (the DFlash paper's)."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, block_size / 2)


def sample_anchors(loss_mask, num_anchors: int, generator):
    """(anchors [B, n], valid [B, n]): up to `num_anchors` distinct anchors per row, drawn uniformly among
    the positions 1 <= a <= T-2 with loss_mask[a] and loss_mask[a+1], n the most any row got; invalid entries
    read anchor 1."""
    b, t = loss_mask.shape
    mask = loss_mask.bool().cpu()
    candidates = torch.zeros(b, t, dtype=torch.bool)
    candidates[:, 1 : t - 1] = mask[:, 1 : t - 1] & mask[:, 2:]
    rows = []
    for row in candidates:
        where = row.nonzero().flatten()
        pick = torch.randperm(len(where), generator=generator)[:num_anchors]
        rows.append(where[pick].sort().values)
    n = max(1, max(len(r) for r in rows))
    anchors = torch.ones(b, n, dtype=torch.long)
    valid = torch.zeros(b, n, dtype=torch.bool)
    for i, r in enumerate(rows):
        anchors[i, : len(r)], valid[i, : len(r)] = r, True
    return anchors.to(loss_mask.device), valid.to(loss_mask.device)


def block_loss(
    head,
    aux_hidden,
    input_ids,
    loss_mask,
    target_probs,
    in_draft,
    anchors,
    valid,
    gamma: float,
    tv_weight: float = TV_WEIGHT,
    confidence_weight: float = CONFIDENCE_WEIGHT,
):
    """(loss, metrics) of the blocks at `anchors` [B, n] (`valid` [B, n]; `sample_anchors`).

    metrics (detached scalars): `loss`, per draft j (index i = j-1) `loss_i`, `acc_i` (top-1 agreement with the
    target over its supervised drafts), `count_i`; `count_rounds` (blocks whose first draft is supervised) and
    `count_chain_tokens` (over those, 1 + the drafts accepted before the first miss: the trainer's chain_al is
    the AL greedy block drafting gets at a random anchor); with a confidence head `confidence_bce`.
    """
    h = head.forward_blocks(aux_hidden, input_ids, anchors)[:, :, head.draft_slots()]  # [B, n, D, H]
    d = h.shape[2]
    at, supervised, prev = draft_targets(anchors, d, input_ids, loss_mask, in_draft)
    supervised = supervised & valid[..., None]
    where = supervised.nonzero(as_tuple=True)
    logits, confidence = head.draft_logits(h[where], prev[where])
    probs = target_probs[where[0], at[where] - 1]
    losses, agree = loss_rows_on(logits.device)(logits, probs, tv_weight)
    weight = torch.exp(-where[2].float() / gamma)
    total_weight = weight.sum().clamp(min=1e-12)
    loss = (weight * losses).sum() / total_weight
    metrics = {}
    if confidence is not None:
        with torch.no_grad():
            accepted = 1 - 0.5 * (torch.softmax(logits.float(), -1) - probs).abs().sum(-1)
        bce = F.binary_cross_entropy_with_logits(
            confidence.float(), accepted.clamp(0, 1), weight=weight, reduction="sum"
        )
        bce = bce / total_weight
        loss = loss + confidence_weight * bce
        metrics["confidence_bce"] = bce.detach()
    for i in range(d):
        at_i = where[2] == i
        count = at_i.sum()
        metrics[f"loss_{i}"] = (losses[at_i].sum() / count.clamp(min=1)).detach()
        metrics[f"acc_{i}"] = (agree[at_i].sum() / count.clamp(min=1)).detach()
        metrics[f"count_{i}"] = count.detach()
    correct = torch.zeros(supervised.shape, dtype=torch.bool, device=supervised.device)
    correct[where] = agree
    leading = correct.long().cumprod(-1).sum(-1)
    rounds = supervised[..., 0]
    metrics["loss"] = loss.detach()
    metrics["count_rounds"] = rounds.sum().detach()
    metrics["count_chain_tokens"] = (rounds * (1 + leading)).sum().detach()
    return loss, metrics


def draft_targets(anchors, d: int, input_ids, loss_mask, in_draft):
    """For drafts j = 1..d of the blocks at `anchors` [B, n]: (the position whose target distribution draft j is
    trained toward, plus one: x_{a+j}'s, clamped into the sequence [B, n, d]; whether draft j is supervised; the
    token before it, x_{a+j-1}, which DSpark's Markov bias reads)."""
    t = input_ids.shape[1]
    position = anchors[..., None] + torch.arange(1, d + 1, device=anchors.device)
    at = position.clamp(max=t - 1)
    supervised = (position < t) & read_at(loss_mask.bool(), at) & read_at(in_draft, at - 1)
    return at, supervised, read_at(input_ids, at - 1)


def read_at(x, at):
    """x [B, T] read at positions at [B, ...] of its row."""
    return x.gather(1, at.flatten(1)).view(at.shape)


@torch.no_grad()
def block_walk(head, samples, target_logits, k: int) -> tuple[int, int]:
    """(tokens, rounds) of greedy block drafting, the first `k` drafts of each block, over the answers of
    `samples` (EAGLE-3's `chain_walk`'s samples): a block at every answer position in one pass, then
    `training_parts.chain_rounds` over where each is right. A round whose last committed token is x_t drafts from the
    block anchored at the pending token x_{t+1}: what `inference` runs on this text, as `chain_walk` is for EAGLE-3."""
    dtype, device = head.lm_head.weight.dtype, head.lm_head.weight.device
    tokens = rounds = 0
    for sample in samples:
        x, mask = sample["input_ids"][None].to(device), sample["loss_mask"][None].to(device).bool()
        t = x.shape[1]
        probs, in_draft = target_distribution(
            sample["final_hidden"][None].to(device).float(), target_logits, head.t2d, mask
        )
        anchors = torch.arange(1, t - 1, device=device)[None]
        with torch.autocast(device.type, dtype, enabled=dtype != torch.float32):
            h = head.forward_blocks(sample["aux_hidden"][None].to(device, dtype), x, anchors)
        h = h[:, :, head.draft_slots()[:k]]  # [1, T-2, k, H]
        at, supervised, prev = draft_targets(anchors, h.shape[2], x, mask, in_draft)
        logits, _ = head.draft_logits(h, prev)
        right = logits.float().argmax(-1) == probs[0, (at - 1)[0]].argmax(-1)[None]
        correct = torch.zeros(1, h.shape[2], t, dtype=torch.bool)
        correct[0, :, : t - 2] = (supervised & right)[0].T.cpu()  # EAGLE-3's anchor t = the block's a - 1
        walked, _ = chain_rounds(correct, mask.cpu())
        tokens, rounds = tokens + sum(a + 1 for *_, a in walked), rounds + len(walked)
    return tokens, rounds
