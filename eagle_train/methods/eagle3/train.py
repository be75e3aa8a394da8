"""EAGLE-3's two plug-ins for the shared trainer loop (`eagle_train.trainer.train`): the head
builder and the objective (one training-time-test unroll per micro-batch, `eagle_train.methods.eagle3.ttt`); its
keys and their checks are `config`'s."""

import torch

from eagle_train.methods.eagle3.head import Eagle3Head
from eagle_train.methods.eagle3.ttt import ttt_loss
from eagle_train.train_config import TrainConfig
from eagle_train.training_parts import head_from_init, noisy_features
from eagle_train.warm_start import warm_start_from_target


def build_eagle3_head(cfg: TrainConfig, target_model, vocab_map: dict | None) -> Eagle3Head:
    """A new EAGLE-3 head sized for the target with the data's vocab map (with `warm_start`, its norm
    and lm_head are the target's), or the head at `init_from` (an eagle-train head/checkpoint or an
    engine-layout EAGLE-3 dir), which keeps its own vocab map."""
    if cfg.init_from:
        return head_from_init(cfg, target_model)
    head = Eagle3Head.from_target(
        target_model, draft_vocab_size=len(vocab_map["d2t"]), aux_layer_ids=cfg.aux_layer_ids, target=cfg.target
    )
    head.set_vocab_map(vocab_map["d2t"], vocab_map["t2d"])
    if cfg.warm_start:
        warm_start_from_target(head, target_model)
    head.lm_head.weight.requires_grad_(not cfg.freeze_lm_head)
    return head


def eagle3_objective(cfg: TrainConfig):
    """The trainer's objective for EAGLE-3, from the run's config: one TTT unroll and one backward per micro-batch
    (training batches with `feature_noise`, see `training_parts.noisy_features`; evaluation, under no_grad, without)."""
    feature_noise = cfg.feature_noise
    loss_options = {
        "ttt_length": cfg.ttt_length,
        "decay": cfg.ttt_decay,
        "checkpoint_logits": cfg.gradient_checkpointing,
        "fused_loss": cfg.fused_loss,
        "tv_weight": cfg.tv_weight,
        "rejection_weight": cfg.rejection_weight,
    }

    def objective(model, batch, backward):
        aux = batch["aux_hidden"]
        if feature_noise and torch.is_grad_enabled():
            aux = noisy_features(aux, feature_noise, batch["generator"])
        loss, metrics = model(
            ttt_loss,
            aux,
            batch["input_ids"],
            batch["loss_mask"],
            batch["target_probs"],
            batch["in_draft"],
            **loss_options,
        )
        backward(loss)
        return metrics

    return objective
