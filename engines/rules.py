"""What each serving engine would do with a draft directory: the per-engine rules, in one place.

Each rule below restates what the engine's own loader does (read from its source, see
docs/deploying.md for the files): how it renames the file's tensors, which ones it fuses, skips or
fills from the target, what it reads from config.json and what it assumes when a key is absent,
how long a context it drafts to and which target layers it captures. `inspect_engine` applies
the rules to a directory without loading weights; `engine_state` produces the tensors the engine
would hold (fused, renamed, with its own vocab-map form) and `head_from_engine_state` builds a
head back from them, so a test can show an export gives the engine the trained head's logits.

Severities: "error" = the engine would fail to load, or load and silently draft worse or wrong
(`eagle-export --check` exits non-zero); "warning" = off the reference format but harmless to
this engine; "info" = what the engine does, for the reader.
"""

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from eagle_train.draft_config import DraftConfig, target_rope
from eagle_train.export.layouts import (
    HEAD_CLASSES,
    MASK_TOKEN_KEYS,
    PROVENANCE_KEY,
    detect_layout,
    draft_config_from_llama,
    mask_token_ids,
)
from eagle_train.hidden_states import default_aux_layer_ids
from eagle_train.target import HUB_IDS
from eagle_train.vocab_map import t2d_from_d2t

ENGINE_NAMES = ("vllm", "sglang", "trtllm")
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
}
STACKED = (
    (".q_proj.", ".qkv_proj.", "q"),
    (".k_proj.", ".qkv_proj.", "k"),
    (".v_proj.", ".qkv_proj.", "v"),
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
)
SHARD_ORDER = {"q": 0, "k": 1, "v": 2, 0: 0, 1: 1}


# ---- reading a directory ---------------------------------------------------------------------------


def weight_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.exists():
        return sorted({directory / f for f in json.loads(index.read_text())["weight_map"].values()})
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (directory / name).exists():
            return [directory / name]
    raise FileNotFoundError(
        f"{directory} holds no model.safetensors (nor model.safetensors.index.json or pytorch_model.bin)"
    )


class DraftFiles:
    """config.json and the weights' names, shapes and dtypes; tensors are read only on request."""

    def __init__(self, directory):
        self.directory = Path(directory)
        path = self.directory / "config.json"
        if not path.exists():
            raise FileNotFoundError(f"{self.directory} has no config.json")
        self.config = json.loads(path.read_text())
        self.meta: dict[str, tuple[tuple, torch.dtype, Path]] = {}
        self._bin: dict[str, torch.Tensor] = {}
        for f in weight_files(self.directory):
            if f.suffix == ".bin":
                self._bin.update(torch.load(f, map_location="cpu", weights_only=True))
                self.meta.update({k: (tuple(v.shape), v.dtype, f) for k, v in self._bin.items()})
                continue
            with safe_open(f, "pt") as handle:
                for k in handle.keys():
                    s = handle.get_slice(k)
                    self.meta[k] = (tuple(s.get_shape()), SAFETENSORS_DTYPES.get(s.get_dtype(), s.get_dtype()), f)

    def tensor(self, name: str) -> torch.Tensor:
        if name in self._bin:
            return self._bin[name]
        with safe_open(self.meta[name][2], "pt") as handle:
            return handle.get_tensor(name)

    def tensors(self) -> dict[str, torch.Tensor]:
        out = dict(self._bin)
        for f in {m[2] for m in self.meta.values() if m[2].suffix != ".bin"}:
            out.update(load_file(f))
        return out


# ---- the engines' loaders --------------------------------------------------------------------------


def stack(name: str):
    """(fused parameter name, shard) the way all three engines fuse q/k/v and gate/up."""
    for part, fused, shard in STACKED:
        if part in name:
            return name.replace(part, fused), shard
    return name, None


def vllm_rename(name: str, n_layers: int, params: set) -> str | None:
    """vllm/model_executor/models/llama_eagle3.py Eagle3LlamaForCausalLM.load_weights."""
    if "t2d" in name:
        return None
    if "d2t" in name:
        return "draft_id_to_target_id"
    if "mask_hidden" in name:
        return "mask_hidden"
    name = name.replace("midlayer.", "layers.0.")
    return name if "lm_head" in name else "model." + name


def sglang_rename(name: str, n_layers: int, params: set) -> str | None:
    """python/sglang/srt/models/llama_eagle3.py LlamaForCausalLMEagle3.load_weights: a name that is
    not a parameter (after trying a "model." prefix) is skipped without a word."""
    if "d2t" in name:
        return "hot_token_id"
    if "t2d" in name:
        return None
    fused, _ = stack(name)
    return name if fused in params else "model." + name


def trtllm_rename(name: str, n_layers: int, params: set) -> str | None:
    """tensorrt_llm/_torch/models/modeling_speculative.py Eagle3ForCausalLM.load_weights (t2d has no
    module to load into)."""
    if name == "t2d":
        return None
    if n_layers == 1:
        name = re.sub(r"^layers\.0\.", "midlayer.", name)
    else:
        name = re.sub(r"^layers\.(\d+)\.", r"midlayer.\1.", name)
    return name if "lm_head" in name else "model." + name


@dataclass(frozen=True)
class Engine:
    name: str
    title: str
    layouts: tuple[str, ...]  # config layouts its loader understands
    rename: Callable[[str, int, set], str | None]
    layer_prefix: Callable[[int, int], str]  # parameter prefix of draft layer i of n
    top: dict  # head tensor name -> engine parameter (absent: the engine has none)
    unknown_tensors: str  # "crash" (the load fails) or "ignored"
    parallel_drafting: bool  # has P-EAGLE (all K drafts in one pass)


ENGINES = {
    "vllm": Engine(
        "vllm",
        "vLLM",
        ("eagle3", "speculators"),
        vllm_rename,
        lambda i, n: f"model.layers.{i}.",
        {
            "fc.weight": "model.fc.weight",
            "norm.weight": "model.norm.weight",
            "lm_head.weight": "lm_head.weight",
            "embed_tokens.weight": "model.embed_tokens.weight",
            "d2t": "draft_id_to_target_id",
            "mask_hidden": "mask_hidden",
        },
        "crash",
        True,
    ),
    "sglang": Engine(
        "sglang",
        "SGLang",
        ("eagle3",),
        sglang_rename,
        lambda i, n: "model.midlayer." if i == 0 else f"model.additional_layers.{i - 1}.",
        {
            "fc.weight": "model.fc.weight",
            "norm.weight": "model.norm.weight",
            "lm_head.weight": "lm_head.weight",
            "embed_tokens.weight": "model.embed_tokens.weight",
            "d2t": "hot_token_id",
        },
        "ignored",
        False,
    ),
    "trtllm": Engine(
        "trtllm",
        "TensorRT-LLM",
        ("eagle3",),
        trtllm_rename,
        lambda i, n: "model.midlayer." if n == 1 else f"model.midlayer.{i}.",
        {
            "fc.weight": "model.fc.weight",
            "norm.weight": "model.norm.weight",
            "lm_head.weight": "lm_head.weight",
            "embed_tokens.weight": "model.embed_tokens.weight",
            "d2t": "model.d2t",
        },
        "ignored",
        False,
    ),
}


def engine(name: str) -> Engine:
    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}; choose from {', '.join(ENGINES)} or all")
    return ENGINES[name]


# ---- the head as an engine sizes it --------------------------------------------------------------


def head_shapes(cfg: DraftConfig, parallel: bool) -> dict[str, tuple]:
    """Every tensor of the head (our names) with the shape config.json implies."""
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    shapes = {
        "fc.weight": (h, 3 * cfg.target_hidden_size),
        "norm.weight": (h,),
        "lm_head.weight": (cfg.draft_vocab_size, h),
        "d2t": (cfg.draft_vocab_size,),
        "t2d": (cfg.vocab_size,),
        "embed_tokens.weight": (cfg.vocab_size, h),
    }
    for layer in range(cfg.num_hidden_layers):
        p, width = ("midlayer.", 2 * h) if layer == 0 else (f"layers.{layer}.", h)
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (q, width),
                p + "self_attn.k_proj.weight": (kv, width),
                p + "self_attn.v_proj.weight": (kv, width),
                p + "self_attn.o_proj.weight": (h, q),
                p + "mlp.gate_proj.weight": (i, h),
                p + "mlp.up_proj.weight": (i, h),
                p + "mlp.down_proj.weight": (h, i),
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
            }
        )
        if layer == 0:
            shapes[p + "hidden_norm.weight"] = (h,)
    if parallel:
        shapes["mask_hidden"] = (1, 1, 3 * cfg.target_hidden_size)
    return shapes


def engine_param(eng: Engine, head_name: str, n_layers: int):
    """(engine parameter, shard) holding a head tensor, or None when the engine has no place for it."""
    m = re.match(r"^(midlayer|layers\.(\d+))\.(.*)$", head_name)
    if m:
        layer = int(m.group(2)) if m.group(2) else 0
        if eng.name == "sglang" and layer > 0 and m.group(3).startswith("input_layernorm"):
            return None  # SGLang's extra layers normalise with hidden_norm and have no input_layernorm
        return stack(eng.layer_prefix(layer, n_layers) + m.group(3))
    return (eng.top[head_name], None) if head_name in eng.top else None


# ---- the report ----------------------------------------------------------------------------------


@dataclass
class Finding:
    severity: str  # "error" | "warning" | "info"
    message: str
    cause: str = ""  # the likely cause in a few words, quoted when a live check fails


@dataclass
class EngineReport:
    engine: str
    layout: str
    loads: dict[str, list[str]] = field(default_factory=dict)  # engine parameter -> file tensors (shard order)
    ignored: list[str] = field(default_factory=list)  # file tensors and config keys the engine does not use
    filled: list[str] = field(default_factory=list)  # what the engine takes from the target or leaves at init
    context_length: int | None = None
    aux_layers: tuple[int, ...] | None = None  # HF output_hidden_states indices it would capture
    config: DraftConfig | None = None  # the head as the engine sizes it
    parallel: bool = False
    findings: list[Finding] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not any(f.severity == "error" for f in self.findings)

    def add(self, severity: str, message: str, cause: str = ""):
        self.findings.append(Finding(severity, message, cause))

    def render(self) -> str:
        lines = [f"== {ENGINES[self.engine].title} ({self.layout} layout): {'OK' if self.ok else 'PROBLEMS'}"]
        if self.loads:
            lines.append("  loads:")
            lines += [f"    {param} <- {' + '.join(files)}" for param, files in sorted(self.loads.items())]
        if self.filled:
            lines.append("  fills: " + "; ".join(self.filled))
        if self.ignored:
            lines.append("  ignores: " + ", ".join(self.ignored))
        lines.append(f"  drafts up to: {self.context_length if self.context_length else 'unknown'} tokens")
        lines.append(
            "  captures target layers (HF hidden_states indices): "
            + (str(list(self.aux_layers)) if self.aux_layers else "the target's defaults (2, N//2, N-3)")
        )
        lines += [f"  {f.severity.upper()}: {f.message}" for f in self.findings]
        return "\n".join(lines)


def llama_part(config: dict, layout_name: str) -> dict:
    return config.get("transformer_layer_config") or {} if layout_name == "speculators" else config


def is_parallel(config: dict, meta: dict) -> bool:
    """A P-EAGLE directory: a mask token id, a mask_hidden tensor, or more than one draft layer."""
    layer = config.get("transformer_layer_config") or {}
    return (
        bool(mask_token_ids(config))
        or "mask_hidden" in meta
        or config.get("speculators_model_type") == "peagle"
        or max(config.get("num_hidden_layers", 1), layer.get("num_hidden_layers", 1)) > 1
    )


def intended_aux(config: dict, n_layers: int | None) -> tuple[int, ...] | None:
    """The aux layers the head was trained on, HF indices: our provenance, else the config's own
    statement (vLLM key first, SGLang's nested key + 1), else the target's defaults."""
    ours = (config.get(PROVENANCE_KEY) or {}).get("aux_layer_ids")
    if ours:
        return tuple(ours)
    if config.get("eagle_aux_hidden_state_layer_ids"):
        return tuple(config["eagle_aux_hidden_state_layer_ids"])
    nested = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if nested:
        return tuple(i + 1 for i in nested)
    return default_aux_layer_ids(n_layers) if n_layers else None


def captured_aux(eng: Engine, config: dict, n_layers: int | None) -> tuple[int, ...] | None:
    defaults = default_aux_layer_ids(n_layers) if n_layers else None
    nested = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if eng.name == "vllm":  # top-level key, else (recent versions) the nested one as is
        ids = config.get("eagle_aux_hidden_state_layer_ids") or nested
        return tuple(ids) if ids else defaults
    if eng.name == "sglang":  # nested key only, each id + 1
        return tuple(i + 1 for i in nested) if nested else defaults
    return defaults  # TensorRT-LLM: only its eagle3_layers_to_capture option, never config.json


def inspect_engine(name: str, files: DraftFiles, target_config=None) -> EngineReport:
    """What engine `name` would do with the directory in `files` (no weights are read but d2t)."""
    eng = engine(name)
    config, meta = files.config, files.meta
    try:
        lay = detect_layout(config)
    except ValueError as e:
        report = EngineReport(name, "unknown")
        report.add("error", str(e))
        return report
    report = EngineReport(name, lay.name)
    if lay.name not in eng.layouts:
        report.add(
            "error",
            f"{eng.title} does not read the {lay.name} layout (its Llama keys sit under "
            "transformer_layer_config); export with --format eagle3 for it",
        )
        return report
    if target_config is not None:
        target_config = getattr(target_config, "text_config", None) or target_config
    n_target = (config.get(PROVENANCE_KEY) or {}).get("target_num_layers") or (
        target_config.num_hidden_layers if target_config is not None else None
    )
    llama = llama_part(config, lay.name)
    parallel = report.parallel = is_parallel(config, meta)

    # How the engine reads config.json (absent keys take Llama defaults, as in the engines).
    report.aux_layers = captured_aux(eng, config, n_target)
    try:  # unknown aux ids stay (0, 0, 0) in this config: the draft's forward does not read them
        cfg = draft_config_from_llama(llama, config, aux_layer_ids=report.aux_layers or (0, 0, 0))
    except ValueError as e:
        report.add("error", str(e))
        return report
    if parallel:  # a P-EAGLE head: the mask token from config.json, K from our provenance (if any)
        ids = list(mask_token_ids(config).values())
        cfg.method, cfg.mask_token_id = "peagle", (int(ids[0]) if ids else None)
        cfg.num_depths = (config.get(PROVENANCE_KEY) or {}).get("num_depths")
    report.config = cfg
    if parallel and not eng.parallel_drafting:
        report.add(
            "error",
            f"P-EAGLE (parallel drafting) head: {eng.title}'s EAGLE-3 path drafts one token per "
            "pass and has no mask_hidden / mask token; serve it with vLLM",
        )
    check_config_keys(report, eng, files, llama, lay.name, cfg)
    check_weights(report, eng, files, cfg, parallel)
    check_vocab_map(report, eng, files, cfg)
    check_target(report, eng, llama, cfg, target_config)
    intended = intended_aux(config, n_target)
    if intended and report.aux_layers and tuple(report.aux_layers) != tuple(intended):
        fix = {
            "vllm": f'write "eagle_aux_hidden_state_layer_ids": {list(intended)} in config.json',
            "sglang": 'write "eagle_config": {"eagle_aux_hidden_state_layer_ids": '
            f"{[i - 1 for i in intended]}}} in config.json (SGLang adds one)",
            "trtllm": "pass speculative_config eagle3_layers_to_capture: "
            f"{sorted(i - 1 for i in intended)} (TensorRT-LLM does not read config.json for this)",
        }
        report.add(
            "error",
            f"{eng.title} would capture target layers {list(report.aux_layers)} but the head was "
            f"trained on {list(intended)}: {fix[name]}",
            cause=f"wrong extract layers ({list(report.aux_layers)} instead of {list(intended)})",
        )
    elif intended is None:
        report.add(
            "info",
            "the target's layer count is unknown here (pass --target) so the default aux layers cannot be compared",
        )
    if parallel and eng.parallel_drafting:
        check_parallel(report, files, cfg)
    return report


def check_config_keys(report, eng, files, llama, layout_name, cfg):
    name, config = eng.name, files.config
    known = (
        "eagle_aux_hidden_state_layer_ids",
        "eagle_config",
        "norm_before_residual",
        PROVENANCE_KEY,
        "speculators_config",
        "rope_parameters",
        *MASK_TOKEN_KEYS,
    )
    reads = {
        "vllm": {
            "eagle_aux_hidden_state_layer_ids",
            "eagle_config",
            "norm_before_residual",
            "speculators_config",
            *MASK_TOKEN_KEYS,
        },
        "sglang": {"eagle_config"},
        "trtllm": {"eagle_config"},
    }[name]
    if name == "vllm" and config.get("eagle_aux_hidden_state_layer_ids"):
        reads = reads - {"eagle_config"}
    report.ignored += [f"config:{k}" for k in known if (k in config or k in llama) and k not in reads]
    if "draft_vocab_size" not in config:
        if name == "sglang":
            report.add(
                "error",
                "no draft_vocab_size: SGLang then fails to build the head or, with it null, loads "
                "the target's lm_head over the draft's (load_lm_head_from_target); write "
                "draft_vocab_size even when it equals vocab_size",
            )
        else:
            report.add("warning", f"no draft_vocab_size: {eng.title} assumes the full vocabulary ({cfg.vocab_size})")
    if "rope_theta" not in llama:
        hint = " (it holds only rope_parameters, which the engines do not read)" if "rope_parameters" in llama else ""
        report.add("error", f"no rope_theta{hint}: {eng.title} uses RoPE base 10000; write the target's rope_theta")
    if "rms_norm_eps" not in llama:
        report.add("warning", f"no rms_norm_eps: {eng.title} uses 1e-6; write the eps the head was trained with")
    if "max_position_embeddings" not in llama:
        report.add("error", f"no max_position_embeddings: {eng.title} sizes the draft's RoPE for 2048 tokens")
    report.context_length = cfg.max_position_embeddings
    norm_first = config.get("norm_before_residual")
    if name == "vllm" and config.get("speculators_model_type") == "eagle3" and norm_first is None:
        report.add(
            "error",
            "norm_before_residual unset: vLLM takes true for speculators eagle3 configs, the "
            "speculators library false; write it explicitly (eagle-train heads: false)",
        )
    elif name == "vllm" and norm_first:
        report.add("info", "norm_before_residual true: vLLM normalises the hidden input before the residual")
    elif norm_first:
        report.add(
            "error",
            f"norm_before_residual true: {eng.title} ignores the key and keeps the un-normed "
            "residual, so this head's outputs would silently differ; serve it with vLLM",
        )
    if layout_name == "speculators" and name == "vllm":
        verifier = ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
        if not verifier or verifier in HUB_IDS:
            report.add(
                "error",
                f"speculators_config.verifier.name_or_path is {verifier!r}: `vllm serve DIR` cannot "
                "load the target from it; write its hub id or path (eagle-export --verifier)",
            )
    if llama.get("tie_word_embeddings"):
        sev = "warning" if name == "vllm" else "error"
        report.add(
            sev, f"tie_word_embeddings true: {eng.title} may tie the draft lm_head to the embedding; write false"
        )
    if llama.get("attention_bias") and not any(k.endswith("q_proj.bias") for k in files.meta):
        report.add("error", "attention_bias true but no q/k/v bias tensors: the biases would stay at init")


def check_weights(report, eng, files, cfg, parallel):
    """Renames, fusions, shapes, and what the engine has no tensor for."""
    meta = files.meta
    n = cfg.num_hidden_layers
    expected = head_shapes(cfg, parallel)
    needed: dict[tuple, tuple] = {}  # (param, shard) -> (head name, shape)
    for head_name, shape in expected.items():
        where = engine_param(eng, head_name, n)
        if where is not None:
            needed[where] = (head_name, shape)
    if eng.name == "trtllm" and cfg.draft_vocab_size == cfg.vocab_size:
        needed.pop(("model.d2t", None), None)  # TensorRT-LLM only has d2t for a reduced vocabulary
    own_embed = cfg.target_hidden_size != cfg.hidden_size  # then no engine can share the target's
    embed_param = eng.top["embed_tokens.weight"]
    if not own_embed and (eng.name != "vllm" or "embed_tokens.weight" not in meta):
        needed.pop((embed_param, None))  # vLLM uses a file's own embedding; the others always the target's
        report.filled.append(f"{embed_param} <- the target's embedding")
        if eng.name == "sglang" and "embed_tokens.weight" in meta:
            report.add(
                "error" if parallel else "info",
                "SGLang replaces the draft's embed_tokens with the "
                "target's (set_embed)" + (": the trained mask-token row is lost" if parallel else ""),
            )
    params = {p for p, _ in needed}
    loaded: dict[tuple, str] = {}
    for file_name, (shape, _, _) in sorted(meta.items()):
        param = eng.rename(file_name, n, params)
        if param is None:
            report.ignored.append(file_name)
            continue
        where = stack(param)
        if where not in needed:
            if eng.unknown_tensors == "crash":
                report.add("error", f"{file_name} -> {where[0]} is not a {eng.title} parameter: loading fails")
            elif file_name in ("mask_hidden", "embed_tokens.weight"):
                report.ignored.append(file_name)
            else:
                report.add("warning", f"{file_name} -> {where[0]}: {eng.title} has no such parameter and skips it")
                report.ignored.append(file_name)
            continue
        head_name, want = needed[where]
        if tuple(shape) != tuple(want) and not (
            head_name == "mask_hidden" and torch.Size(shape).numel() == torch.Size(want).numel()
        ):
            report.add(
                "error",
                f"{file_name} has shape {list(shape)} but config.json implies {list(want)} "
                f"(hidden_size {cfg.hidden_size}, heads {cfg.num_attention_heads}/"
                f"{cfg.num_key_value_heads}, head_dim {cfg.head_dim}, intermediate "
                f"{cfg.intermediate_size}, target_hidden_size {cfg.target_hidden_size}, "
                f"draft_vocab_size {cfg.draft_vocab_size}): config.json and the weights disagree",
            )
        loaded[where] = file_name
    for param, shard in sorted(loaded, key=lambda w: (w[0], SHARD_ORDER.get(w[1], 0))):
        report.loads.setdefault(param, []).append(loaded[(param, shard)])
    for where, (head_name, _) in sorted(needed.items(), key=lambda kv: str(kv[0])):
        if where in loaded:
            continue
        param = where[0]
        if head_name == "embed_tokens.weight":
            report.add(
                "error",
                f"target_hidden_size {cfg.target_hidden_size} differs from hidden_size "
                f"{cfg.hidden_size} but there is no embed_tokens.weight: {eng.title} keeps a "
                "randomly initialised embedding",
            )
        elif head_name == "d2t":
            if cfg.draft_vocab_size < cfg.vocab_size:
                what = {
                    "vllm": "zero offsets, so draft id i is read as target id i",
                    "sglang": "no hot-token map, so draft ids are used as target ids",
                    "trtllm": "an uninitialised int32 buffer",
                }[eng.name]
                report.add(
                    "error",
                    f"no d2t with a reduced draft vocabulary ({cfg.draft_vocab_size} < "
                    f"{cfg.vocab_size}): {eng.title} uses {what}; every draft token maps to a "
                    "wrong target token",
                )
            else:
                report.filled.append(f"{param} <- identity (full vocabulary)")
        elif head_name == "lm_head.weight":
            report.add("error", f"no lm_head.weight: {eng.title} would use the target's lm_head or leave it random")
        elif head_name != "mask_hidden":  # check_parallel names that one
            report.add(
                "error",
                f"no tensor for {param} (expected {head_name}): {eng.title} leaves it at its random initialisation",
            )
    report.filled.sort()


def check_vocab_map(report, eng, files, cfg):
    meta = files.meta
    if "d2t" in meta:
        _, dtype, _ = meta["d2t"]
        if not isinstance(dtype, torch.dtype) or dtype.is_floating_point:
            report.add(
                "error",
                f"d2t is {dtype}, not int64: float offsets lose ids (bf16 holds integers exactly "
                f"only up to 256){', and SGLang indexes with floats' if eng.name == 'sglang' else ''}; "
                "re-export keeping d2t int64",
            )
        elif dtype != torch.int64:
            report.add(
                "warning", f"d2t is {dtype}; the reference layout stores int64 offsets ({eng.title} casts it on load)"
            )
        else:
            d2t = files.tensor("d2t")
            target_ids = torch.arange(len(d2t)) + d2t
            if len(d2t) and (target_ids.min() < 0 or target_ids.max() >= cfg.vocab_size):
                report.add("error", f"d2t maps draft ids outside the target vocabulary [0, {cfg.vocab_size})")
            elif target_ids.unique().numel() != target_ids.numel():
                report.add("error", "d2t maps two draft ids to the same target id")
    if "t2d" in meta and meta["t2d"][1] != torch.bool:
        report.add("warning", f"t2d is {meta['t2d'][1]}; the reference layout stores bool (engines skip t2d)")


def check_target(report, eng, llama, cfg, target_config):
    if target_config is None:
        report.add("info", "no --target given: context length, RoPE and sizes not compared with the target")
        return
    target_ctx = getattr(target_config, "max_position_embeddings", None)
    if target_ctx and cfg.max_position_embeddings < target_ctx:
        effect = {
            "vllm": f"vLLM caps the draft at {cfg.max_position_embeddings} tokens (max_model_len = "
            "min(draft, target)), so longer requests lose speculation or the server its context",
            "sglang": "SGLang refuses the longer context unless SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1, "
            "then indexes past the draft's RoPE cache",
            "trtllm": "TensorRT-LLM sizes the draft's RoPE table for it",
        }[eng.name]
        report.add(
            "error",
            f"max_position_embeddings {cfg.max_position_embeddings} < the target's {target_ctx}: "
            f"{effect}; write at least {target_ctx}",
        )
        if eng.name == "vllm":
            report.context_length = min(cfg.max_position_embeddings, target_ctx)
    theta, scaling = target_rope(target_config)
    if abs(cfg.rope_theta - theta) > 1e-6 * theta or plain_scaling(cfg.rope_scaling) != plain_scaling(scaling):
        report.add(
            "error",
            f"RoPE as {eng.title} reads it (rope_theta {cfg.rope_theta}, rope_scaling "
            f"{cfg.rope_scaling}) differs from the target's (rope_theta {theta}, rope_scaling "
            f"{scaling}): draft positions would be rotated wrongly",
            cause=f"a wrong RoPE base ({cfg.rope_theta:g} instead of {theta:g})"
            if plain_scaling(cfg.rope_scaling) == plain_scaling(scaling)
            else "a wrong RoPE scaling",
        )
    t_hidden = target_config.hidden_size
    if cfg.target_hidden_size != t_hidden:
        report.add(
            "error", f"the head reads target hidden states of width {cfg.target_hidden_size}, the target has {t_hidden}"
        )
    if cfg.vocab_size != target_config.vocab_size:
        report.add("error", f"vocab_size {cfg.vocab_size} is not the target's {target_config.vocab_size}")


def plain_scaling(scaling: dict | None) -> dict | None:
    return {k: v for k, v in scaling.items() if k != "type"} if scaling else None


def check_parallel(report, files, cfg):
    """vLLM's P-EAGLE (parallel_drafting) rules, docs/design.md section 6."""
    config, meta = files.config, files.meta
    if "mask_hidden" not in meta:
        report.add(
            "error",
            "P-EAGLE export without mask_hidden: vLLM with parallel_drafting stops with "
            "'mask_hidden not found in weights'; export the trained [1, 1, 3H] mask_hidden",
        )
    elif torch.Size(meta["mask_hidden"][0]).numel() != 3 * cfg.target_hidden_size:
        report.add(
            "error",
            f"mask_hidden has shape {list(meta['mask_hidden'][0])}, vLLM needs "
            f"3 x target hidden = {3 * cfg.target_hidden_size} values",
        )
    ids = mask_token_ids(config)
    if config.get("speculators_model_type") == "peagle":  # vLLM's update_peagle: pard_token = mask_token_id
        if "mask_token_id" not in config:
            report.add(
                "error",
                "speculators P-EAGLE config without mask_token_id: vLLM's speculators reader "
                "needs it (it becomes pard_token)",
            )
    elif not ids:
        report.add(
            "error",
            "P-EAGLE export without a mask token id: write ptd_token_id, pard_token and "
            "mask_token_id (vLLM versions read different ones)",
        )
    else:
        if len(set(ids.values())) > 1:
            report.add("error", f"mask token ids disagree: {ids}")
        missing = [k for k in MASK_TOKEN_KEYS if k not in ids]
        if missing:
            report.add("warning", f"mask token id not written as {missing}: some vLLM versions read only those")
    if "embed_tokens.weight" not in meta:
        report.add(
            "error",
            "P-EAGLE export without embed_tokens.weight: vLLM falls back to the target's embedding, "
            "whose mask-token row was never trained",
        )
    report.add(
        "info",
        "vLLM drafts all K tokens in one pass only with --speculative-config "
        '\'{"method": "eagle3", "parallel_drafting": true, ...}\'',
    )


# ---- the tensors an engine would hold, and a head built back from them ---------------------------


def engine_state(report: EngineReport, files: DraftFiles) -> dict[str, torch.Tensor]:
    """The engine's parameters as it would load them: renamed, q/k/v and gate/up fused in its shard
    order, the vocab map in its own form (vLLM offsets int64, SGLang target ids, TRT-LLM int32)."""
    state = {}
    for param, names in report.loads.items():
        tensors = [files.tensor(n) for n in names]
        t = torch.cat(tensors, dim=0) if len(tensors) > 1 else tensors[0]
        if param == "hot_token_id":
            t = t + torch.arange(t.shape[0])
        elif param == "model.d2t":
            t = t.to(torch.int32)
        elif param == "mask_hidden":
            t = t.view(1, -1)
        state[param] = t
    return state


def head_from_engine_state(report: EngineReport, state: dict[str, torch.Tensor], embedding: torch.Tensor = None):
    """Split the engine's tensors back into a head (fp32) sized the way the engine read config.json.
    `embedding` is what the engine fills from the target (the target's input embedding)."""
    cfg = report.config
    eng = ENGINES[report.engine]
    sizes = {
        "qkv_proj": [cfg.num_attention_heads * cfg.head_dim] + [cfg.num_key_value_heads * cfg.head_dim] * 2,
        "gate_up_proj": [cfg.intermediate_size] * 2,
    }
    head_state = {}
    for head_name, shape in head_shapes(cfg, report.parallel).items():
        where = engine_param(eng, head_name, cfg.num_hidden_layers)
        if where is None or where[0] not in state:
            continue
        param, shard = where
        t = state[param]
        if shard is not None:
            kind = "qkv_proj" if ".qkv_proj." in param else "gate_up_proj"
            t = torch.split(t, sizes[kind], dim=0)[SHARD_ORDER[shard]]
        if head_name == "d2t":
            t = t.long() - torch.arange(t.shape[0]) if param == "hot_token_id" else t.long()
        if head_name == "mask_hidden":
            t = t.reshape(shape)
        head_state[head_name] = t.float() if t.is_floating_point() else t
    head = HEAD_CLASSES[cfg.method](cfg)
    if "d2t" not in head_state:  # the engine's identity map
        head_state["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
    head_state["t2d"] = t2d_from_d2t(head_state["d2t"], cfg.vocab_size)  # engines drop t2d; it follows from d2t
    saved = head.saved_state_dict()
    own = head_state.pop("embed_tokens.weight", None) if "embed_tokens.weight" not in saved else None
    head.load_state_dict(head_state, strict=False)
    missing = set(saved) - set(head_state)
    if missing:
        raise ValueError(f"{ENGINES[report.engine].title} would hold no tensor for {sorted(missing)}")
    if "embed_tokens.weight" in saved:
        return head
    weight = own if own is not None else embedding
    if weight is None:
        raise ValueError("the engine takes the embedding from the target: pass the target's embedding")
    head.embed_tokens.weight.data = weight.float()
    return head
