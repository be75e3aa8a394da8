"""What a serving engine would do with a draft directory: the rule check all directory engines share.

Each engine's module (engines/vllm.py, sglang.py, trtllm.py) restates what its own loader does
(read from its source, see docs/deploying.md for the files): how it renames the file's tensors,
which ones it fuses, skips or fills from the target, what it reads from config.json and what it
assumes when a key is absent, how long a context it drafts to and which target layers it captures.
`inspect` applies an engine's rules to a directory without loading weights; `engine_state`
produces the tensors the engine would hold (fused, renamed, with its own vocab-map form) and
`head_from_engine_state` builds a head back from them, so a test can show an export gives the
engine the trained head's logits.

Severities: "error" = the engine would fail to load, or load and silently draft worse or wrong
(`eagle-export --check` exits non-zero); "warning" = off the reference format but harmless to
this engine; "info" = what the engine does, for the reader.
"""

from dataclasses import dataclass, field

import torch

from eagle_train.checkpoint import head_from_state
from eagle_train.draft_config import DraftConfig, head_rope, target_rope
from eagle_train.export.draft_files import DraftFiles
from eagle_train.export.layouts import (
    MASK_TOKEN_KEYS,
    PROVENANCE_KEY,
    detect_layout,
    draft_config_from_llama,
    is_block,
    mask_token_ids,
    speculators_method,
)
from eagle_train.hidden_states import engine_aux_layer_ids
from eagle_train.methods import family_of, method_with, row

STACKED = (
    (".q_proj.", ".qkv_proj.", "q"),
    (".k_proj.", ".qkv_proj.", "k"),
    (".v_proj.", ".qkv_proj.", "v"),
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
)
SHARD_ORDER = {"q": 0, "k": 1, "v": 2, 0: 0, 1: 1}
LLAMA_EAGLE3_TOP = {  # where every engine's Llama EAGLE-3 module keeps the head's tensors outside its layers
    "fc.weight": "model.fc.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
    "embed_tokens.weight": "model.embed_tokens.weight",
}
# Config keys some engine reads besides the Llama ones; an engine that does not read one ignores it.
ENGINE_KEYS = (
    "eagle_aux_hidden_state_layer_ids",
    "eagle_config",
    "norm_before_residual",
    PROVENANCE_KEY,
    "speculators_config",
    "rope_parameters",
    *MASK_TOKEN_KEYS,
)


# ---- what the engines' loaders share -------------------------------------------------------------


def stack(name: str):
    """(fused parameter name, shard) the way all three engines fuse q/k/v and gate/up."""
    for part, fused, shard in STACKED:
        if part in name:
            return name.replace(part, fused), shard
    return name, None


# ---- the head as an engine sizes it --------------------------------------------------------------


def head_shapes(cfg: DraftConfig, parallel: bool) -> dict[str, tuple]:
    """Every tensor of the head (our names) with the shape config.json implies."""
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    shapes = {
        "fc.weight": (h, cfg.num_aux * cfg.target_hidden_size),
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
    loader: object = field(default=None, repr=False, compare=False)  # the Engine whose rules made it
    loads: dict[str, list[str]] = field(default_factory=dict)  # engine parameter -> file tensors (shard order)
    ignored: list[str] = field(default_factory=list)  # file tensors and config keys the engine does not use
    filled: list[str] = field(default_factory=list)  # what the engine takes from the target or leaves at init
    context_length: int | None = None
    aux_layers: tuple[int, ...] | None = None  # HF output_hidden_states indices it would capture
    config: DraftConfig | None = None  # the head as the engine sizes it
    parallel: bool = False
    findings: list[Finding] = field(default_factory=list)
    reads_target_states: bool = True  # a head reads the target's layers; a draft model only the tokens

    @property
    def ok(self) -> bool:
        return not any(f.severity == "error" for f in self.findings)

    def add(self, severity: str, message: str, cause: str = ""):
        self.findings.append(Finding(severity, message, cause))

    def render(self) -> str:
        lines = [f"== {self.loader.title} ({self.layout} layout): {'OK' if self.ok else 'PROBLEMS'}"]
        if self.loads:
            lines.append("  loads:")
            lines += [f"    {param} <- {' + '.join(files)}" for param, files in sorted(self.loads.items())]
        if self.filled:
            lines.append("  fills: " + "; ".join(self.filled))
        if self.ignored:
            lines.append("  ignores: " + ", ".join(self.ignored))
        lines.append(f"  drafts up to: {self.context_length if self.context_length else 'unknown'} tokens")
        if self.reads_target_states:
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
    if is_block(config):  # a DFlash / DSpark head has a mask token too, but drafts a block (engines/block_rules.py)
        return False
    return (
        bool(mask_token_ids(config))
        or "mask_hidden" in meta
        or family_of(speculators_method(config)) == "parallel"
        or max(config.get("num_hidden_layers", 1), layer.get("num_hidden_layers", 1)) > 1
    )


def intended_aux(config: dict, n_layers: int | None) -> tuple[int, ...] | None:
    """The aux layers the head was trained on, HF indices: our provenance, else the config's own
    statement (vLLM key first, SGLang's nested key + 1), else what the engines capture unasked."""
    ours = (config.get(PROVENANCE_KEY) or {}).get("aux_layer_ids")
    if ours:
        return tuple(ours)
    if config.get("eagle_aux_hidden_state_layer_ids"):
        return tuple(config["eagle_aux_hidden_state_layer_ids"])
    nested = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if nested:
        return tuple(i + 1 for i in nested)
    return engine_aux_layer_ids(n_layers) if n_layers else None


def inspect(eng, files: DraftFiles, target_config=None) -> EngineReport:
    """What engine `eng` would do with the directory in `files` (no weights are read but d2t)."""
    config, meta = files.config, files.meta
    try:
        lay = detect_layout(config)
    except ValueError as e:
        report = EngineReport(eng.name, "unknown", eng)
        report.add("error", str(e))
        return report
    report = EngineReport(eng.name, lay.name, eng)
    if is_block(config):  # engines with a block loader check these themselves (engines/block_rules.py for vLLM)
        report.add("error", f"{eng.title} has no DFlash / DSpark loader that eagle-export checks; serve it with vLLM")
        return report
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
    report.aux_layers = eng.captured_aux(config, n_target)
    try:  # unknown aux ids stay (0, 0, 0) in this config: the draft's forward does not read them
        cfg = draft_config_from_llama(llama, config, aux_layer_ids=report.aux_layers or (0, 0, 0))
    except ValueError as e:
        report.add("error", str(e))
        return report
    if parallel:  # a P-EAGLE head: the mask token from config.json, K from our provenance (if any)
        ids = list(mask_token_ids(config).values())
        cfg.method, cfg.mask_token_id = method_with(layout="peagle"), (int(ids[0]) if ids else None)
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
        report.add(
            "error",
            f"{eng.title} would capture target layers {list(report.aux_layers)} but the head was "
            f"trained on {list(intended)}: {eng.aux_fix(intended)}",
            cause=f"wrong extract layers ({list(report.aux_layers)} instead of {list(intended)})",
        )
    elif intended is None:
        report.add(
            "info",
            "the target's layer count is unknown here (pass --target) so the default aux layers cannot be compared",
        )
    if parallel and eng.parallel_drafting:
        eng.check_parallel(report, files, cfg)
    return report


def check_config_keys(report, eng, files, llama, layout_name, cfg):
    config = files.config
    reads = eng.config_keys_read(config)
    report.ignored += [f"config:{k}" for k in ENGINE_KEYS if (k in config or k in llama) and k not in reads]
    if "draft_vocab_size" not in config:
        eng.no_draft_vocab_size(report, cfg)
    if "rope_theta" not in llama:
        hint = " (it holds only rope_parameters, which the engines do not read)" if "rope_parameters" in llama else ""
        report.add("error", f"no rope_theta{hint}: {eng.title} uses RoPE base 10000; write the target's rope_theta")
    if "rms_norm_eps" not in llama:
        report.add("warning", f"no rms_norm_eps: {eng.title} uses 1e-6; write the eps the head was trained with")
    if "max_position_embeddings" not in llama:
        report.add("error", f"no max_position_embeddings: {eng.title} sizes the draft's RoPE for 2048 tokens")
    report.context_length = cfg.max_position_embeddings
    eng.check_norm_before_residual(report, config)
    eng.check_layout_keys(report, config, layout_name)
    if llama.get("tie_word_embeddings"):
        report.add(
            eng.tied_embedding_severity,
            f"tie_word_embeddings true: {eng.title} may tie the draft lm_head to the embedding; write false",
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
        where = eng.engine_param(head_name, n)
        if where is not None:
            needed[where] = (head_name, shape)
    if eng.d2t_only_when_reduced and cfg.draft_vocab_size == cfg.vocab_size:
        needed.pop((eng.top["d2t"], None), None)
    own_embed = cfg.target_hidden_size != cfg.hidden_size  # then no engine can share the target's
    embed_param = eng.top["embed_tokens.weight"]
    if not own_embed and not (eng.loads_file_embedding and "embed_tokens.weight" in meta):
        needed.pop((embed_param, None))
        report.filled.append(f"{embed_param} <- the target's embedding")
        if "embed_tokens.weight" in meta:
            eng.file_embedding_replaced(report, parallel)
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
                report.add(
                    "error",
                    f"no d2t with a reduced draft vocabulary ({cfg.draft_vocab_size} < "
                    f"{cfg.vocab_size}): {eng.title} uses {eng.without_d2t}; every draft token maps to a "
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
                f"only up to 256){eng.float_d2t_effect}; "
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
    eng.check_target_architecture(report, target_config)
    target_ctx = getattr(target_config, "max_position_embeddings", None)
    if target_ctx and cfg.max_position_embeddings < target_ctx:
        report.add(
            "error",
            f"max_position_embeddings {cfg.max_position_embeddings} < the target's {target_ctx}: "
            f"{eng.short_context_effect(cfg.max_position_embeddings)}; write at least {target_ctx}",
        )
        if eng.caps_context_at_draft:
            report.context_length = min(cfg.max_position_embeddings, target_ctx)
    # a head uses the target's RoPE, or the plain RoPE eagle-train trains for a type its heads do not implement
    theta, scaling = target_rope(target_config)
    as_trained = [(theta, scaling), head_rope(target_config)]
    read = plain_scaling(cfg.rope_scaling)
    if not any(abs(cfg.rope_theta - t) <= 1e-6 * t and read == plain_scaling(s) for t, s in as_trained):
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
    eng = report.loader
    sizes = {
        "qkv_proj": [cfg.num_attention_heads * cfg.head_dim] + [cfg.num_key_value_heads * cfg.head_dim] * 2,
        "gate_up_proj": [cfg.intermediate_size] * 2,
    }
    head_state = {}
    for head_name, shape in head_shapes(cfg, report.parallel).items():
        where = eng.engine_param(head_name, cfg.num_hidden_layers)
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
    if "d2t" not in head_state:  # the engine's identity map
        head_state["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
    borrows = not row(cfg.method).head_class.owns_embedding and "embed_tokens.weight" not in head_state
    if borrows and embedding is None:
        raise ValueError("the engine takes the embedding from the target: pass the target's embedding")
    return head_from_state(cfg, head_state, embedding, source=eng.title)
