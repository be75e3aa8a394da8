"""What vLLM's block drafters' loaders do to a DFlash or DSpark directory: the rule check for those layouts.

Read from vLLM 0.32.0 (vllm/model_executor/models/qwen3_dflash.py DFlashQwen3ForCausalLM.load_weights,
qwen3_dspark.py Qwen3DSparkForCausalLM.load_weights, transformers_utils/configs/speculators/algos.py):
every file tensor but `lm_head` and `d2t` is loaded as `model.` + its name, `d2t` becomes
`draft_id_to_target_id` (a parameter only for a reduced vocabulary), `t2d` is skipped, a tensor with no
parameter stops the load. The target layers it captures are `target_layer_ids` + 1 (under `dflash_config`
for DFlash, top level for DSpark). The mask slots: DFlash replaces the embedding row of `mask_token_id` by
mask_embedding.pt when the directory has one; DSpark never reads that file and embeds the row of
`embed_tokens.weight` when shipped (else of the target's embedding), so a DSpark export ships that row learnt.

A speculators config is turned into the config vLLM builds by vLLM's own functions when vLLM is installed
here (`SpeculatorsConfig`), else by the same mapping restated (`restated_hf_config`).
"""

import copy
import importlib.util

import torch

from eagle_train.export import read_mask_embedding
from eagle_train.export.draft_files import DraftFiles
from eagle_train.export.layouts import (
    EMBEDDING_TENSOR,
    MARKOV_TENSORS,
    MASK_EMBEDDING_FILE,
    PROVENANCE_KEY,
    block_read,
    detect_layout,
    speculators_method,
)
from eagle_train.methods import method_with, row
from engines.rules import SHARD_ORDER, EngineReport, check_target, check_vocab_map, stack


def restated_hf_config(config: dict) -> dict:
    """vLLM's speculators dflash / dspark mapping (algos.py update_dflash, update_dspark), for when vLLM is
    not installed here: the Qwen3 keys with the native keys built from the speculators ones, those of the own
    layout of the config's method."""
    hf = dict(config.get("transformer_layer_config") or {})
    aux = config.get("aux_hidden_state_layer_ids")
    if aux is None:
        raise KeyError("aux_hidden_state_layer_ids")
    hf["eagle_aux_hidden_state_layer_ids"] = aux
    if row(speculators_method(config)).layout == "dflash":
        hf["architectures"] = ["DFlashDraftModel"]
        hf["draft_vocab_size"] = config.get("draft_vocab_size")
        hf["dflash_config"] = {
            "mask_token_id": config["mask_token_id"],
            "target_layer_ids": [i - 1 for i in aux],
            "sample_from_anchor": config.get("sample_from_anchor", False),
            "causal": not config.get("sliding_window_non_causal", True),
        }
    else:
        hf["architectures"] = ["Qwen3DSparkModel"]
        hf["sample_from_anchor"] = config.get("sample_from_anchor", False)
        hf["target_layer_ids"] = [i - 1 for i in aux]
        for key in ("draft_vocab_size", "mask_token_id", "markov_rank", "markov_head_type", "block_size"):
            if config.get(key) is not None:
                hf[key] = config[key]
        for key in ("target_hidden_size", "enable_confidence_head", "confidence_head_with_markov"):
            if config.get(key) is not None:
                hf[key] = config[key]
    if config.get("target_hidden_size") is not None:
        hf["target_hidden_size"] = config["target_hidden_size"]
    return hf


def vllm_hf_config(config: dict) -> tuple[dict, str]:
    """(the config vLLM builds its draft model from, who said so): a native config as it is; a speculators one
    through the installed vLLM's SpeculatorsConfig (validation included), else `restated_hf_config`.
    Raises ValueError with vLLM's reason when it refuses the config."""
    if "speculators_model_type" not in config:
        return config, "config.json"
    if importlib.util.find_spec("vllm") is None:
        try:
            return restated_hf_config(config), "vLLM's speculators mapping (restated: vLLM is not installed here)"
        except KeyError as e:
            raise ValueError(f"vLLM's speculators reader needs {e.args[0]}") from e
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    try:
        SpeculatorsConfig.validate_speculators_config(config)
        return SpeculatorsConfig.extract_transformers_pre_trained_config(copy.deepcopy(config)), "the installed vLLM"
    except (KeyError, ValueError, TypeError) as e:
        raise ValueError(f"vLLM's speculators reader refuses the config ({type(e).__name__}: {e})") from e


def engine_settings(hf: dict) -> dict:
    """What vLLM reads from its draft config: its layout (dflash: DFlashDraftModel, else dspark: Qwen3DSparkModel),
    target layers (HF hidden_states indices), mask token, sample_from_anchor, Markov rank, confidence head."""
    dflash = hf.get("dflash_config") or {}
    layout = "dflash" if any(a.startswith("DFlash") for a in hf.get("architectures") or []) else "dspark"
    layers = dflash.get("target_layer_ids") if layout == "dflash" else hf.get("target_layer_ids")
    return {
        "layout": layout,
        "aux": tuple(i + 1 for i in layers) if layers else None,
        "mask_token_id": dflash.get("mask_token_id", hf.get("mask_token_id")),
        "sample_from_anchor": dflash.get("sample_from_anchor", False)
        if layout == "dflash"
        else hf.get("sample_from_anchor", True),
        "markov_rank": hf.get("markov_rank"),
        "confidence": bool(hf.get("enable_confidence_head")),
        "with_markov": bool(hf.get("confidence_head_with_markov")),
    }


def block_shapes(cfg, settings: dict) -> dict[str, tuple]:
    """Every tensor vLLM's block model has a parameter for (file names), with the shape config.json implies."""
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    n_aux = len(settings["aux"] or cfg.aux_layer_ids)
    shapes = {
        "fc.weight": (h, n_aux * cfg.target_hidden_size),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
        "lm_head.weight": (cfg.draft_vocab_size, h),
    }
    if cfg.draft_vocab_size < cfg.vocab_size:
        shapes["d2t"] = (cfg.draft_vocab_size,)
    for layer in range(cfg.num_hidden_layers):
        p = f"layers.{layer}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
                p + "self_attn.q_norm.weight": (d,),
                p + "self_attn.k_norm.weight": (d,),
                p + "mlp.gate_proj.weight": (i, h),
                p + "mlp.up_proj.weight": (i, h),
                p + "mlp.down_proj.weight": (h, i),
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
            }
        )
    if settings["layout"] == "dspark" and settings["markov_rank"]:
        r = settings["markov_rank"]
        shapes[MARKOV_TENSORS[0] + ".weight"] = (cfg.vocab_size, r)
        shapes[MARKOV_TENSORS[1] + ".weight"] = (cfg.draft_vocab_size, r)
        if settings["confidence"]:
            shapes["confidence_head.proj.weight"] = (1, h + (r if settings["with_markov"] else 0))
            shapes["confidence_head.proj.bias"] = (1,)
    return shapes


def vllm_param(file_name: str) -> str:
    """The parameter vLLM's block loaders put a file tensor in (before q/k/v and gate/up fusion)."""
    if "d2t" in file_name:
        return "draft_id_to_target_id"
    return file_name if "lm_head" in file_name else "model." + file_name


def inspect(eng, files: DraftFiles, target_config=None) -> EngineReport:
    """What vLLM would do with the DFlash / DSpark directory in `files` (no weights are read but d2t)."""
    config = files.config
    lay = detect_layout(config)
    report = EngineReport(eng.name, lay.name, eng)
    try:
        hf, said = vllm_hf_config(config)
        cfg = block_read(config, target_config)
    except (KeyError, ValueError) as e:
        report.add("error", str(e))
        return report
    settings = engine_settings(hf)
    title = f"vLLM's {row(method_with(layout=settings['layout'])).title}"
    report.config, report.aux_layers, report.context_length = cfg, settings["aux"], cfg.max_position_embeddings
    report.add("info", f"the draft config vLLM builds comes from {said}")
    check_config(report, title, config, hf, cfg, settings)
    eng.check_layout_keys(report, config, lay.name)
    check_block_weights(report, title, files, cfg, settings)
    check_mask_embedding(report, title, files, cfg, settings)
    check_vocab_map(report, eng, files, cfg)
    layer = config.get("transformer_layer_config") if "speculators_model_type" in config else config
    check_target(report, eng, layer, cfg, target_config)
    return report


def check_config(report, title, config, hf, cfg, settings) -> None:
    layer = config.get("transformer_layer_config") if "speculators_model_type" in config else config
    if settings["aux"] is None:
        where = "dflash_config.target_layer_ids" if settings["layout"] == "dflash" else "target_layer_ids"
        report.add("error", f"no {where}: {title} cannot tell which target layers the head reads")
    intended = tuple((config.get(PROVENANCE_KEY) or {}).get("aux_layer_ids") or ())
    if intended and settings["aux"] and settings["aux"] != intended:
        report.add(
            "error",
            f"{title} would capture target layers {list(settings['aux'])} (target_layer_ids + 1) but the head was "
            f"trained on {list(intended)}: write target_layer_ids {[i - 1 for i in intended]}",
            cause=f"wrong extract layers ({list(settings['aux'])} instead of {list(intended)})",
        )
    if settings["mask_token_id"] is None:
        report.add("error", f"no mask_token_id: {title} cannot build the block's mask slots")
    elif not 0 <= settings["mask_token_id"] < cfg.vocab_size:
        report.add("error", f"mask_token_id {settings['mask_token_id']} is not below vocab_size {cfg.vocab_size}")
    stated = "sample_from_anchor" in config or "sample_from_anchor" in (config.get("dflash_config") or {})
    if not stated:
        report.add(
            "warning",
            f"sample_from_anchor unset: {title} takes {settings['sample_from_anchor']} (engines differ on the "
            "default); write the value the head was trained with",
        )
    if settings["layout"] == "dflash" and settings["sample_from_anchor"]:
        report.add(
            "error",
            "sample_from_anchor true: vLLM's DFlash drafts from the mask slots only (its DFlash speculator refuses "
            "the key, the CPU proposer ignores it); export the head as dspark",
        )
    if settings["layout"] == "dspark":
        if settings["markov_rank"] is None:
            report.add("error", "no markov_rank: vLLM's Qwen3DSparkModel needs it (0 for no Markov head)")
        if hf.get("markov_head_type", "vanilla") != "vanilla":
            report.add("error", f"markov_head_type {hf['markov_head_type']!r}: the engines implement only 'vanilla'")
    if "rope_theta" not in layer and "rope_parameters" not in layer:
        report.add("error", f"no rope_theta: {title} uses RoPE base 10000; write the target's rope_theta")
    if "max_position_embeddings" not in layer:
        report.add("error", f"no max_position_embeddings: {title} sizes the draft's RoPE for its default")
    if layer.get("tie_word_embeddings"):
        report.add("warning", f"tie_word_embeddings true: {title} may tie the draft lm_head to the embedding")
    if "draft_vocab_size" not in hf and "draft_vocab_size" not in config:
        report.add("warning", f"no draft_vocab_size: {title} assumes the full vocabulary ({cfg.vocab_size})")
    report.add(
        "info",
        f"vLLM drafts num_speculative_tokens per block (--speculative-config); this head gives at most "
        f"{row(cfg.method).drafts(cfg)} (block_size {cfg.block_size}"
        + (", the anchor's slot drafting)" if cfg.sample_from_anchor else ", the anchor's slot drafting nothing)"),
    )


def check_block_weights(report, title, files, cfg, settings) -> None:
    meta = files.meta
    expected = block_shapes(cfg, settings)
    for name, (shape, _, _) in sorted(meta.items()):
        if "t2d" in name:
            report.ignored.append(name)
            continue
        param = vllm_param(name)
        if name == "embed_tokens.weight":
            report.loads.setdefault(param, []).append(name)
            report.add("info", f"embed_tokens.weight on file: {title} uses it instead of the target's embedding")
            continue
        if name not in expected:
            report.add("error", f"{name} -> {param} is not a {title} parameter: loading fails")
            continue
        if tuple(shape) != expected[name]:
            report.add(
                "error",
                f"{name} has shape {list(shape)} but config.json implies {list(expected[name])} (hidden_size "
                f"{cfg.hidden_size}, heads {cfg.num_attention_heads}/{cfg.num_key_value_heads}, head_dim "
                f"{cfg.head_dim}, target_hidden_size {cfg.target_hidden_size} x {len(settings['aux'] or ())} "
                f"layers, draft_vocab_size {cfg.draft_vocab_size}): config.json and the weights disagree",
            )
        report.loads.setdefault(stack(param)[0], []).append(name)
    for names in report.loads.values():
        names.sort(key=lambda n: SHARD_ORDER.get(stack(n)[1], 0))
    if "embed_tokens.weight" not in meta:
        report.filled.append("model.embed_tokens <- the target's embedding")
    for name in sorted(set(expected) - set(meta)):
        if name == "lm_head.weight" and cfg.draft_vocab_size == cfg.vocab_size:
            report.filled.append("lm_head <- the target's lm_head")
        elif name == "d2t":
            report.add(
                "error",
                f"no d2t with a reduced draft vocabulary ({cfg.draft_vocab_size} < {cfg.vocab_size}): {title} maps "
                "draft id i to target id i, a wrong token",
            )
        elif name.startswith("confidence_head."):
            report.add("info", f"no {name}: {title} runs without the confidence head")
        else:
            report.add("error", f"no {name}: {title} leaves {vllm_param(name)} at its random initialisation")
    if cfg.draft_vocab_size == cfg.vocab_size and "d2t" in meta:
        report.add("error", f"d2t with a full vocabulary: {title} has no draft_id_to_target_id then; loading fails")


def check_mask_embedding(report, title, files, cfg, settings) -> None:
    """The learnt mask embedding: mask_embedding.pt for DFlash; DSpark in vLLM embeds the vocab row instead. A head
    trained on the target's row (block_mask: target) needs neither."""
    mask_id = settings["mask_token_id"]
    path = files.directory / MASK_EMBEDDING_FILE
    if cfg.block_mask == "target" and not path.is_file() and EMBEDDING_TENSOR not in files.meta:
        report.add("info", f"the mask slots: the target's row of token {mask_id}, as trained (block_mask: target)")
        return
    if settings["layout"] == "dspark":
        check_dspark_mask_row(report, title, files, cfg, mask_id)
        return
    if not path.is_file():
        report.add(
            "error",
            f"no {MASK_EMBEDDING_FILE}: {title} embeds the mask slots with the target's row of token {mask_id}, "
            "which the head never trained with; export the head's mask_embedding (eagle-export --format dflash)",
        )
        return
    raw = torch.load(path, map_location="cpu", weights_only=True)  # vLLM takes the dict or a bare tensor
    state = raw["embedding"] if isinstance(raw, dict) else raw
    if isinstance(raw, dict) and raw.get("mask_token_id", mask_id) != mask_id:
        report.add(
            "error",
            f"{MASK_EMBEDDING_FILE} is for mask_token_id {raw.get('mask_token_id')}, config.json says {mask_id}: "
            f"{title} refuses to load",
        )
    if tuple(state.shape) != (cfg.hidden_size,):
        report.add("error", f"{MASK_EMBEDDING_FILE} holds a {list(state.shape)} tensor, {title} needs [hidden_size]")
    else:
        report.loads.setdefault("model.mask_embedding", []).append(MASK_EMBEDDING_FILE)


def check_dspark_mask_row(report, title, files, cfg, mask_id) -> None:
    """vLLM's DSpark never reads mask_embedding.pt (qwen3_dspark.py: 'DSpark masks via the vocab row'): the mask
    slots get row `mask_id` of the shipped embed_tokens, which must be [V, H] and hold the learnt embedding."""
    fix = "re-export with eagle-export --format dspark --target TARGET (the target's embedding, its mask row learnt)"
    if mask_id is None:
        return
    if EMBEDDING_TENSOR not in files.meta:
        report.add(
            "error",
            f"no {EMBEDDING_TENSOR}: {title} never reads {MASK_EMBEDDING_FILE} and embeds the mask slots with the "
            f"target's row of token {mask_id}, not the head's learnt mask embedding, so it drafts worse than "
            f"trained; {fix}",
        )
        return
    shape = tuple(files.meta[EMBEDDING_TENSOR][0])
    if shape != (cfg.vocab_size, cfg.hidden_size):
        report.add(
            "error",
            f"{EMBEDDING_TENSOR} has shape {list(shape)}, {title} needs [vocab_size, hidden_size] = "
            f"[{cfg.vocab_size}, {cfg.hidden_size}]; {fix}",
        )
        return
    learnt = read_mask_embedding(files.directory)
    if learnt is None:
        report.add(
            "warning",
            f"no {MASK_EMBEDDING_FILE}: {title} embeds the mask slots with row {mask_id} of {EMBEDDING_TENSOR}, "
            "which cannot be checked against the learnt mask embedding (llama.cpp's converter needs the file)",
        )
        return
    row = files.tensor(EMBEDDING_TENSOR)[mask_id]
    if tuple(learnt.shape) != (cfg.hidden_size,) or not torch.equal(row, learnt.to(row.dtype)):
        report.add(
            "error",
            f"row {mask_id} (mask_token_id) of {EMBEDDING_TENSOR} is not the learnt mask embedding in "
            f"{MASK_EMBEDDING_FILE}: {title} embeds the mask slots by that row and drafts worse than trained; {fix}",
        )
        return
    report.add("info", f"the mask slots: row {mask_id} of {EMBEDDING_TENSOR}, the learnt mask embedding")
