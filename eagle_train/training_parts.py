"""What every method's training shares, imported by each method's folder (`eagle_train.methods`): the target
distribution a head distils and the per-row loss toward it, the greedy chain walk over the answers and the AL it
implies, the feature noise, the mask token, and the head `init_from` names.

For tokens x_0..x_{T-1}, the draft trained at position t toward the target distribution at t predicts x_{t+1}: it
is supervised iff that token is an assistant token and the target's own argmax there lies in the draft vocabulary
(otherwise no draft can match it). The distribution is computed once per batch (`target_distribution`) and read,
shifted, by every method's loss.
"""

import functools
import warnings

import numpy as np
import torch

from eagle_train import methods
from eagle_train.checkpoint import load_draft_head
from eagle_train.target import load_tokenizer
from eagle_train.train_config import TV_WEIGHT


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


def noisy_features(aux_hidden, scale: float, generator):
    """The target's fused hidden states [B, T, 3H] plus Gaussian noise, for each of the three layers of each
    token `scale` times that layer's RMS there: an augmentation against a head that memorises a small store
    (the layers' scales differ about tenfold, so one absolute level would drown the low layer)."""
    layers = aux_hidden.unflatten(-1, (3, -1))
    rms = layers.pow(2).mean(-1, keepdim=True).sqrt()
    noise = torch.randn(layers.shape, generator=generator).to(layers.device, layers.dtype)
    return (layers + scale * rms * noise).flatten(-2)


def mask_token_for(cfg, vocab_map: dict) -> int:
    """`cfg.mask_token_id`, or a spare special token the data (its vocab map's counts) never uses."""
    if cfg.mask_token_id is not None:
        return cfg.mask_token_id
    return choose_mask_token_id(load_tokenizer(cfg.target), vocab_map.get("counts"))


def choose_mask_token_id(tokenizer, token_counts: torch.Tensor | None = None) -> int:
    """A reserved token the training data never uses: the highest added/special token id that
    is not bos/eos/pad/unk, does not occur in the chat template and (given the data's token
    counts) never occurs in the data. SmolLM2 -> 16 (`<empty_output>`)."""
    used = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    candidates = []
    for token_id, token in tokenizer.added_tokens_decoder.items():
        if token_id in used or token.content in template:
            continue
        if token_counts is not None and token_id < len(token_counts) and token_counts[token_id] > 0:
            continue
        candidates.append(token_id)
    if not candidates:
        raise ValueError(
            "the tokenizer has no spare special token to use as the P-EAGLE mask token; "
            "set `mask_token_id` in the run config to an id the training data never contains"
        )
    return max(candidates)


def head_from_init(cfg, target_model, **must_match):
    """The head at `cfg.init_from` (an eagle-train head or checkpoint, or an engine layout) to go on training in
    `cfg`'s run: of `cfg.method`, fitting the target, and with each setting in `must_match` (its DraftConfig key ->
    the run's value) the run's; ValueError naming the fix otherwise."""
    head = load_draft_head(cfg.init_from, target_model)
    if head.config.method != cfg.method:
        raise ValueError(
            f"init_from {cfg.init_from} holds a {head.config.method} head, not a {methods.row(cfg.method).title} head"
        )
    head.config.check_fits(target_model.config)
    differ = {key: getattr(head.config, key) for key in must_match if getattr(head.config, key) != must_match[key]}
    if differ:  # every one named at once: a head from elsewhere often differs in several
        held = " ".join(f"{key}={value}" for key, value in differ.items())
        asked = " ".join(f"{key}={must_match[key]}" for key in differ)
        raise ValueError(f"init_from {cfg.init_from} is a head of {held}, the run asks for {asked}: set {held}")
    return head
