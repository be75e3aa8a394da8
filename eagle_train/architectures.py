"""Which target architectures each stage takes, read from the target config alone (no weights).

Training takes any decoder-only causal LM that transformers builds with its decoder layers at
`model.model.layers` (the hidden states are those layers' inputs; the target distribution is the
model's own logits, `hidden_states.TargetLogits`, checked against a forward when the target loads).
The built-in runtime takes those whose layers all attend over a key/value cache (full or sliding
window): it verifies drafts through the model's own modules (`inference.hf_target`), and through its
own faster Llama forward (`inference.llama`) where that is exact. Data preparation writes data only
training reads, so each `eagle-prep` command that writes it checks "training" first: hours of capture
for a target training then refuses are hours lost.
"""

STAGES = {  # stage -> (what it is, the way out of a refusal)
    "training": ("training a draft head", "give a decoder-only causal LM (--target, or target: in the config)"),
    "runtime": (
        "the built-in speculative runtime",
        "evaluate this head in an engine that serves this target (eagle-eval --engine vllm)",
    ),
}
ATTENTION_LAYERS = {"full_attention", "sliding_attention"}  # the layer_types a KV cache and a mask serve


def text_config(config):
    """The language model's config inside a multimodal one (its `text_config`), else `config`."""
    return getattr(config, "text_config", None) or config


def config_from_dict(values: dict):
    """A transformers config from its `to_dict()` (a config.json's keys)."""
    from transformers import AutoConfig

    values = dict(values)
    return AutoConfig.for_model(values.pop("model_type"), **values)


def structure_problem(config) -> str | None:
    """Why transformers' model for `config` is not a decoder-only causal LM with its decoder layers at
    `model.model.layers`, from the model built on the meta device (no memory, no weights); None if it is."""
    import torch
    from transformers import AutoModelForCausalLM

    if getattr(config, "is_encoder_decoder", False):
        return "it is an encoder-decoder model"
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as err:  # whatever transformers raises, the answer is the same: it builds no model from this
        first = (str(err).splitlines() or [""])[0][:200]
        return f"transformers builds no causal LM from this config ({type(err).__name__}: {first})"
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or len(layers) != getattr(config, "num_hidden_layers", -1):
        return f"{type(model).__name__} keeps no decoder layers at model.model.layers, where capture reads them"
    return None


def layer_problem(config) -> str | None:
    """Why a KV cache and an attention mask cannot run every layer of `config` (None: they can). A layer with a
    state of its own (linear attention, convolution, SSM) cannot undo a rejected draft by overwriting a slot."""
    others = sorted(set(getattr(config, "layer_types", None) or ()) - ATTENTION_LAYERS)
    if others:
        return f"its {', '.join(others)} layers are not the full or sliding-window attention its cache and masks serve"
    return None


def refusal(target_config, stage: str) -> str | None:
    """Why `stage` does not take the target of `target_config` (None: it does)."""
    config = text_config(target_config)
    return structure_problem(config) or (layer_problem(config) if stage == "runtime" else None)


def check_supported(target_config, stage: str) -> None:
    """Refuse, in one line naming the reason and the way out, a target that `stage` does not take."""
    why = refusal(target_config, stage)
    if why is not None:
        what, way_out = STAGES[stage]
        raise ValueError(
            f"{what} does not take target model_type {text_config(target_config).model_type!r}: {why}; {way_out}"
        )
