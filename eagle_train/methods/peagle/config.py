"""P-EAGLE's own keys and their checks: the keys it adds to `TrainConfig` and to a head's `DraftConfig`, their
defaults and `validate_peagle`. It imports nothing heavy, so the shared configs compose its keys at import."""

from dataclasses import dataclass

from eagle_train.launch import launched_with

NUM_DEPTHS = 7  # K, drafts per forward, and the published P-EAGLE heads' K


@dataclass(kw_only=True)
class TrainKeys:
    num_depths: int = NUM_DEPTHS  # K: drafts per forward
    num_segments: int | None = None  # sequence partitioning; None -> methods.peagle.batch.default_num_segments


@dataclass(kw_only=True)
class HeadKeys:
    num_depths: int | None = None  # drafts per forward (K)


def segments_for(cfg) -> int:
    """The configured segment count, or the default for max_length and K."""
    from eagle_train.methods.peagle.batch import default_num_segments

    return cfg.num_segments or default_num_segments(cfg.max_length, cfg.num_depths)


def validate_peagle(cfg, target_config) -> None:
    """The P-EAGLE keys of a TrainConfig, checked before any compute (the shared draft_num_layers and mask_token_id
    by `train_config.validate`)."""
    if cfg.rejection_weight:
        raise ValueError("rejection_weight weighs EAGLE-3's chain walk (method eagle3): set it to 0 for P-EAGLE")
    if cfg.feature_noise:
        raise ValueError("feature_noise augments EAGLE-3's training (method eagle3): set it to 0 for P-EAGLE")
    if cfg.warm_start:
        raise ValueError(
            "warm_start starts a new head from the target's norm and lm_head: not for P-EAGLE, whose head trains "
            "its own embedding; set warm_start=false"
        )
    if cfg.freeze_lm_head:
        raise ValueError("freeze_lm_head keeps EAGLE-3's warm-started lm_head: set it to false for P-EAGLE")
    if cfg.num_depths < 2:
        raise ValueError(f"num_depths (K, drafts per forward) must be >= 2, got {cfg.num_depths}")
    if cfg.num_segments is not None and cfg.num_segments < 1:
        raise ValueError(f"num_segments must be >= 1 (or null for the default), got {cfg.num_segments}")
    if launched_with("DEEPSPEED") and segments_for(cfg) > 1:
        raise ValueError(
            f"P-EAGLE runs one backward per sequence segment ({segments_for(cfg)} here) and DeepSpeed steps its "
            "optimizer inside every backward: set num_segments=1, or train with DDP or FSDP"
        )
