"""P-EAGLE training layout: (anchor, depth) elements, their attention rule, and sequence partitioning.

An element (a, d) is draft slot d+1 of a chain anchored at position a (docs/design.md section 5, in
the section-3 alignment): depth 0 reads g_a and x_{a+1}, depth d >= 1 reads mask_hidden and the
mask token; its RoPE position is a+d; it is trained toward the target distribution at a+d+1
(which predicts x_{a+d+2}) and is supervised iff x_{a+d+2} exists, is an assistant token
(loss_mask[a+d+2]) and the target's argmax at a+d+1 is in the draft vocabulary.

Depth 0 keeps every anchor 0..L-2 (the keys every chain reads); depth d keeps about
n * max(0.7**d, 0.2) chains of depth d-1 (n = supervised depth-0 elements), extended one slot
further, so the chains are nested and (a, d) always finds (a, 0..d-1).

Attention between elements: same document and either (key depth 0 and key anchor <= query
anchor) or (same anchor and key depth <= query depth): exactly what the runtime's cache holds
when it drafts from anchor a. A head with a sliding window W (speculators trains its P-EAGLE heads
so) sees the depth-0 keys of the last W positions before the query's own, a+d, only
(speculators' peagle/attention.py), and its own chain whatever W.

Sequence partitioning: element (a, d) falls in the segment of its bucket key (a for depth 0,
a+1 for depth >= 1); a segment also carries, as keys/values only, every depth-0 element left of
its range. Every key a query may see is then in its segment, and depth-0 elements see only
depth-0 elements, so each element's output (and gradient) is the same in every segment that
computes it; only the segment that owns it puts it in the loss. The segments' summed gradients
therefore equal the unpartitioned ones, while memory is bounded by the largest segment.
"""

import math
from dataclasses import dataclass, fields

import torch

KEEP_RATIO, MIN_KEEP_RATIO = 0.7, 0.2
PADDING_DOCUMENT = -1


def keep_ratio(depth: int) -> float:
    return max(KEEP_RATIO**depth, MIN_KEEP_RATIO)


def is_supervised(anchor, depth, loss_mask, in_draft, length: int):
    """Element (a, d) predicts x_{a+d+2}: it exists, is an assistant token, and the target's
    argmax at a+d+1 is a draft token. loss_mask/in_draft [T] (T >= length) bool."""
    predicted = anchor + depth + 2
    ok = predicted < length
    predicted = predicted.clamp(max=length - 1)
    return ok & loss_mask[predicted] & in_draft[predicted - 1]


def sample_chains(loss_mask, in_draft, length: int, num_depths: int, generator=None):
    """(anchor, depth) long [E] for one sequence of `length` tokens, depth-major, anchors sorted."""
    if length < 2:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    loss_mask, in_draft = loss_mask.cpu(), in_draft.cpu()
    anchors = [torch.arange(length - 1)]
    n = int(is_supervised(anchors[0], 0, loss_mask, in_draft, length).sum())
    for d in range(1, num_depths):
        prev = anchors[-1]
        candidates = prev[is_supervised(prev, d, loss_mask, in_draft, length)]
        keep = min(round(n * keep_ratio(d)), len(candidates))
        if keep == 0:
            break
        pick = torch.randperm(len(candidates), generator=generator)[:keep]
        anchors.append(candidates[pick].sort().values)
    depth = torch.cat([torch.full_like(a, d) for d, a in enumerate(anchors)])
    return torch.cat(anchors), depth


@dataclass
class Elements:
    """Flattened elements of a batch, right-padded per row: all [B, E]. Padding elements have
    document -1 (they see only each other, never a real element) and are never supervised.
    `owned` marks the elements whose loss this forward counts (False for a segment's context)."""

    anchor: torch.Tensor
    depth: torch.Tensor
    document: torch.Tensor
    supervised: torch.Tensor
    owned: torch.Tensor

    @property
    def position(self):
        return self.anchor + self.depth

    def to(self, device):
        return Elements(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})

    @classmethod
    def stack(cls, rows: list[dict]) -> "Elements":
        """Right-pad per-row dicts of 1-D tensors (same keys as the fields, document omitted)."""
        width = max([len(r["anchor"]) for r in rows] + [1])
        out = {f.name: [] for f in fields(cls)}
        for r in rows:
            pad = width - len(r["anchor"])
            out["anchor"].append(torch.cat([r["anchor"], r["anchor"].new_zeros(pad)]))
            out["depth"].append(torch.cat([r["depth"], r["depth"].new_zeros(pad)]))
            out["document"].append(
                torch.cat([r["anchor"].new_zeros(len(r["anchor"])), r["anchor"].new_full((pad,), PADDING_DOCUMENT)])
            )
            for name in ("supervised", "owned"):
                out[name].append(torch.cat([r[name], r[name].new_zeros(pad)]))
        return cls(**{k: torch.stack(v) for k, v in out.items()})

    def row(self, b: int) -> dict:
        keep = self.document[b] != PADDING_DOCUMENT
        return {f.name: getattr(self, f.name)[b][keep] for f in fields(self) if f.name != "document"}


def build_elements(loss_mask, in_draft, lengths, num_depths: int, generator=None) -> Elements:
    """Sample the elements of a right-padded batch: loss_mask/in_draft [B, T] bool, lengths [B]."""
    rows = []
    for b, length in enumerate(lengths.tolist()):
        anchor, depth = sample_chains(loss_mask[b], in_draft[b], length, num_depths, generator)
        supervised = (
            is_supervised(anchor, depth, loss_mask[b].cpu(), in_draft[b].cpu(), length)
            if len(anchor)
            else torch.zeros(0, dtype=torch.bool)
        )
        rows.append(dict(anchor=anchor, depth=depth, supervised=supervised, owned=torch.ones_like(supervised)))
    return Elements.stack(rows).to(loss_mask.device)


def visible(q_anchor, q_depth, q_doc, k_anchor, k_depth, k_doc, window: int | None = None):
    """The attention rule of docs/design.md section 5 (True = the query sees the key), within the head's sliding
    `window` when it has one. Works on broadcast tensors (dense masks) and on FlexAttention's index scalars alike."""
    chain_context = (k_depth == 0) & (k_anchor <= q_anchor)
    if window:
        chain_context = chain_context & (k_anchor > q_anchor + q_depth - window)
    own_chain = (k_anchor == q_anchor) & (k_depth <= q_depth)
    return (q_doc == k_doc) & (chain_context | own_chain)


def dense_mask(el: Elements, window: int | None = None) -> torch.Tensor:
    """[B, 1, E, E] bool for SDPA."""
    q = (el.anchor[:, :, None], el.depth[:, :, None], el.document[:, :, None])
    k = (el.anchor[:, None, :], el.depth[:, None, :], el.document[:, None, :])
    return visible(*q, *k, window)[:, None]


def block_mask(el: Elements, window: int | None = None):
    """The same rule as a FlexAttention BlockMask (CUDA): only blocks with a visible pair are computed."""
    from torch.nn.attention.flex_attention import create_block_mask

    anchor, depth, doc = el.anchor, el.depth, el.document

    def mask_mod(b, h, q, k):
        return visible(anchor[b, q], depth[b, q], doc[b, q], anchor[b, k], depth[b, k], doc[b, k], window)

    e = anchor.shape[1]
    return create_block_mask(mask_mod, anchor.shape[0], None, e, e, device=anchor.device)


def attention_mask(el: Elements, window: int | None = None):
    """A BlockMask on CUDA, the equivalent dense boolean mask elsewhere."""
    return block_mask(el, window) if el.anchor.is_cuda else dense_mask(el, window)


def default_num_segments(max_length: int, num_depths: int, segment_elements: int = 4096) -> int:
    """Enough segments that each owns about `segment_elements` elements at `max_length`
    (estimated with every position supervised: L * sum_d keep_ratio(d)). 2048 tokens at K=7
    -> 6.2k elements -> 2 segments; 8192 at K=8 -> 7 segments."""
    elements = max_length * sum(keep_ratio(d) for d in range(num_depths))
    return max(1, math.ceil(elements / segment_elements))


def partition(el: Elements, num_segments: int, length: int) -> list[Elements]:
    """Split the elements into segments by bucket key (anchor for depth 0, anchor+1 beyond) over
    equal ranges of [0, length); each segment adds, unowned, the depth-0 elements left of it."""
    if num_segments < 1:
        raise ValueError(f"num_segments must be >= 1, got {num_segments}")
    bounds = [round(i * length / num_segments) for i in range(num_segments + 1)]
    key = el.anchor + (el.depth > 0).long()
    segments = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        own = (key >= lo) & (key < hi) if hi < length else key >= lo
        context = (el.depth == 0) & (el.anchor < lo) & (el.document != PADDING_DOCUMENT)
        rows = []
        for b in range(el.anchor.shape[0]):
            real = el.document[b] != PADDING_DOCUMENT
            pick = (own[b] | context[b]) & real
            rows.append(
                dict(
                    anchor=el.anchor[b][pick],
                    depth=el.depth[b][pick],
                    supervised=el.supervised[b][pick] & own[b][pick],
                    owned=own[b][pick],
                )
            )
        segments.append(Elements.stack(rows).to(el.anchor.device))
    return segments


def gather_inputs(el: Elements, input_ids, aux_hidden, mask_token_id: int):
    """Per-element model inputs: (aux [B, E, 3H], is_mask [B, E], input_ids [B, E], position_ids [B, E])."""
    t = input_ids.shape[1]
    is_mask = el.depth > 0
    token = input_ids.gather(1, (el.anchor + 1).clamp(max=t - 1))
    ids = torch.where(is_mask, torch.full_like(token, mask_token_id), token)
    aux = aux_hidden.gather(1, el.anchor[..., None].expand(-1, -1, aux_hidden.shape[-1]))
    return aux, is_mask, ids, el.position


def gather_targets(el: Elements, target_probs):
    """The target distribution at a+d+1 per element: [B, E, Vd]."""
    index = (el.anchor + el.depth + 1).clamp(max=target_probs.shape[1] - 1)
    return target_probs.gather(1, index[..., None].expand(-1, -1, target_probs.shape[-1]))
