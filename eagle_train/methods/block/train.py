"""The block drafters' plug-ins for the shared trainer loop (`eagle_train.trainer.train`): the head builder,
the objective (blocks at random anchors, `eagle_train.methods.block.loss`) and the checks of their keys.

`method: dflash` trains a DFlash head (block_size - 1 drafts a forward); `method: dspark` the same head with the
options its row switches on (`head_options`): the anchor's slot drafts too (`sample_from_anchor`), the Markov bias
of rank `markov_rank` and the confidence head (loss weight `confidence_weight`).
"""

import torch

from eagle_train.architectures import text_config
from eagle_train.methods import row
from eagle_train.methods.block.head import BlockHead
from eagle_train.methods.block.loss import block_loss, default_gamma, sample_anchors
from eagle_train.train_config import BLOCK_LM_HEADS, BLOCK_MASKS, MARKOV_RANK
from eagle_train.training_parts import check_layers_and_mask, head_from_init, mask_token_for, noisy_features
from eagle_train.warm_start import warm_start_from_target


def head_options(cfg) -> dict:
    """The head options the method's row switches on (`Method.head_options`: DSpark's), the others off; the Markov
    rank is `markov_rank` (MARKOV_RANK when unset), and the confidence head reads the Markov bias."""
    on = row(cfg.method).head_options
    rank = (MARKOV_RANK if cfg.markov_rank is None else cfg.markov_rank) if "markov_rank" in on else 0
    return {"sample_from_anchor": "sample_from_anchor" in on, "markov_rank": rank, "confidence_head": rank > 0}


def build_block_head(cfg, target_model, vocab_map: dict | None) -> BlockHead:
    """A new DFlash or DSpark head for the target with the data's vocab map (the whole vocabulary with
    `block_lm_head: target`; mask token: `cfg.mask_token_id` or a spare special token the data never uses; with
    `warm_start`, its norm and lm_head are the target's), or the head of the same method and options at
    `init_from`."""
    if cfg.init_from:
        return head_from_init(
            cfg, target_model, block_size=cfg.block_size, block_mask=cfg.block_mask, block_lm_head=cfg.block_lm_head
        )
    mask_token_id = mask_token_for(cfg, vocab_map)
    head = BlockHead.from_target(
        target_model,
        method=cfg.method,
        mask_token_id=mask_token_id,
        block_size=cfg.block_size,
        num_hidden_layers=cfg.draft_num_layers,
        draft_vocab_size=len(vocab_map["d2t"]),
        aux_layer_ids=cfg.aux_layer_ids,
        target=cfg.target,
        causal=cfg.causal,
        block_mask=cfg.block_mask,
        block_lm_head=cfg.block_lm_head,
        **head_options(cfg),
    )
    head.set_vocab_map(vocab_map["d2t"], vocab_map["t2d"])
    if cfg.warm_start:
        warm_start_from_target(head, target_model)
    return head


def block_objective(cfg):
    """The trainer's objective for DFlash and DSpark, from the run's config: `num_anchors` blocks per sequence,
    drawn from the batch's generator, one forward and backward per micro-batch (training batches with
    `feature_noise`, as EAGLE-3's)."""
    options = {
        "gamma": cfg.block_gamma or default_gamma(cfg.block_size),
        "tv_weight": cfg.tv_weight,
        "confidence_weight": cfg.confidence_weight,
    }

    def objective(model, batch, backward):
        aux = batch["aux_hidden"]
        if cfg.feature_noise and torch.is_grad_enabled():
            aux = noisy_features(aux, cfg.feature_noise, batch["generator"])
        anchors, valid = sample_anchors(batch["loss_mask"], cfg.num_anchors, batch["generator"])
        loss, metrics = model(
            block_loss,
            aux,
            batch["input_ids"],
            batch["loss_mask"],
            batch["target_probs"],
            batch["in_draft"],
            anchors,
            valid,
            **options,
        )
        backward(loss)
        return metrics

    return objective


def validate_block(cfg, target_config) -> None:
    """The DFlash / DSpark keys of a TrainConfig, checked before any compute."""
    vocab = text_config(target_config).vocab_size
    if cfg.freeze_lm_head:
        raise ValueError(f"freeze_lm_head keeps EAGLE-3's warm-started lm_head: set it to false for {cfg.method}")
    if cfg.rejection_weight:
        raise ValueError(f"rejection_weight weighs EAGLE-3's chain walk (method eagle3): set it to 0 for {cfg.method}")
    if cfg.block_size < 2:
        raise ValueError(f"block_size (the anchor's slot plus the masks) must be >= 2, got {cfg.block_size}")
    if cfg.num_anchors < 1:
        raise ValueError(f"num_anchors (blocks per sequence) must be >= 1, got {cfg.num_anchors}")
    if cfg.block_gamma is not None and cfg.block_gamma <= 0:
        raise ValueError(f"block_gamma must be > 0 (or null for the block size's default), got {cfg.block_gamma}")
    if cfg.markov_rank and "markov_rank" not in row(cfg.method).head_options:
        raise ValueError(
            f"markov_rank is DSpark's Markov bias: use method dspark, or markov_rank null for {cfg.method}"
        )
    if cfg.markov_rank is not None and cfg.markov_rank < 0:
        raise ValueError(f"markov_rank must be >= 0 (0: no Markov bias; null: {MARKOV_RANK}), got {cfg.markov_rank}")
    check_layers_and_mask(cfg, vocab)
    if cfg.block_mask not in BLOCK_MASKS:
        raise ValueError(
            f"block_mask {cfg.block_mask!r} is not one of {BLOCK_MASKS} (learnt: a trained mask embedding; target: "
            "the target's row mask_token_id)"
        )
    if cfg.block_lm_head not in BLOCK_LM_HEADS:
        raise ValueError(
            f"block_lm_head {cfg.block_lm_head!r} is not one of {BLOCK_LM_HEADS} (draft: the head's own over the draft "
            "vocabulary; target: the target's, frozen)"
        )
    if cfg.block_lm_head == "target" and cfg.draft_vocab_size not in (None, vocab):
        raise ValueError(
            f"block_lm_head: target drafts over the target's whole vocabulary ({vocab}), draft_vocab_size is "
            f"{cfg.draft_vocab_size}: leave draft_vocab_size unset, or use block_lm_head: draft"
        )
    if cfg.aux_layer_ids is not None and min(cfg.aux_layer_ids) < 1:
        raise ValueError(
            f"aux_layer_ids {list(cfg.aux_layer_ids)}: a block head reads decoder layers' outputs, and layer index 0 "
            "is the embedding's: use ids >= 1 (capture a store with --aux-layers of ids >= 1)"
        )
