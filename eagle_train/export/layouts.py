"""The external checkpoint layouts: the one place that knows their config keys and tensor names.

A layout is a row of `LAYOUTS`: how to write config.json for a head, how head tensor names map to
file names, how to read a config.json of that layout back into a DraftConfig, and how to recognise
one. Adding a format is one more row built from the helpers below.

- `eagle3`: the EAGLE reference layout (SGLang, TensorRT-LLM, vLLM, SafeAILab EAGLE): a Llama
  config with `architectures: ["LlamaForCausalLMEagle3"]`, tensors `fc`, `midlayer.*`, `norm`,
  `lm_head`, `d2t`, `t2d` (docs/design.md sections 4 and 6).
- `speculators`: vLLM's own format (vllm-project/speculators): the Llama keys live under
  `transformer_layer_config`, the layer is `layers.0.*`, `embed_tokens.weight` is the target's (speculators'
  loader never fills it: `speculators_ships_embedding`), and `speculators_config` tells `vllm serve DIR` everything
  else.
- `peagle`: P-EAGLE for vLLM's parallel drafting: the eagle3 layout with N layers (`layers.1..N-1.*`),
  the trained `embed_tokens`, `mask_hidden`, the mask token id under all three names vLLM versions
  read, `parallel_drafting` true.
- `dflash`: z-lab's DFlash layout (vLLM's `DFlashDraftModel`, llama.cpp's converter, z-lab's library): Qwen3
  keys, `block_size`, top-level `is_causal` (z-lab's), `dflash_config` {mask_token_id, target_layer_ids = our aux
  ids - 1, causal} (vLLM's); tensors `fc`, `hidden_norm`, `layers.{i}.*`, `norm`, `lm_head`, `d2t` (no
  `embed_tokens`: the target's). z-lab's library reads no mask embedding, lm_head or d2t (`zlab_notice`).
- `dspark`: DeepSpec's native DSpark layout (vLLM's `Qwen3DSparkModel`): Qwen3 keys with top-level
  `target_layer_ids` (aux - 1), `mask_token_id`, `markov_rank`, `sample_from_anchor`, the confidence
  head's keys; the Markov head as `markov_head.markov_w1.weight` / `markov_w2.weight`; and `embed_tokens.weight`,
  the target's token embedding with row `mask_token_id` the head's mask embedding (vLLM's DSpark embeds the
  mask slots by that row and never reads mask_embedding.pt; DeepSpec's checkpoints ship embed_tokens too).
- `speculators` also writes block heads (speculators_model_type dflash / dspark, the Qwen3 keys under
  `transformer_layer_config`, `aux_hidden_state_layer_ids` = our aux ids, `t2d` beside `d2t` for a reduced
  vocabulary), of a head speculators reads as trained only (`speculators_refusal`).

A block head's learnt mask embedding ships beside the weights as `mask_embedding.pt`, the dict
{"mask_token_id", "embedding"} vLLM's DFlash loader and llama.cpp's converter read (`MASK_EMBEDDING_FILE`).

Aux-layer ids are written in each engine's own convention. vLLM reads the top-level
`eagle_aux_hidden_state_layer_ids` as Hugging Face `output_hidden_states` indices (ours); SGLang
reads only `eagle_config.eagle_aux_hidden_state_layer_ids` and captures id + 1, so the nested copy
holds ours minus one. Both are written only when the ids are not the target's defaults.
"""

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from eagle_train.architectures import config_from_dict, text_config
from eagle_train.draft_config import DraftConfig, target_rope
from eagle_train.hidden_states import engine_aux_layer_ids
from eagle_train.methods import METHODS, family_of, method_with, row
from eagle_train.target import HUB_IDS, resolve_target

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
PROVENANCE_KEY = "eagle_train"  # our own block in config.json; every engine ignores unknown keys
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
INTEGER_TENSORS = ("d2t", "t2d")  # vocab maps keep their dtype whatever the export dtype
MASK_EMBEDDING_FILE = "mask_embedding.pt"  # a block head's learnt mask embedding, beside the weights
EMBEDDING_TENSOR = "embed_tokens.weight"  # the target's token embedding some exports ship (Layout.ships_embedding)
DFLASH_ARCHITECTURE = "DFlashDraftModel"
DSPARK_ARCHITECTURE = "Qwen3DSparkModel"
SPECULATOR_ARCHITECTURES = {"dflash": "DFlashSpeculator", "dspark": "DSparkSpeculator"}  # by speculators' model type
# DSpark's Markov head: raw Parameters in our head, an Embedding's and a Linear's weight in the engines
MARKOV_TENSORS = ("markov_head.markov_w1", "markov_head.markov_w2")


def rope_scaling_for_engines(scaling: dict | None) -> dict | None:
    """The target's rope_scaling with both `rope_type` (transformers >= 4.45, vLLM, SGLang) and
    `type` (the EAGLE reference code reads only `type`)."""
    if not scaling:
        return None
    scaling = dict(scaling)
    kind = scaling.get("rope_type", scaling.get("type"))
    return {**scaling, "rope_type": kind, "type": kind}


def llama_keys(cfg: DraftConfig, dtype: torch.dtype) -> dict:
    """The Llama config keys every engine reads to size the draft layer and its RoPE."""
    return {
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": cfg.num_hidden_layers,
        "vocab_size": cfg.vocab_size,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": rope_scaling_for_engines(cfg.rope_scaling),
        "max_position_embeddings": cfg.max_position_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": DTYPE_NAMES[dtype],
    }


def provenance(cfg: DraftConfig, extra: dict) -> dict:
    """What an import needs that the engine keys do not carry (the target's layer count, the aux
    ids in our convention), plus whatever the caller recorded (data, steps)."""
    ours = {
        "target": cfg.target,
        "target_num_layers": cfg.target_num_layers,
        "aux_layer_ids": list(cfg.aux_layer_ids),
        "method": cfg.method,
    }
    if cfg.num_depths:
        ours["num_depths"] = cfg.num_depths
    if family_of(cfg.method) == "block":
        ours.update(block_mask=cfg.block_mask, block_lm_head=cfg.block_lm_head)
    return {**ours, **extra}


def servable_target(target: str) -> str:
    """The name an engine loads the target by (an embedded alias becomes the hub id it came from)."""
    return HUB_IDS.get(target, target)


def loadable_target(target: str) -> str:
    """The target as this machine loads it: a local directory as an absolute path (an alias or a .gguf: the
    directory it was converted to), else the name given (a hub id, or a name nothing here resolves)."""
    try:
        resolved = resolve_target(target)
    except (ValueError, OSError):
        return servable_target(target)
    return str(Path(resolved).resolve()) if Path(resolved).is_dir() else resolved


def hub_id(target: str) -> str | None:
    """The target's hub id where one is known: an alias's, or the name of a target that is not local."""
    if target in HUB_IDS:
        return HUB_IDS[target]
    local = target.startswith(("/", ".", "~")) or target.endswith(".gguf") or Path(target).expanduser().exists()
    return target if target.count("/") == 1 and not local else None


def verifier_for(target: str, trained_on: str = "") -> dict:
    """The verifier entry of a speculators export of a head of `trained_on` whose target this machine loads as
    `target`: {"verifier": what this machine loads it by}, and {"verifier_hub_id": the hub id} where one is known
    (from either name) and not the one written."""
    written = loadable_target(target)
    hub = hub_id(target) or (hub_id(trained_on) if trained_on else None)
    return {"verifier": written} | ({"verifier_hub_id": hub} if hub and hub != written else {})


def verifier_entry(cfg: DraftConfig, extra: dict) -> tuple[str, dict]:
    """speculators_config.verifier.name_or_path, which speculators' loader and `vllm serve DIR` load the target by,
    and `extra` without it: `extra["verifier"]` as given (eagle-export writes `verifier_for` its --target there,
    or --verifier as given), else `verifier_for` the head's target, whose hub id goes to our provenance block."""
    extra = {**verifier_for(cfg.target), **extra} if "verifier" not in extra else dict(extra)
    return extra.pop("verifier"), extra


def verifier(config: dict) -> str | None:
    """The target a speculators config names (speculators_config.verifier.name_or_path); None in other layouts."""
    return ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")


def verifier_notice(config: dict) -> str:
    """What a speculators config's verifier entry holds and how to point it elsewhere ("" for other layouts)."""
    name = verifier(config)
    if not name:
        return ""
    hub = (config.get(PROVENANCE_KEY) or {}).get("verifier_hub_id")
    if not Path(name).is_absolute():
        return (
            f"verifier: {name} (speculators' loader and `vllm serve DIR` load the target by this name; offline, "
            "re-export with --verifier DIR, a local copy)"
        )
    elsewhere = f"--verifier {hub} or the target's path there" if hub else "--verifier with the target's path there"
    return (
        f"verifier: {name} (a local directory: speculators' loader and `vllm serve DIR` load the target from it on "
        f"this machine; for another machine, re-export with {elsewhere})"
    )


def non_default_aux_ids(cfg: DraftConfig) -> list[int] | None:
    """The head's aux ids unless they are what the engines capture unasked (our shallow defaults are not)."""
    ids = list(cfg.aux_layer_ids)
    return None if ids == list(engine_aux_layer_ids(cfg.target_num_layers)) else ids


# ---- eagle3 --------------------------------------------------------------------------------------


def eagle3_config(cfg: DraftConfig, dtype: torch.dtype, extra: dict) -> dict:
    config = {
        "architectures": [EAGLE3_ARCHITECTURE],
        **llama_keys(cfg, dtype),
        "draft_vocab_size": cfg.draft_vocab_size,
    }
    if cfg.target_hidden_size != cfg.hidden_size:
        config["target_hidden_size"] = cfg.target_hidden_size
    ids = non_default_aux_ids(cfg)
    if ids:
        config["eagle_aux_hidden_state_layer_ids"] = ids  # vLLM
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in ids]}  # SGLang
    config[PROVENANCE_KEY] = provenance(cfg, extra)
    return config


def aux_ids_in_config(config: dict) -> list[int] | None:
    """Aux ids a config states, in our convention (vLLM's top-level key wins, like in vLLM)."""
    if config.get("eagle_aux_hidden_state_layer_ids"):
        return list(config["eagle_aux_hidden_state_layer_ids"])
    nested = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return [i + 1 for i in nested] if nested else None


def draft_config_from_llama(llama: dict, top: dict, target_config=None, aux_layer_ids=None) -> DraftConfig:
    """A DraftConfig from Llama keys (`llama`) and the EAGLE keys beside them (`top`), with the
    defaults a Llama config has for absent keys (what the engines fall back to).

    The target's layer count is not an engine key: it comes from our provenance block or from
    `target_config`; without either the aux ids must be stated in the config (or passed in).
    """
    need = [k for k in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size") if k not in llama]
    if need:
        raise ValueError(f"config.json lacks {need}: not an EAGLE-3 Llama-style draft config")
    ours = top.get(PROVENANCE_KEY) or {}
    if target_config is not None:
        target_config = getattr(target_config, "text_config", None) or target_config
    n = ours.get("target_num_layers") or (target_config.num_hidden_layers if target_config is not None else 0)
    aux = aux_layer_ids or ours.get("aux_layer_ids") or aux_ids_in_config(top)
    if not aux:
        if not n:
            raise ValueError(
                "config.json names no aux layer ids and the target's layer count is unknown: "
                "pass the target (--target T / target_model=...) so the defaults (2, N//2, N-3) apply"
            )
        aux = engine_aux_layer_ids(n)  # what the engines capture for it
    heads = llama["num_attention_heads"]
    theta, scaling = target_rope(
        SimpleNamespace(
            rope_theta=llama.get("rope_theta", 10000.0),
            rope_scaling=llama.get("rope_scaling"),
            rope_parameters=llama.get("rope_parameters"),
        )
    )
    if scaling:
        scaling.pop("type", None)
    return DraftConfig(
        hidden_size=llama["hidden_size"],
        num_attention_heads=heads,
        num_key_value_heads=llama.get("num_key_value_heads") or heads,
        head_dim=llama.get("head_dim") or llama["hidden_size"] // heads,
        intermediate_size=llama["intermediate_size"],
        vocab_size=llama["vocab_size"],
        draft_vocab_size=top.get("draft_vocab_size") or llama["vocab_size"],
        rms_norm_eps=llama.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=llama.get("max_position_embeddings", 2048),
        target_hidden_size=top.get("target_hidden_size") or llama["hidden_size"],
        target_num_layers=n,
        aux_layer_ids=tuple(aux),
        num_hidden_layers=llama.get("num_hidden_layers", 1),
        method=ours.get("method") or speculators_method(top) or method_with(layout="eagle3"),
        target=ours.get("target") or (top.get("speculators_config") or {}).get("verifier", {}).get("name_or_path", ""),
    )


def eagle3_read(config: dict, target_config=None) -> DraftConfig:
    cfg = draft_config_from_llama(config, config, target_config)
    return as_peagle(cfg, config) if any(k in config for k in MASK_TOKEN_KEYS) else cfg


def is_eagle3(config: dict) -> bool:
    return EAGLE3_ARCHITECTURE in (config.get("architectures") or []) or (
        config.get("model_type") == "llama" and "draft_vocab_size" in config
    )


# ---- speculators -------------------------------------------------------------------------------


def speculators_config(cfg: DraftConfig, dtype: torch.dtype, extra: dict) -> dict:
    if family_of(cfg.method) == "block":
        return block_speculators_config(cfg, dtype, extra)
    extra = dict(extra)
    tokens = int(extra.pop("speculative_tokens", 3))
    verifier, extra = verifier_entry(cfg, extra)
    layer = with_window(cfg, qwen3_keys(cfg, dtype) if cfg.qk_norm else llama_keys(cfg, dtype))
    peagle = family_of(cfg.method) == "parallel"
    config = {
        "speculators_model_type": row(cfg.method).speculators_type,
        "architectures": ["PEagleSpeculator" if peagle else "Eagle3Speculator"],
        "transformer_layer_config": layer,
        "draft_vocab_size": cfg.draft_vocab_size,
        # vLLM reads these ids with our convention; written always, like the speculators library.
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        # vLLM defaults this to true for speculators configs: written always
        "norm_before_residual": cfg.norm_before_residual,
        **{flag: True for flag in SPECULATORS_NORM_FLAGS if getattr(cfg, flag)},
        "tie_word_embeddings": False,
        "torch_dtype": DTYPE_NAMES[dtype],
        "speculators_config": {
            "algorithm": row(cfg.method).speculators_type,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": tokens}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(cfg.target_architectures)},
        },
    }
    if cfg.target_hidden_size != cfg.hidden_size:
        config["target_hidden_size"] = cfg.target_hidden_size
    if peagle:  # vLLM's speculators reader copies it to pard_token (update_peagle)
        config["mask_token_id"] = cfg.mask_token_id
    config[PROVENANCE_KEY] = provenance(cfg, extra)
    return config


def speculators_read(config: dict, target_config=None) -> DraftConfig:
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ValueError("speculators config.json has no transformer_layer_config dict")
    family = family_of(speculators_method(config))
    if family == "block":
        return block_read(config, target_config)
    layer = full_layer_config(layer)
    cfg = draft_config_from_llama(layer, config, target_config)
    parallel = family == "parallel"
    # absent, vLLM takes norm_before_residual as true for EAGLE-3 and false for P-EAGLE
    cfg.norm_before_residual = bool(config.get("norm_before_residual", not parallel))
    for flag in SPECULATORS_NORM_FLAGS:
        setattr(cfg, flag, bool(config.get(flag, False)))
    cfg.qk_norm = layer.get("model_type") == "qwen3"
    cfg.sliding_window = layer_window(layer)
    if parallel:
        tokens = (config.get("speculators_config") or {}).get("proposal_methods") or [{}]
        as_peagle(cfg, config, tokens[0].get("speculative_tokens"))
    elif cfg.num_hidden_layers != 1:
        raise ValueError(
            f"this speculators EAGLE-3 head has {cfg.num_hidden_layers} decoder layers; eagle-train's EAGLE-3 head "
            "has one, so it cannot be imported"
        )
    return cfg


SPECULATORS_NORM_FLAGS = ("norm_before_fc", "fc_norm", "norm_output")  # absent: false, in speculators and vLLM


def full_layer_config(layer: dict) -> dict:
    """speculators' `transformer_layer_config` as the config class its model_type names reads it: speculators saves
    only the keys that differ from that class's defaults."""
    if "model_type" not in layer:
        return layer
    from transformers import AutoConfig

    return AutoConfig.for_model(**layer).to_dict()


def layer_window(layer: dict) -> int | None:
    """The sliding window of a speculators `transformer_layer_config` (`full_layer_config`'s; None: full attention);
    ValueError for layers of mixed types."""
    types = set(layer.get("layer_types") or [])
    if len(types) > 1:
        raise ValueError(f"this speculators head mixes layer types {sorted(types)}: it cannot be imported")
    return layer.get("sliding_window") if types == {"sliding_attention"} else None


def with_window(cfg: DraftConfig, layer: dict) -> dict:
    """`layer` (the keys a speculators `transformer_layer_config` holds) with the head's sliding window, as speculators
    writes one: every layer a sliding_attention layer."""
    if cfg.sliding_window:
        layer.update(
            sliding_window=cfg.sliding_window,
            use_sliding_window=True,
            layer_types=["sliding_attention"] * cfg.num_hidden_layers,
        )
    return layer


def speculators_method(config: dict) -> str | None:
    """The method of a speculators config, by the model type it names (`Method.speculators_type`); None for a
    config of another layout or a model type no method has."""
    kind = config.get("speculators_model_type")
    return method_with(speculators_type=kind) if kind is not None else None


def is_speculators(config: dict) -> bool:
    return speculators_method(config) is not None


# ---- peagle (vLLM parallel drafting) -------------------------------------------------------------

MASK_TOKEN_KEYS = ("ptd_token_id", "pard_token", "mask_token_id")  # vLLM versions read different ones


def mask_token_ids(config: dict) -> dict:
    """The mask token id under each of MASK_TOKEN_KEYS that a config.json states, at the top level
    or under transformer_layer_config (the top level wins)."""
    layer = config.get("transformer_layer_config") or {}
    return {k: config.get(k, layer.get(k)) for k in MASK_TOKEN_KEYS if k in config or k in layer}


def as_peagle(cfg: DraftConfig, config: dict, num_depths=None) -> DraftConfig:
    """Mark a config read from a P-EAGLE directory: the mask token and K (our provenance, else
    `num_depths`, else its method's training default, the published heads' K)."""
    ids = [i for i in mask_token_ids(config).values() if i is not None]
    if not ids:
        raise ValueError(f"P-EAGLE config.json names no mask token id (one of {', '.join(MASK_TOKEN_KEYS)})")
    ours = config.get(PROVENANCE_KEY) or {}
    cfg.method, cfg.mask_token_id = method_with(layout="peagle"), int(ids[0])
    cfg.num_depths = int(ours.get("num_depths") or num_depths or row(cfg.method).train_keys().num_depths)
    return cfg


def peagle_config(cfg: DraftConfig, dtype: torch.dtype, extra: dict) -> dict:
    """The EAGLE-3 layout with N layers, the mask token id under all three names and
    `parallel_drafting` (docs/design.md section 7); `attention_bias` false comes with llama_keys."""
    config = eagle3_config(cfg, dtype, extra)
    config.update({k: cfg.mask_token_id for k in MASK_TOKEN_KEYS})
    config["parallel_drafting"] = True
    config[PROVENANCE_KEY] = config.pop(PROVENANCE_KEY)  # keep our block last
    return config


# ---- block heads: dflash (z-lab), dspark (DeepSpec), and their speculators form ---------------------


def qwen3_keys(cfg: DraftConfig, dtype: torch.dtype) -> dict:
    """The Qwen3 config keys the engines size a block head's layers by (Qwen3 layers: q_norm, k_norm)."""
    return {**llama_keys(cfg, dtype), "model_type": "qwen3", "use_sliding_window": False}


def engine_target_layer_ids(cfg: DraftConfig) -> list[int]:
    """The target layers in DFlash's convention: decoder layer ids (our HF hidden_states index - 1)."""
    return [i - 1 for i in cfg.aux_layer_ids]


def dspark_keys(cfg: DraftConfig) -> dict:
    """DSpark's own keys, as DeepSpec writes them and vLLM reads them; the confidence head always reads
    [h; W1[prev]] (confidence_head_with_markov)."""
    keys = {"markov_rank": cfg.markov_rank, "enable_confidence_head": cfg.confidence_head}
    if cfg.markov_rank:
        keys["markov_head_type"] = "vanilla"
    if cfg.confidence_head:
        keys["confidence_head_with_markov"] = True
    return keys


SPECULATORS_BLOCK_KEYS = {  # speculators' block model types and the keys each writes beyond the common ones
    "dflash": lambda cfg: {},
    "dspark": dspark_keys,
}


def block_common(cfg: DraftConfig, dtype: torch.dtype) -> dict:
    config = {**qwen3_keys(cfg, dtype), "block_size": cfg.block_size, "draft_vocab_size": cfg.draft_vocab_size}
    if cfg.target_hidden_size != cfg.hidden_size:
        config["target_hidden_size"] = cfg.target_hidden_size
    config["num_target_layers"] = cfg.target_num_layers
    return config


def dflash_config(cfg: DraftConfig, dtype: torch.dtype, extra: dict) -> dict:
    """z-lab's keys: vLLM reads dflash_config.causal, z-lab's dflash library only the top-level is_causal."""
    config = {"architectures": [DFLASH_ARCHITECTURE], **block_common(cfg, dtype), "is_causal": cfg.causal}
    config["dflash_config"] = {
        "mask_token_id": cfg.mask_token_id,
        "target_layer_ids": engine_target_layer_ids(cfg),
        "causal": cfg.causal,
        "sample_from_anchor": cfg.sample_from_anchor,
    }
    config[PROVENANCE_KEY] = provenance(cfg, extra)
    return config


def dspark_config(cfg: DraftConfig, dtype: torch.dtype, extra: dict) -> dict:
    config = {"architectures": [DSPARK_ARCHITECTURE], **block_common(cfg, dtype)}
    config.update(
        {
            "mask_token_id": cfg.mask_token_id,
            "target_layer_ids": engine_target_layer_ids(cfg),
            "sample_from_anchor": cfg.sample_from_anchor,
            "is_causal": cfg.causal,
            **dspark_keys(cfg),
        }
    )
    config[PROVENANCE_KEY] = provenance(cfg, extra)
    return config


def block_speculators_config(cfg: DraftConfig, dtype: torch.dtype, extra: dict) -> dict:
    """speculators' DFlash / DSpark config: vLLM builds the native one from it (its speculators algos).
    K = the drafts a block gives, whatever --speculative-tokens says."""
    extra = {k: v for k, v in extra.items() if k != "speculative_tokens"}
    verifier, extra = verifier_entry(cfg, extra)
    kind = row(cfg.method).speculators_type
    config = {
        "speculators_model_type": kind,
        "architectures": [SPECULATOR_ARCHITECTURES[kind]],
        "transformer_layer_config": with_window(cfg, qwen3_keys(cfg, dtype)),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "block_size": cfg.block_size,
        "mask_token_id": cfg.mask_token_id,
        "aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        "sample_from_anchor": cfg.sample_from_anchor,
        # speculators: causal in sliding-window layers unless true (full-attention ones never are); vLLM: causal = not
        "sliding_window_non_causal": not cfg.causal,
        "tie_word_embeddings": False,
        "torch_dtype": DTYPE_NAMES[dtype],
        "speculators_config": {
            "algorithm": kind,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": row(cfg.method).drafts(cfg)}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(cfg.target_architectures)},
        },
    }
    config.update(SPECULATORS_BLOCK_KEYS[kind](cfg))
    config[PROVENANCE_KEY] = provenance(cfg, extra)
    return config


def block_settings(config: dict) -> dict:
    """What a block config states beyond the Qwen3 keys, whichever of the three layouts it is in, with the
    engines' defaults for absent keys (sample_from_anchor: false for DFlash and speculators, true for native
    DSpark): method, aux ids (ours), mask token, block size, causal, sample_from_anchor, Markov rank, confidence."""
    dflash = config.get("dflash_config") or {}
    window = None
    if family_of(speculators_method(config)) == "block":
        method, aux = speculators_method(config), config.get("aux_hidden_state_layer_ids")
        # speculators: a block is causal in sliding-window layers unless sliding_window_non_causal, never in others
        window = layer_window(full_layer_config(config.get("transformer_layer_config") or {}))
        causal = bool(window) and not config.get("sliding_window_non_causal", False)
        from_anchor = config.get("sample_from_anchor", False)
    elif is_dflash(config):
        method, causal = method_with(layout="dflash"), config.get("is_causal", dflash.get("causal"))
        ids = zlab_target_layer_ids(config)
        aux = [i + 1 for i in ids] if ids else None
        from_anchor = dflash.get("sample_from_anchor", False)
    else:
        method, causal = method_with(layout="dspark"), config.get("is_causal")
        aux = [i + 1 for i in config["target_layer_ids"]] if config.get("target_layer_ids") else None
        from_anchor = config.get("sample_from_anchor", True)
    return {
        "method": method,
        "aux_layer_ids": aux,
        "mask_token_id": dflash.get("mask_token_id", config.get("mask_token_id")),
        "block_size": config.get("block_size") or dflash.get("block_size"),
        "causal": bool(causal),
        "sample_from_anchor": bool(from_anchor),
        "markov_rank": int(config.get("markov_rank") or 0),
        "confidence_head": bool(config.get("enable_confidence_head")),
        "sliding_window": window,
    }


def zlab_target_layer_ids(config: dict) -> list[int] | None:
    """The target layers (decoder layer ids) z-lab's DFlashDraftModel reads for a dflash config (dflash/model.py):
    dflash_config's target_layer_ids, else the top-level key, else its build_target_layer_ids of num_target_layers N
    and the draft's layer count L: layer N // 2 for one draft layer, else L ids spread evenly from 1 to N - 3."""
    stated = (config.get("dflash_config") or {}).get("target_layer_ids", config.get("target_layer_ids"))
    if stated:
        return list(stated)
    n, layers = config.get("num_target_layers"), config.get("num_hidden_layers", 1)
    if not n:
        return None
    if layers == 1:
        return [n // 2]
    return [round(1 + i * (n - 4) / (layers - 1)) for i in range(layers)]


def block_read(config: dict, target_config=None) -> DraftConfig:
    """A block head's config; block_mask / block_lm_head from our provenance block, else the defaults (an export
    of another trainer's: `eagle_train.export.read_export` tells them from the files)."""
    layer = full_layer_config(config["transformer_layer_config"]) if "speculators_model_type" in config else config
    settings = block_settings(config)
    if settings["mask_token_id"] is None or not settings["block_size"]:
        raise ValueError(f"{settings['method']} config.json names no mask_token_id or block_size")
    cfg = draft_config_from_llama(layer, config, target_config, aux_layer_ids=settings.pop("aux_layer_ids"))
    cfg.target_num_layers = cfg.target_num_layers or config.get("num_target_layers") or 0
    ours = config.get(PROVENANCE_KEY) or {}
    settings.update({k: ours[k] for k in ("block_mask", "block_lm_head") if k in ours})
    for key, value in settings.items():
        setattr(cfg, key, value)
    return cfg


def speculators_refusal(cfg: DraftConfig) -> str:
    """What speculators' DFlash / DSpark loader (SpeculatorModel.from_pretrained) would not read as trained: it
    never saves or reads embed_tokens nor mask_embedding.pt (load_verifier_weights embeds the mask slots by the
    verifier's row mask_token_id), and replaces a full-vocabulary lm_head by the verifier's."""
    if family_of(cfg.method) != "block":
        return ""
    own_layout = row(cfg.method).layout
    own = f"export --format {own_layout}" + " --target T" * LAYOUTS[own_layout].ships_embedding(cfg)
    if cfg.block_mask != "target":
        return (
            "speculators embeds the mask slots by the verifier's row mask_token_id and never reads this head's "
            f"learnt mask embedding: train with block_mask: target, or {own}"
        )
    if cfg.causal and not cfg.sliding_window:
        return (
            "speculators reads a block as causal only in sliding-window layers (its full-attention layers see the "
            f"whole block), so it would not read this causal head as trained: {own}"
        )
    if cfg.block_lm_head != "target" and cfg.draft_vocab_size == cfg.vocab_size:
        return (
            "speculators replaces a full-vocabulary lm_head by the verifier's, not this head's trained one: train "
            f"with block_lm_head: target or a reduced draft vocabulary, or {own}"
        )
    return ""


def speculators_ships_embedding(cfg: DraftConfig) -> bool:
    """speculators' EAGLE-3 loader (Eagle3DraftModel.from_pretrained) fills embed_tokens from the verifier only where
    it is still NaN, but transformers materialises a weight the files lack as uninitialised memory (zeros, for a
    large one): the export ships it, as speculators' own EAGLE-3 checkpoints do. Its DFlash / DSpark loaders always
    take the verifier's."""
    return family_of(cfg.method) != "block"


def zlab_notice(cfg: DraftConfig) -> str:
    """What z-lab's dflash library (dflash.model.DFlashDraftModel) would not read of a dflash export: it embeds the
    mask slots by the target's row mask_token_id and drafts through the target's lm_head, never reading
    mask_embedding.pt, lm_head or d2t (vLLM and llama.cpp read them)."""
    lost = [key for key in ("block_mask", "block_lm_head") if getattr(cfg, key) != "target"]
    if not lost:
        return ""
    return (
        f"note: z-lab's dflash library cannot read this head as trained ({', '.join(lost)} not target: it uses the "
        "target's mask row and lm_head); vLLM and llama.cpp can. Train with block_mask: target and block_lm_head: "
        "target for all three"
    )


def variants_refusal(cfg: DraftConfig) -> str:
    """Why a layout that cannot state DraftConfig's VARIANTS (every one but speculators') refuses a head that has
    some: its readers would run another head."""
    variants = cfg.variants()
    if not variants:
        return ""
    return (
        f"this head applies {', '.join(variants)} (it was trained by speculators), which this layout cannot state, "
        "so its readers would run another head: use --format speculators"
    )


def says_nothing(cfg: DraftConfig) -> str:
    """No refusal, no notice: a layout whose readers read every head it can hold as trained."""
    return ""


def is_dflash(config: dict) -> bool:
    return DFLASH_ARCHITECTURE in (config.get("architectures") or []) and "speculators_model_type" not in config


def is_dspark(config: dict) -> bool:
    return DSPARK_ARCHITECTURE in (config.get("architectures") or []) and "speculators_model_type" not in config


def is_block(config: dict) -> bool:
    """A DFlash or DSpark config, in any of the three layouts."""
    return is_dflash(config) or is_dspark(config) or family_of(speculators_method(config)) == "block"


def markov_to_file(name: str, method: str = "") -> str:
    return name + ".weight" if name in MARKOV_TENSORS else name


def markov_from_file(name: str, method: str = "") -> str:
    return name.removesuffix(".weight") if name.removesuffix(".weight") in MARKOV_TENSORS else name


def by_method(eagle: Callable[[str, str], str], block: Callable[[str, str], str]) -> Callable[[str, str], str]:
    """A name map for a layout holding both kinds of heads: `block`'s for DFlash / DSpark, else `eagle`'s."""
    return lambda name, method="": (block if family_of(method) == "block" else eagle)(name, method)


# ---- the table -----------------------------------------------------------------------------------


# ---- a draft model: a transformers causal LM directory --------------------------------------------------------

DRAFT_MODEL_PREFIX = "lm."  # a draft model's tensors are its causal LM's under this prefix (methods/draft_model)


def draft_model_config(cfg: DraftConfig, dtype: torch.dtype, extra: dict) -> dict:
    """The draft's own transformers config.json (its architecture reads it as any checkpoint of it), in `dtype`,
    with our block."""
    dtype_key = "torch_dtype" if "torch_dtype" in cfg.model_config else "dtype"
    return {**cfg.model_config, dtype_key: DTYPE_NAMES[dtype], PROVENANCE_KEY: provenance(cfg, extra)}


def draft_model_read(config: dict, target_config=None) -> DraftConfig:
    """The DraftConfig of a causal LM directory (ours or any model's), for the target of `target_config` when given
    (else for itself); ValueError when its vocabulary is not the target's."""
    model_config = {k: v for k, v in config.items() if k != PROVENANCE_KEY}
    draft = config_from_dict(model_config)
    ours = config.get(PROVENANCE_KEY) or {}
    if target_config is not None and text_config(target_config).vocab_size != draft.vocab_size:
        raise ValueError(
            f"the draft model's vocabulary ({draft.vocab_size} tokens) is not the target's "
            f"({text_config(target_config).vocab_size}): a draft model must share the target's tokenizer"
        )
    return DraftConfig.from_target_config(
        target_config if target_config is not None else draft,
        draft_vocab_size=draft.vocab_size,
        num_hidden_layers=draft.num_hidden_layers,
        method=method_with(layout="draft_model"),
        target=ours.get("target", ""),
        model_config=model_config,
    )


def is_causal_lm(config: dict) -> bool:
    """A transformers causal LM's config.json: its class `...ForCausalLM`, none of the draft layouts' keys."""
    architectures = config.get("architectures") or [""]
    return "model_type" in config and architectures[0].endswith("ForCausalLM") and not is_speculators(config)


def rename(prefixes: list[tuple[str, str]]) -> Callable[[str, str], str]:
    """Name map replacing the first matching prefix (old, new), for heads of any method."""

    def apply(name: str, method: str = "") -> str:
        for old, new in prefixes:
            if name.startswith(old):
                return new + name[len(old) :]
        return name

    return apply


@dataclass(frozen=True)
class Layout:
    name: str
    engines: tuple[str, ...]  # the engines `eagle-export --check` checks by default
    write_config: Callable[[DraftConfig, torch.dtype, dict], dict]
    read_config: Callable[[dict, object], DraftConfig]
    to_file: Callable[[str, str], str]  # (head tensor name, head method) -> file tensor name
    from_file: Callable[[str, str], str]  # (file tensor name, head method) -> head tensor name
    matches: Callable[[dict], bool]
    mask_file: bool = False  # a block head's mask_embedding goes to MASK_EMBEDDING_FILE, not the weights
    # the heads whose export carries EMBEDDING_TENSOR, the target's (a block head's: row mask_token_id the learnt
    # mask embedding), because the layout's reader never takes it from the target
    ships_embedding: Callable[[DraftConfig], bool] = lambda cfg: False
    block_t2d: bool = False  # a reduced-vocabulary block head ships t2d beside d2t (its reader needs both)
    vocab_map: bool = True  # the files carry the head's d2t (and t2d); a draft model's drafts the whole vocabulary
    ships_tokenizer: bool = False  # the target's tokenizer files go beside the weights (a model directory's readers)
    # llama.cpp's own converter writes its GGUF from a directory of it (a model's); heads' GGUFs are
    # eagle_train.export.gguf's
    llamacpp_converts: bool = False
    refusal: Callable[[DraftConfig], str] = variants_refusal  # why a head cannot be written so its reader reads it
    notice: Callable[[DraftConfig], str] = says_nothing  # a line on a reader that cannot read the written head


LAYOUTS: dict[str, Layout] = {
    "draft_model": Layout(
        "draft_model",
        ("vllm",),
        draft_model_config,
        draft_model_read,
        lambda name, method="": name.removeprefix(DRAFT_MODEL_PREFIX),
        lambda name, method="": DRAFT_MODEL_PREFIX + name,
        is_causal_lm,
        vocab_map=False,
        ships_tokenizer=True,
        llamacpp_converts=True,
    ),
    "eagle3": Layout(
        "eagle3", ("vllm", "sglang", "trtllm"), eagle3_config, eagle3_read, rename([]), rename([]), is_eagle3
    ),
    "speculators": Layout(
        "speculators",
        ("vllm",),
        speculators_config,
        speculators_read,
        by_method(rename([("midlayer.", "layers.0.")]), markov_to_file),
        by_method(rename([("layers.0.", "midlayer.")]), markov_from_file),
        is_speculators,
        mask_file=True,
        ships_embedding=speculators_ships_embedding,
        block_t2d=True,
        refusal=speculators_refusal,
    ),
    # On disk a P-EAGLE directory is the eagle3 layout plus keys, so it is read (and detected) as that
    # row, whose reader sees the mask token; this row only writes.
    "peagle": Layout("peagle", ("vllm",), peagle_config, eagle3_read, rename([]), rename([]), lambda config: False),
    "dflash": Layout(
        "dflash",
        ("vllm",),
        dflash_config,
        block_read,
        rename([]),
        rename([]),
        is_dflash,
        mask_file=True,
        notice=zlab_notice,
    ),
    "dspark": Layout(
        "dspark",
        ("vllm",),
        dspark_config,
        block_read,
        markov_to_file,
        markov_from_file,
        is_dspark,
        mask_file=True,
        ships_embedding=lambda cfg: cfg.block_mask == "learnt",
    ),
}


def detect_layout(config: dict) -> Layout:
    """The layout a config.json is written in (most specific first: speculators before eagle3)."""
    for layout in sorted(LAYOUTS.values(), key=lambda lay: lay.name == "eagle3"):
        if layout.matches(config):
            return layout
    kinds = ", ".join(dict.fromkeys(f'"{m.speculators_type}"' for m in METHODS.values() if m.speculators_type))
    raise ValueError(
        'config.json is in no known draft layout (expected architectures ["LlamaForCausalLMEagle3"], '
        f'["{DFLASH_ARCHITECTURE}"] or ["{DSPARK_ARCHITECTURE}"], or speculators_model_type one of {kinds}; '
        f"known layouts: {', '.join(LAYOUTS)})"
    )


def layout(name: str) -> Layout:
    if name not in LAYOUTS:
        raise ValueError(f"unknown export format {name!r}; choose one of: {', '.join(LAYOUTS)}")
    return LAYOUTS[name]
