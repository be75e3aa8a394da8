"""EAGLE-3's two plug-ins for the shared trainer loop (`eagle_train.trainer.train`): the head
builder and the objective (one training-time-test unroll per micro-batch, `eagle_train.ttt`)."""

import torch

from eagle_train.checkpoint import load_draft_head
from eagle_train.eagle3 import Eagle3Head
from eagle_train.train_config import TrainConfig
from eagle_train.ttt import ttt_loss
from eagle_train.warm_start import warm_start_from_target


def build_eagle3_head(cfg: TrainConfig, target_model, vocab_map: dict | None) -> Eagle3Head:
    """A new EAGLE-3 head sized for the target with the data's vocab map (with `warm_start`, its norm
    and lm_head are the target's), or the head at `init_from` (an eagle-train head/checkpoint or an
    engine-layout EAGLE-3 dir), which keeps its own vocab map."""
    if cfg.init_from:
        head = load_draft_head(cfg.init_from, target_model)
        if head.config.method != "eagle3":
            raise ValueError(f"init_from {cfg.init_from} holds a {head.config.method} head, not an EAGLE-3 head")
        head.config.check_fits(target_model.config)
        return head
    head = Eagle3Head.from_target(
        target_model, draft_vocab_size=len(vocab_map["d2t"]), aux_layer_ids=cfg.aux_layer_ids, target=cfg.target
    )
    head.set_vocab_map(vocab_map["d2t"], vocab_map["t2d"])
    if cfg.warm_start:
        warm_start_from_target(head, target_model)
    return head


def eagle3_objective(cfg: TrainConfig):
    """The trainer's objective for EAGLE-3, from the run's config: one TTT unroll and one backward per micro-batch
    (training batches with `feature_noise`, see `noisy_features`; evaluation, under no_grad, without)."""
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


def noisy_features(aux_hidden, scale: float, generator):
    """The target's fused hidden states [B, T, 3H] plus Gaussian noise, for each of the three layers of each
    token `scale` times that layer's RMS there: an augmentation against a head that memorises a small store
    (the layers' scales differ about tenfold, so one absolute level would drown the low layer)."""
    layers = aux_hidden.unflatten(-1, (3, -1))
    rms = layers.pow(2).mean(-1, keepdim=True).sqrt()
    noise = torch.randn(layers.shape, generator=generator).to(layers.device, layers.dtype)
    return (layers + scale * rms * noise).flatten(-2)
