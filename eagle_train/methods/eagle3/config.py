"""EAGLE-3's own keys and their checks: the `TrainConfig` keys only its training reads, their defaults and
`validate_eagle3`. It imports nothing heavy, so `eagle_train.train_config` composes its keys at import."""

from dataclasses import dataclass

TTT_DECAY = 0.8  # step i's loss weighs decay**i
REJECTION_WEIGHT = 0.0  # the extra weight of a draft a chain walk rejects (every draft weighs 1)


@dataclass(kw_only=True)
class TrainKeys:
    ttt_decay: float = TTT_DECAY
    # a draft the current head's chain walk gets rejected at weighs 1 + w (training_parts.chain_rounds)
    rejection_weight: float = REJECTION_WEIGHT
    freeze_lm_head: bool = False  # with warm_start: the lm_head stays the target's rows (speculators' recipe)
    # Not activation checkpointing: only each TTT step's [N, Vd] draft logits are dropped after the
    # forward and recomputed in backward (the head's layers keep theirs). Without fused_loss only;
    # fused_loss never makes those logits.
    gradient_checkpointing: bool = False
    fused_loss: bool = False  # the TTT loss through eagle_train.fused_ce (no [N, Vd] logits; Triton on CUDA)


def validate_eagle3(cfg, target_config) -> None:
    """The EAGLE-3 keys of a TrainConfig, checked before any compute."""
    if not 0 < cfg.ttt_decay <= 1:
        raise ValueError(f"ttt_decay must be in (0, 1], got {cfg.ttt_decay}")
    if cfg.rejection_weight < 0:
        raise ValueError(f"rejection_weight must be >= 0 (0: every draft weighs 1), got {cfg.rejection_weight}")
    if cfg.freeze_lm_head and not cfg.warm_start:
        raise ValueError(
            "freeze_lm_head keeps the lm_head warm_start gives the head (the target's rows of the draft vocabulary): "
            "set warm_start=true too"
        )
