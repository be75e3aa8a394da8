"""Training-time test (TTT) for the EAGLE-3 head: the unrolled draft chain and its loss.

For tokens x_0..x_{T-1}, TTT step i at position t reads embed(x_{t+i+1}) at RoPE position t+i
(step 0 also reads fc(g_t), step i > 0 the pre-norm output of step i-1 at t) and is trained
toward the target distribution at t+i+1, which predicts x_{t+i+2}. It is supervised iff that
token is an assistant token (loss_mask[t+i+2]), it exists (t+i+2 < T) and the target's own
argmax at t+i+1 lies in the draft vocabulary (otherwise the draft cannot match it).

The target distribution is computed once per batch (`target_distribution`) and shifted per step;
P-EAGLE reads the same tensors.

Step i at anchor t is the i-th draft of a runtime round whose last committed token is x_t (the
round verifies x_{t+1} and drafts x_{t+2}..x_{t+K+1}). On the target's own greedy text (`eagle-prep
distil`), which greedy speculative decoding reproduces token for token, the rounds the runtime would
run follow from the steps' top-1 agreement alone (`chain_rounds`): the loss can then weigh the drafts
the current head gets rejected at, the states its own drafting leads to (`rejection_weight`).
"""

import functools
import warnings

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

from eagle_train.fused_ce import soft_cross_entropy

TTT_LENGTH = 7  # unrolled draft steps, the default
TTT_DECAY = 0.8  # step i's loss weighs decay**i, the default
TV_WEIGHT = 0.0  # the share of total variation in each step's loss, the default (soft cross-entropy alone)
REJECTION_WEIGHT = 0.0  # the extra weight of a draft a chain walk rejects, the default (every draft weighs 1)


@torch.no_grad()
def target_distribution(final_hidden, target_logits, t2d, loss_mask=None, in_draft=None):
    """Target probabilities over the draft vocabulary and where the target's argmax is a draft token.

    final_hidden [B, T, H] (post-norm), target_logits the target's `hidden_states.TargetLogits` (fp32),
    t2d bool [V] ->
    (softmax(target_logits[..., t2d]) [B, T, Vd] fp32, in_draft bool [B, T]).
    Draft id j is the j-th True entry of t2d (the draft ids are sorted ascending), which is
    what `d2t` encodes.

    With `loss_mask` [B, T], only the positions t with loss_mask[t+1] are computed: a TTT step (and a
    P-EAGLE depth) is trained toward position t only to predict an assistant token x_{t+1}, and the
    target's lm_head over its whole vocabulary is an offline step's largest matmul. Elsewhere probs
    are 0 and in_draft False.

    With `in_draft` known (from an earlier pass over the same samples), `target_logits` gives the draft
    vocabulary's logits alone (`TargetLogits.restricted(t2d)`): the whole vocabulary is needed only to
    find where the target's argmax falls outside it.
    """
    if loss_mask is None:
        needed = torch.ones(final_hidden.shape[:2], dtype=torch.bool, device=final_hidden.device)
    else:
        needed = shift_left(loss_mask.bool(), 1, False)
    probs = torch.zeros(*needed.shape, int(t2d.sum()), device=final_hidden.device)
    logits = target_logits(final_hidden[needed].float()).float()
    if in_draft is None:
        in_draft = torch.zeros_like(needed)
        in_draft[needed] = t2d[logits.argmax(-1)]
        logits = logits[:, t2d]
    elif logits.shape[-1] != probs.shape[-1]:
        raise ValueError(f"with in_draft known, target_logits must give the {probs.shape[-1]} draft logits alone")
    probs[needed] = torch.softmax(logits, dim=-1)
    return probs, in_draft


def shift_left(x, n: int, fill=0):
    """x[:, t] <- x[:, t + n] along dim 1, padding the last n positions with `fill`."""
    pad = torch.full_like(x[:, :n], fill)
    return torch.cat([x[:, n:], pad], dim=1)


def step_loss(head, h, target_probs, tv_weight: float = TV_WEIGHT):
    """Per row, (1 - tv_weight) x soft cross-entropy + tv_weight x total variation [N], and top-1 agreement
    bool [N] (`loss_rows` of the head's logits). h [N, H] are the supervised positions only: the lm_head (the
    head's largest matmul) and the [N, Vd] logits are then paid for supervised positions alone."""
    logits = head.logits(h)
    return loss_rows_on(logits.device)(logits, target_probs, tv_weight)


def loss_rows_on(device):
    """`loss_rows` as it runs best on `device`: compiled on the CPU (`compiled_loss_rows`), eager elsewhere."""
    return compiled_loss_rows() if device.type == "cpu" else loss_rows


def loss_rows(logits, target_probs, tv_weight: float = TV_WEIGHT):
    """Per row, (1 - tv_weight) x soft cross-entropy + tv_weight x total variation [N], and top-1 agreement
    bool [N], of draft logits [N, Vd] against target probabilities [N, Vd].

    A draft sampled from q is accepted with probability 1 - TV(p, q), TV = 0.5 sum |p - q|: the total variation
    is the acceptance objective itself, where cross-entropy only bounds it.
    """
    log_q = torch.log_softmax(logits.float(), dim=-1)
    loss = -(target_probs * log_q).sum(-1)
    if tv_weight:
        tv = 0.5 * (target_probs - log_q.exp()).abs().sum(-1)
        loss = (1 - tv_weight) * loss + tv_weight * tv
    return loss, log_q.argmax(-1) == target_probs.argmax(-1)


@functools.cache
def compiled_loss_rows():
    """`loss_rows` compiled for the CPU, where eagerly each of its passes over the [N, Vd] rows (log-softmax, exp,
    |p - q|, their backwards, argmax) is one more trip through memory; compiled they fuse. Where torch.compile
    does not work (no C++ compiler), `loss_rows` itself, with a warning."""
    try:
        torch.compile(torch.neg)(torch.ones(2))
    except Exception as e:  # noqa: BLE001 - any compiler failure: the same loss, eagerly
        warnings.warn(
            f"torch.compile does not work here ({type(e).__name__}): the TTT loss runs uncompiled, slower", stacklevel=2
        )
        return loss_rows
    return torch.compile(loss_rows, dynamic=True)


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
    hidden, past = head.fc(aux_hidden), []
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
                head.norm(h), head.lm_head.weight, target_probs.reshape(b * t, -1), rows, tv_weight=tv_weight
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


def chain_rounds(correct, loss_mask):
    """The rounds of greedy chain drafting (K = correct.shape[1] drafts each) over the text, and where they reject.

    correct bool [B, K, T]: step i's draft at anchor t is the target's argmax there (False where it is
    not supervised); loss_mask bool [B, T]: the answers. Each answer starting at position P is one
    generation: the prefill emits x_P, then rounds run at anchors t = P-1, t + a + 1, ... while x_{t+2}
    is still an answer token, a round accepting a = its leading correct drafts (at most K) and emitting
    a + 1 tokens, as `inference.generate.Runtime.generate` does on this text.
    Returns ([(row, anchor, accepted)], rejected bool [B, K, T]: the draft each round got rejected at).
    """
    b, k, t = correct.shape
    leading = np.cumprod(correct.numpy(), axis=1).sum(axis=1)  # [B, T]: drafts a round at t accepts
    mask = loss_mask.bool().numpy()
    rejected = np.zeros((b, k, t), dtype=bool)
    rounds = []
    for row in range(b):
        starts = np.flatnonzero(mask[row, 1:] & ~mask[row, :-1]) + 1  # answers' first tokens
        for start in starts:
            anchor = start - 1
            while anchor + 2 < t and mask[row, anchor + 2]:
                a = int(leading[row, anchor])
                rounds.append((row, int(anchor), a))
                if a < k:
                    rejected[row, a, anchor] = True
                anchor += a + 1
    return rounds, torch.from_numpy(rejected)


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


def simulated_acceptance_length(accs) -> float:
    """Acceptance length of chain drafting predicted from per-step top-1 accuracies.

    TTT step k drafts after k earlier drafts were (as in training) all right, so acc_k estimates
    P(draft k accepted | drafts < k accepted) under greedy verification. The expected number of
    accepted drafts is then sum_k prod_{i<=k} acc_i, and every verification adds one token:
    AL = 1 + sum_k prod_{i<=k} acc_i  (1 <= AL <= K+1 for K = len(accs) drafts).
    It ignores the draft's own earlier mistakes feeding later steps, so it is an upper-ish guide
    to the runtime's measured AL, not a substitute for it.
    """
    al, run = 1.0, 1.0
    for a in accs:
        run *= float(a)
        al += run
    return al
