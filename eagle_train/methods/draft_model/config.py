"""The draft model's own keys and their checks: the keys it adds to `TrainConfig` and to a head's `DraftConfig`, the
layers a new draft starts from, and `validate_draft_model`. It imports nothing heavy, so the shared configs compose
its keys at import."""

from dataclasses import dataclass

DRAFT_INITS = ("target", "random")


@dataclass(kw_only=True)
class TrainKeys:
    # the target layers the draft starts from (None: the first draft_num_layers, by default a tenth of the target's),
    # or draft_init=random
    draft_layers: list[int] | None = None
    draft_init: str = "target"  # target: the target's embedding, layers, final norm and lm_head; random: none of them


@dataclass(kw_only=True)
class HeadKeys:
    model_config: dict | None = None  # the draft's own transformers config (the target's architecture, fewer layers)


def default_layers(num_target_layers: int) -> int:
    """A tenth of the target's layers, at least one: a draft step costs its layers and its lm_head."""
    return max(1, round(num_target_layers / 10))


def draft_layers(cfg, num_target_layers: int) -> list[int]:
    """The target layers a new draft starts from: `draft_layers`, else the first `draft_num_layers` (or the default)."""
    if cfg.draft_layers is not None:
        return list(cfg.draft_layers)
    return list(range(cfg.draft_num_layers or default_layers(num_target_layers)))


def validate_draft_model(cfg, target_config) -> None:
    """The draft model's keys of a TrainConfig, checked before any compute."""
    n = target_config.num_hidden_layers
    if cfg.draft_init not in DRAFT_INITS:
        raise ValueError(f"draft_init must be one of {', '.join(DRAFT_INITS)}, got {cfg.draft_init!r}")
    layers = draft_layers(cfg, n)
    if not layers or any(not 0 <= i < n for i in layers):
        raise ValueError(f"draft_layers must name layers of the {n}-layer target (0 to {n - 1}), got {layers}")
    if cfg.draft_layers is not None and cfg.draft_num_layers not in (None, len(cfg.draft_layers)):
        raise ValueError(
            f"draft_layers names {len(cfg.draft_layers)} layers and draft_num_layers says {cfg.draft_num_layers}: "
            "set one of them"
        )
