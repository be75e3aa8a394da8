"""The block drafters' plug-ins for the shared trainer loop (`eagle_train.trainer.train`): the head builder and
the objective (blocks at random anchors, `eagle_train.methods.block.loss`); their keys and checks are `config`'s.

`method: dflash` trains a DFlash head (block_size - 1 drafts a forward); `method: dspark` the same head with the
options its row switches on (`head_options`): the anchor's slot drafts too (`sample_from_anchor`), the Markov bias
of rank `markov_rank` and the confidence head (loss weight `confidence_weight`).
"""

import torch

from eagle_train.methods import row
from eagle_train.methods.block.config import MARKOV_RANK
from eagle_train.methods.block.head import BlockHead
from eagle_train.methods.block.loss import block_loss, default_gamma, sample_anchors
from eagle_train.training_parts import head_from_init, mask_token_for, noisy_features
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
