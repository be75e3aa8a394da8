"""Training-time test (TTT) for the EAGLE-3 head: the unrolled draft chain and its loss.

For tokens x_0..x_{T-1}, TTT step i at position t reads embed(x_{t+i+1}) at RoPE position t+i
(step 0 also reads fc(g_t), step i > 0 the pre-norm output of step i-1 at t) and is trained
toward the target distribution at t+i+1, which predicts x_{t+i+2}. It is supervised iff that
token is an assistant token (loss_mask[t+i+2]), it exists (t+i+2 < T) and the target's own
argmax at t+i+1 lies in the draft vocabulary (otherwise the draft cannot match it).

The target distribution is computed once per batch (`eagle_train.training_parts.target_distribution`) and shifted
per step; the other methods read the same tensors.

Step i at anchor t is the i-th draft of a runtime round whose last committed token is x_t (the
round verifies x_{t+1} and drafts x_{t+2}..x_{t+K+1}). On the target's own greedy text (`eagle-prep
distil`), which greedy speculative decoding reproduces token for token, the rounds the runtime would
run follow from the steps' top-1 agreement alone (`chain_rounds`): the loss can then weigh the drafts
the current head gets rejected at, the states its own drafting leads to (`rejection_weight`).
"""

import torch
from torch.utils.checkpoint import checkpoint

from eagle_train.fused_ce import soft_cross_entropy
from eagle_train.methods.eagle3.config import REJECTION_WEIGHT, TTT_DECAY
from eagle_train.train_config import TTT_LENGTH, TV_WEIGHT
from eagle_train.training_parts import chain_rounds, loss_rows_on, shift_left, target_distribution


def step_loss(head, h, target_probs, tv_weight: float = TV_WEIGHT):
    """Per row, (1 - tv_weight) x soft cross-entropy + tv_weight x total variation [N], and top-1 agreement
    bool [N] (`loss_rows` of the head's logits). h [N, H] are the supervised positions only: the lm_head (the
    head's largest matmul) and the [N, Vd] logits are then paid for supervised positions alone."""
    logits = head.logits(h)
    return loss_rows_on(logits.device)(logits, target_probs, tv_weight)


def ttt_loss(
    head,
    aux_hidden,
    input_ids,
    loss_mask,
    target_probs,
    in_draft,
    ttt_length: int = TTT_LENGTH,
    decay: float = TTT_DECAY,
    checkpoint_logits: bool = False,
    fused_loss: bool = False,
    tv_weight: float = TV_WEIGHT,
    rejection_weight: float = REJECTION_WEIGHT,
):
    """Unroll `head` for `ttt_length` steps and return (loss, metrics).

    loss = sum_i decay**i * loss_i, loss_i step i's `step_loss` (soft cross-entropy, mixed with
    total variation by `tv_weight`) averaged over its supervised positions, each weighing 1, or
    1 + `rejection_weight` where the chain walk of `chain_rounds` (K = ttt_length) rejects the
    draft. metrics (detached scalars): `loss`, `loss_i`, `acc_i` (top-1 agreement of draft and
    target over step i's supervised positions), `count_i` (their number), and the walk's
    `count_rounds` and `count_chain_tokens` (rounds and the tokens they emit).

    Each step's draft logits [N, Vd] dominate memory (Vd >> H). With `checkpoint_logits`
    they are not kept for backward but recomputed from the step's [N, H] output; with `fused_loss`
    they never exist (`eagle_train.fused_ce`: lm_head + loss + agreement one vocab chunk at a time).
    Right padding needs no key mask: attention is causal (plus same-position diagonal keys), so a
    real position never sees a later padded one, and padded positions have loss_mask False.
    """
    if ttt_length < 1:
        raise ValueError(f"ttt_length must be >= 1, got {ttt_length}")
    b, t = input_ids.shape
    positions = torch.arange(t, device=input_ids.device).expand(b, t)
    # position p is supervised at step i iff p+i+2 < T, loss_mask[p+i+2] and in_draft[p+i+1]
    supervised_at = [loss_mask[:, i + 2 :] & in_draft[:, i + 1 : t - 1] for i in range(ttt_length)]
    hidden, past = head.fuse(aux_hidden), []
    steps = []  # per step: its supervised mask [B, n] and per-row loss and agreement
    for i, supervised in enumerate(supervised_at):
        hidden = head.ttt_step(
            hidden, shift_left(input_ids, i + 1), positions + i, past, rows_used(supervised_at, i, t)
        )
        h = hidden[:, : supervised.shape[1]][supervised]
        if fused_loss:  # each row's target is read in place: row b*T + p+i+1 of the [B*T, Vd] targets
            where = supervised.nonzero()
            rows = where[:, 0] * t + where[:, 1] + i + 1
            loss_rows, agree = soft_cross_entropy(
                head.normed(h), head.lm_head.weight, target_probs.reshape(b * t, -1), rows, tv_weight=tv_weight
            )
        else:
            probs = target_probs[:, i + 1 : t - 1][supervised]
            if checkpoint_logits and torch.is_grad_enabled():
                loss_rows, agree = checkpoint(step_loss, head, h, probs, tv_weight, use_reentrant=False)
            else:
                loss_rows, agree = step_loss(head, h, probs, tv_weight)
        steps.append((supervised, loss_rows, agree))
    correct = torch.zeros(b, ttt_length, t, dtype=torch.bool)
    for i, (supervised, _, agree) in enumerate(steps):
        correct[:, i, : supervised.shape[1]][supervised.cpu()] = agree.cpu()
    rounds, rejected = chain_rounds(correct, loss_mask.cpu())
    total = 0.0
    metrics = {}
    for i, (supervised, loss_rows, agree) in enumerate(steps):
        weight = torch.ones_like(loss_rows)
        if rejection_weight:
            weight = weight + rejection_weight * rejected[:, i, : supervised.shape[1]].to(weight.device)[supervised]
        loss_i = (weight * loss_rows).sum() / weight.sum().clamp(min=1)
        total = total + decay**i * loss_i
        count = supervised.sum()
        metrics[f"loss_{i}"] = loss_i.detach()
        metrics[f"acc_{i}"] = (agree.sum() / count.clamp(min=1)).detach()
        metrics[f"count_{i}"] = count.detach()
    metrics["loss"] = total.detach()
    metrics["count_rounds"] = torch.tensor(len(rounds))
    metrics["count_chain_tokens"] = torch.tensor(sum(a + 1 for *_, a in rounds))
    return total, metrics


def rows_used(supervised_at, i: int, t: int):
    """bool [B, T]: the positions whose step-i output is used, by step i's loss or a later step's (step j at
    position p reads step j-1's output at p). Prompts and padding are not: they only lend step 0 their keys."""
    used = torch.zeros(supervised_at[0].shape[0], t, dtype=torch.bool, device=supervised_at[0].device)
    for supervised in supervised_at[i:]:
        used[:, : supervised.shape[1]] |= supervised
    return used


@torch.no_grad()
def chain_walk(head, samples, target_logits, k: int) -> tuple[int, int]:
    """(tokens, rounds) of greedy chain drafting with K = `k` drafts over the answers of `samples` (dicts of
    input_ids [T], loss_mask [T], aux_hidden [T, 3H], final_hidden [T, H], a store's or `generate_and_capture`'s):
    `ttt_loss`'s walk (`chain_rounds` over the head's top-1 agreement with the target), the one the trainer's
    eval reports as chain_al; tokens / rounds is the AL greedy chain decoding gets on that text. The target's
    distribution comes from `target_logits` in fp32; the head runs in its own dtype (autocast when not fp32)."""
    dtype = head.lm_head.weight.dtype
    device = head.lm_head.weight.device
    tokens = rounds = 0
    for sample in samples:
        x, mask = sample["input_ids"][None].to(device), sample["loss_mask"][None].to(device)
        final = sample["final_hidden"][None].to(device).float()
        probs, in_draft = target_distribution(final, target_logits, head.t2d, mask)
        aux = sample["aux_hidden"][None].to(device, dtype)
        with torch.autocast(device.type, dtype, enabled=dtype != torch.float32):
            _, metrics = ttt_loss(head, aux, x, mask, probs, in_draft, ttt_length=k)
        tokens, rounds = tokens + int(metrics["count_chain_tokens"]), rounds + int(metrics["count_rounds"])
    return tokens, rounds
