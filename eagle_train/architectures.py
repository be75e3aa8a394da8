"""Which target architectures each stage takes, keyed by the target config's `model_type`.

One table, so that a head is never trained for a target a later stage refuses without saying why:
a stage that takes fewer types than training holds the reason beside the type. Data preparation
writes data only training reads, so each `eagle-prep` command that writes it checks "training"
first: hours of capture for a target training then refuses are hours lost.
"""

from dataclasses import dataclass

STAGES = {  # stage -> (what it is, the way out of a refusal)
    "training": ("training a draft head", "give a target of one of those types (--target, or target: in the config)"),
    "runtime": (
        "the built-in speculative runtime",
        "evaluate this head in an engine that serves this target (eagle-eval --engine vllm)",
    ),
}


@dataclass(frozen=True)
class Architecture:
    """One target model_type: per stage, None where the stage takes it, else why it does not."""

    training: str | None = None
    runtime: str | None = None


MOE = "its mixture-of-experts layers have no single dense MLP, the only one the runtime builds"
NOPE = "it skips RoPE in some layers (no_rope_layers), and the runtime rotates every layer"

ARCHITECTURES = {
    "llama": Architecture(),
    "mistral": Architecture(),
    "qwen2": Architecture(),
    "qwen3": Architecture(),
    "qwen2_moe": Architecture(runtime=MOE),
    "qwen3_moe": Architecture(runtime=MOE),
    "mixtral": Architecture(runtime=MOE),
    "smollm3": Architecture(runtime=NOPE),
}


def supported(stage: str) -> list[str]:
    """The model_types `stage` takes, sorted."""
    return sorted(name for name, arch in ARCHITECTURES.items() if getattr(arch, stage) is None)


def check_supported(target_config, stage: str) -> None:
    """Refuse, in one line naming the reason and the way out, a target that `stage` does not take."""
    model_type = (getattr(target_config, "text_config", None) or target_config).model_type
    what, way_out = STAGES[stage]
    if model_type not in ARCHITECTURES:
        why = "eagle_train.architectures does not list it"
    else:
        why = getattr(ARCHITECTURES[model_type], stage)
    if why is not None:
        raise ValueError(
            f"{what} does not take target model_type {model_type!r}: {why}. "
            f"It supports {', '.join(supported(stage))}; {way_out}"
        )
