"""P-EAGLE's two plug-ins for the shared trainer loop (`eagle_train.trainer.train`): the head
builder and the objective (its keys and their checks are `config`'s).

`objective(model, batch, backward) -> metrics`, with the trainer's batch (`input_ids`, `loss_mask`,
`aux_hidden`, and the target distribution `target_probs` [B, T, Vd] / `in_draft` [B, T] from
`training_parts.target_distribution`, the very tensors EAGLE-3 trains on). Per batch: sample the (anchor,
depth) elements, split them into `num_segments` sequence segments, and run one forward+backward
per segment through `model(fn, ...)` (so DDP/FSDP see every pass). Each segment's loss is its
owned supervised loss (soft cross-entropy, or its mix with total variation) divided by the
batch's TOTAL supervised count, so the summed gradient is that of the whole batch's mean
whatever the segment count. Under DDP every segment but the last runs inside `no_sync`, so
gradients are all-reduced once per micro-batch.

The loss goes through `fused_ce.soft_cross_entropy`: the [E, Vd] draft logits never exist in
full, which at 2048 tokens x K=7 (~6k elements x 32k vocab) would dominate memory.
"""

import contextlib

import torch

from eagle_train.fused_ce import soft_cross_entropy
from eagle_train.methods.peagle import batch as pb
from eagle_train.methods.peagle.config import segments_for
from eagle_train.methods.peagle.head import PEagleHead
from eagle_train.train_config import TV_WEIGHT
from eagle_train.training_parts import head_from_init, mask_token_for


def build_peagle_head(cfg, target_model, vocab_map: dict | None) -> PEagleHead:
    """A new P-EAGLE head for the target with the data's vocab map (mask token: `cfg.mask_token_id`
    or a spare special token the data never uses), or the P-EAGLE head at `init_from`."""
    if cfg.init_from:
        return head_from_init(cfg, target_model, num_depths=cfg.num_depths)
    mask_token_id = mask_token_for(cfg, vocab_map)
    head = PEagleHead.from_target(
        target_model,
        mask_token_id=mask_token_id,
        num_depths=cfg.num_depths,
        num_hidden_layers=cfg.draft_num_layers,
        draft_vocab_size=len(vocab_map["d2t"]),
        aux_layer_ids=cfg.aux_layer_ids,
        target=cfg.target,
    )
    head.set_vocab_map(vocab_map["d2t"], vocab_map["t2d"])
    return head


def peagle_objective(cfg) -> "PEagleObjective":
    """The trainer's objective for P-EAGLE, from the run's config."""
    return PEagleObjective(cfg.num_depths, segments_for(cfg), cfg.tv_weight)


def batch_lengths(batch) -> torch.Tensor:
    """Per row, the tokens that matter: `lengths` or the attention mask when the batch has them,
    else up to the last loss-masked token (later tokens are neither predicted nor read by a
    supervised element, and right padding is never loss-masked)."""
    if "lengths" in batch:
        return batch["lengths"]
    if "attention_mask" in batch:
        return batch["attention_mask"].sum(1)
    mask = batch["loss_mask"].bool()
    t = mask.shape[1]
    last = torch.where(mask, torch.arange(t, device=mask.device), -1).amax(1)
    return last + 1


def segment_loss(head, seg: pb.Elements, batch, total, tv_weight: float = TV_WEIGHT):
    """(loss to backpropagate, per-element loss [N] (soft CE mixed with total variation by `tv_weight`, as in
    `ttt.step_loss`) and top-1 agreement [N] of the owned supervised elements) of one segment."""
    aux, is_mask, ids, pos = pb.gather_inputs(seg, batch["input_ids"], batch["aux_hidden"], head.config.mask_token_id)
    h = head.hidden_states(aux, is_mask, ids, pos, pb.attention_mask(seg, head.config.sliding_window))
    sup = seg.supervised
    if not sup.any():  # nothing to learn here; a zero loss still touches every parameter (DDP's reducer)
        zero = sum(p.sum() for p in (h, head.norm.weight, head.lm_head.weight)) * 0
        return zero, h.new_zeros(0), torch.zeros(0, dtype=torch.bool, device=h.device)
    probs = batch["target_probs"]
    b, t, vd = probs.shape
    rows = (torch.arange(b, device=h.device)[:, None] * t + seg.anchor + seg.depth + 1)[sup]
    ce, agree = soft_cross_entropy(
        head.normed(h[sup]), head.lm_head.weight, probs.reshape(b * t, vd), rows, tv_weight=tv_weight
    )
    return ce.sum() / total, ce.detach(), agree


class PEagleObjective:
    """`num_segments`: sequence partition count (1 = no partitioning; see
    `batch.default_num_segments`). Depth sampling draws from the batch's `generator` (the
    trainer seeds one per micro-batch: `trainer.draw_seed`), else from torch's global RNG."""

    def __init__(self, num_depths: int, num_segments: int = 1, tv_weight: float = TV_WEIGHT):
        if num_segments < 1:
            raise ValueError(f"num_segments must be >= 1, got {num_segments}")
        if num_depths < 1:
            raise ValueError(f"num_depths must be >= 1, got {num_depths}")
        self.num_depths = num_depths
        self.num_segments = num_segments
        self.tv_weight = tv_weight

    def __call__(self, model, batch, backward):
        loss_mask = batch["loss_mask"].bool()
        elements = pb.build_elements(
            loss_mask, batch["in_draft"], batch_lengths(batch), self.num_depths, batch.get("generator")
        )
        total = elements.supervised.sum().clamp(min=1)
        segments = pb.partition(elements, self.num_segments, loss_mask.shape[1])
        device = loss_mask.device
        loss_sum, correct, count = (torch.zeros(self.num_depths, dtype=torch.float64, device=device) for _ in range(3))
        for s, seg in enumerate(segments):
            last = s == len(segments) - 1
            sync = contextlib.nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync()
            with sync:
                loss, ce, agree = model(segment_loss, seg, batch, total, self.tv_weight)
                if loss.requires_grad:
                    backward(loss)
            depth = seg.depth[seg.supervised]
            loss_sum.index_add_(0, depth, ce.double())
            correct.index_add_(0, depth, agree.double())
            count.index_add_(0, depth, torch.ones_like(depth, dtype=torch.float64))
        metrics = {"loss": loss_sum.sum() / total}
        for d in range(self.num_depths):
            n = count[d].clamp(min=1)
            metrics[f"loss_{d}"], metrics[f"acc_{d}"], metrics[f"count_{d}"] = loss_sum[d] / n, correct[d] / n, count[d]
        return metrics
