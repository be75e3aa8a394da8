"""The llama.cpp draft-head GGUF: the one place that knows that format.

llama.cpp (`--spec-type draft-eagle3`) loads an EAGLE-3 head as a model of its own, architecture
"eagle3": Llama keys under `eagle3.*`, the head's tensors under llama.cpp names, the target's
tokenizer copied in, and d2t as absolute target ids (docs/design.md section 6.6). PyPI gguf
does not know the architecture yet, so its own keys are spelled out here. llama.cpp checks every
key's type exactly and refuses a file holding a tensor it did not ask for, so nothing else is written.

    export_gguf(head, "head.gguf", "target.gguf", outtype="q8_0")
    cfg, tensors = read_gguf_head("head.gguf", target_config)  # the inverse (eagle_train.checkpoint.load_draft_head)
"""

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import (
    GGML_QUANT_SIZES,
    GGMLQuantizationType,
    GGUFReader,
    GGUFValueType,
    GGUFWriter,
    LlamaFileType,
    RopeScalingType,
)
from gguf.quants import dequantize, quantize

from eagle_train.draft_config import DraftConfig
from eagle_train.export import check_vocab_map
from eagle_train.layers import rope_inv_freq
from eagle_train.target import target_gguf
from eagle_train.unreadable import HEAD_FIX, open_gguf

ARCH = "eagle3"
# The head's matmul weights under llama.cpp's names; they take the export type.
MATMUL_TENSORS = {
    "fc.weight": "fc.weight",
    "midlayer.self_attn.q_proj.weight": "blk.0.attn_q.weight",
    "midlayer.self_attn.k_proj.weight": "blk.0.attn_k.weight",
    "midlayer.self_attn.v_proj.weight": "blk.0.attn_v.weight",
    "midlayer.self_attn.o_proj.weight": "blk.0.attn_output.weight",
    "midlayer.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
    "midlayer.mlp.up_proj.weight": "blk.0.ffn_up.weight",
    "midlayer.mlp.down_proj.weight": "blk.0.ffn_down.weight",
    "lm_head.weight": "output.weight",  # over the draft vocabulary
}
# The norms, always f32 (as llama.cpp's converter writes them).
NORM_TENSORS = {
    "midlayer.input_layernorm.weight": "blk.0.attn_norm.weight",  # applied to the token embedding
    "midlayer.hidden_norm.weight": "blk.0.attn_norm_2.weight",  # applied to fc's output
    "midlayer.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    "norm.weight": "output_norm.weight",
}
# d2t is written as absolute ids (I64); t2d follows from it and llama.cpp has no slot for it.
HEAD_TENSORS = {*MATMUL_TENSORS, *NORM_TENSORS, "d2t", "t2d"}
# A head with an embedding of its own writes it; without one llama.cpp uses the target's.
EMBEDDING = ("embed_tokens.weight", "token_embd.weight")
OUTTYPES = {
    "f32": (GGMLQuantizationType.F32, LlamaFileType.ALL_F32),
    "f16": (GGMLQuantizationType.F16, LlamaFileType.MOSTLY_F16),
    "q8_0": (GGMLQuantizationType.Q8_0, LlamaFileType.MOSTLY_Q8_0),
}
# Array item types GGUFWriter infers from Python values (gguf 0.13 cannot be told one).
COPYABLE_ITEM_TYPES = (GGUFValueType.STRING, GGUFValueType.FLOAT32, GGUFValueType.INT32, GGUFValueType.BOOL)


def field_value(field):
    """A GGUFReader field's value as Python: strings as their bytes (copied unchanged), numbers as
    int/float/bool, arrays as lists. (gguf 0.13's reader has no ReaderField.contents.)"""
    string = field.types[-1] == GGUFValueType.STRING
    values = [bytes(field.parts[i]) if string else field.parts[i].tolist()[0] for i in field.data]
    return values if field.types[0] == GGUFValueType.ARRAY else values[0]


def read_target(target) -> GGUFReader:
    """The target's GGUF: it lends the head its tokenizer (llama.cpp requires one)."""
    path = target_gguf(target)
    if path is None:
        raise ValueError(
            f"the gguf export needs the target as a GGUF file (--target TARGET.gguf), not {target!r}: "
            "llama.cpp serves the target from one and the head copies its tokenizer"
        )
    return open_gguf(path, "target GGUF", "re-download it")


def check_head(head, target: GGUFReader) -> None:
    """Refuse heads llama.cpp's eagle3 model cannot hold, or that were trained for another target."""
    cfg = head.config
    if cfg.method != "eagle3":
        raise ValueError(
            f"a {cfg.method} head cannot be written as a llama.cpp GGUF: llama.cpp drafts with "
            "EAGLE-3 heads only (serve P-EAGLE heads with vLLM: --format peagle or speculators)"
        )
    names = set(head.saved_state_dict()) - {EMBEDDING[0]}
    if names != HEAD_TENSORS:
        raise ValueError(
            f"llama.cpp's eagle3 model has no place for the head's tensors {sorted(names - HEAD_TENSORS)} "
            f"and needs {sorted(HEAD_TENSORS - names)}"
        )
    arch = field_value(target.fields["general.architecture"]).decode()
    width = field_value(target.fields[f"{arch}.embedding_length"])
    for what, size in (("target_hidden_size", cfg.target_hidden_size), ("hidden_size", cfg.hidden_size)):
        if size != width:
            raise ValueError(
                f"the head's {what} is {size} but the target GGUF's embedding_length is {width}: "
                "the head was trained for another target"
            )
    if "tokenizer.ggml.tokens" not in target.fields:
        raise ValueError("the target GGUF has no tokenizer (tokenizer.ggml.tokens) to copy")
    n_vocab = len(target.fields["tokenizer.ggml.tokens"].data)
    if n_vocab != cfg.vocab_size:
        raise ValueError(
            f"the head's vocab_size is {cfg.vocab_size} but the target GGUF's tokenizer has {n_vocab} tokens: "
            "the head was trained for another target"
        )
    check_vocab_map(head)


def rope_pairs_adjacent(w: np.ndarray, n_heads: int) -> np.ndarray:
    """A q/k projection with its output rows reordered from Hugging Face's RoPE pairing (dims i and
    i + d/2 of a head rotate together) to llama.cpp's (dims 2i and 2i + 1), as its converter does."""
    rows, cols = w.shape
    return w.reshape(n_heads, 2, rows // n_heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def rope_pairs_halves(w: np.ndarray, n_heads: int) -> np.ndarray:
    """The inverse of `rope_pairs_adjacent`: llama.cpp's row order back to Hugging Face's."""
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def add_keys(writer: GGUFWriter, cfg, file_type: LlamaFileType, name: str) -> None:
    writer.add_name(name)
    writer.add_file_type(file_type)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(1)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    if cfg.head_dim != cfg.hidden_size // cfg.num_attention_heads:
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_rope_dimension_count(cfg.head_dim)
    if (cfg.rope_scaling or {}).get("rope_type") == "linear":
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(cfg.rope_scaling["factor"])
    # Our aux ids index target layer inputs (HF hidden_states), as llama.cpp reads them; fc's input order.
    writer.add_key_value(f"{ARCH}.target_layers", [int(i) for i in cfg.aux_layer_ids], GGUFValueType.ARRAY)
    writer.add_uint32(f"{ARCH}.target_hidden_size", cfg.target_hidden_size)
    # Our layer keeps the un-normed residual and has no norm before fc.
    writer.add_bool(f"{ARCH}.norm_before_residual", False)
    writer.add_bool(f"{ARCH}.norm_before_fc", False)


def copy_tokenizer(target: GGUFReader, writer: GGUFWriter) -> None:
    """Every `tokenizer.*` key of the target, with its value type."""
    for key, field in target.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        if vtype == GGUFValueType.ARRAY and (len(field.types) != 2 or field.types[1] not in COPYABLE_ITEM_TYPES):
            items = "/".join(t.name for t in field.types[1:])
            raise ValueError(f"the target GGUF's {key} is an array of {items}, which cannot be copied with its type")
        writer.add_key_value(key, field_value(field), vtype)


def add_tensors(writer: GGUFWriter, head, qtype: GGMLQuantizationType) -> None:
    cfg = head.config
    state = {k: v.detach().cpu() for k, v in head.saved_state_dict().items()}
    rope_heads = {
        "midlayer.self_attn.q_proj.weight": cfg.num_attention_heads,
        "midlayer.self_attn.k_proj.weight": cfg.num_key_value_heads,
    }
    matmuls = {**MATMUL_TENSORS, **({EMBEDDING[0]: EMBEDDING[1]} if EMBEDDING[0] in state else {})}
    for name, gguf_name in matmuls.items():
        w = state[name].float().numpy()
        if name in rope_heads:
            w = rope_pairs_adjacent(w, rope_heads[name])
        block = GGML_QUANT_SIZES[qtype][0]
        if w.shape[1] % block:
            raise ValueError(f"{name} has {w.shape[1]} columns, not a multiple of {block}: export it as f16 or f32")
        writer.add_tensor(gguf_name, quantize(np.ascontiguousarray(w), qtype), raw_dtype=qtype)
    for name, gguf_name in NORM_TENSORS.items():
        writer.add_tensor(gguf_name, state[name].float().numpy())
    writer.add_tensor("d2t", (torch.arange(cfg.draft_vocab_size) + state["d2t"]).numpy().astype(np.int64))
    if (cfg.rope_scaling or {}).get("rope_type") == "llama3":
        # llama.cpp divides each RoPE frequency by its factor
        factors = rope_inv_freq(cfg.head_dim, cfg.rope_theta, None) / rope_inv_freq(
            cfg.head_dim, cfg.rope_theta, cfg.rope_scaling
        )
        writer.add_tensor("rope_freqs.weight", factors.numpy().astype(np.float32))


def export_gguf(head, out_path, target, outtype: str = "f32") -> Path:
    """Write `head` as one llama.cpp GGUF at `out_path`.

    `target` is the target's `.gguf` file (or an alias shipping one): its tokenizer is copied in and
    its sizes are checked against the head's. `outtype` (f32, f16, q8_0) applies to the matmul
    weights and an own embedding; norms stay f32 and d2t int64.
    """
    if outtype not in OUTTYPES:
        raise ValueError(f"unknown gguf outtype {outtype!r}; choose one of {', '.join(OUTTYPES)}")
    qtype, file_type = OUTTYPES[outtype]
    reader = read_target(target)
    check_head(head, reader)
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(out, arch=ARCH)
    add_keys(writer, head.config, file_type, f"{head.config.target or Path(str(target)).stem} EAGLE-3 draft")
    copy_tokenizer(reader, writer)
    add_tensors(writer, head, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


# ---- reading a head GGUF back --------------------------------------------------------------------

GGUF_NAMES = {
    gguf_name: name for name, gguf_name in {**MATMUL_TENSORS, **NORM_TENSORS, EMBEDDING[0]: EMBEDDING[1]}.items()
}
GGUF_NAMES["rope_freqs.weight"] = "rope_freqs.weight"  # llama3 RoPE: no head tensor, kept under its own name


@dataclass
class HeadFile:
    """A head GGUF as llama.cpp reads it: its `eagle3.*` keys (prefix dropped, llama.cpp's defaults
    filled in), the tokenizer's size, and its tensors under the head's names in fp32 and Hugging
    Face's RoPE row order, d2t as the absolute ids the file holds."""

    keys: dict
    n_vocab: int
    tensors: dict[str, torch.Tensor]
    types: dict[str, GGMLQuantizationType]
    foreign: list[str]  # tensors export_gguf never writes (enc.output_norm, ...)


def read_gguf(path) -> HeadFile:
    reader = open_gguf(path, "draft head GGUF", HEAD_FIX)
    arch = field_value(reader.fields["general.architecture"]).decode()
    if arch != ARCH:
        raise ValueError(f"{path} is a {arch!r} GGUF, not an {ARCH!r} draft head")
    keys = {k.removeprefix(f"{ARCH}."): field_value(f) for k, f in reader.fields.items() if k.startswith(f"{ARCH}.")}
    keys.setdefault("attention.head_count_kv", keys.get("attention.head_count"))
    keys.setdefault("rope.freq_base", 10000.0)  # llama.cpp's default when the key is absent
    tensors, types, foreign = {}, {}, []
    for t in reader.tensors:
        if t.name == "d2t":
            tensors["d2t"] = torch.from_numpy(np.array(t.data, dtype=np.int64))
        elif t.name in GGUF_NAMES:
            tensors[GGUF_NAMES[t.name]] = torch.from_numpy(dequantize(t.data, t.tensor_type).astype(np.float32))
        else:
            foreign.append(t.name)
            continue
        types[GGUF_NAMES.get(t.name, t.name)] = t.tensor_type
    for name, heads in (("q_proj", "attention.head_count"), ("k_proj", "attention.head_count_kv")):
        name = f"midlayer.self_attn.{name}.weight"
        if name in tensors and keys.get(heads):
            tensors[name] = torch.from_numpy(rope_pairs_halves(tensors[name].numpy(), keys[heads]))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    return HeadFile(keys, len(tokens.data) if tokens else 0, tensors, types, foreign)


def read_gguf_head(path, target_config) -> tuple[DraftConfig, dict[str, torch.Tensor]]:
    """The config and tensors (head names, d2t as offsets) of a head GGUF written by `export_gguf`:
    what llama.cpp runs, for `eagle_train.checkpoint.load_draft_head` to rebuild when the head it came
    from is not at hand. The target's config gives what the file does not carry (its layer count)."""
    file = read_gguf(path)
    keys = file.keys
    scaling = keys.get("rope.scaling.type")
    unreadable = [
        *file.foreign,
        *(["rope_freqs.weight (llama3 RoPE)"] if "rope_freqs.weight" in file.tensors else []),
        *([f"rope.scaling.type {scaling.decode()}"] if scaling not in (None, b"linear") else []),
        *[f"{key} true" for key in ("norm_before_fc", "norm_before_residual") if keys.get(key)],
    ]
    if unreadable:
        raise ValueError(f"{path} holds what the head cannot be rebuilt from: {', '.join(unreadable)}")
    missing = sorted(HEAD_TENSORS - {"t2d"} - set(file.tensors))
    if missing:
        raise ValueError(f"{path} lacks the tensors {missing}")
    head_dim = keys.get("attention.key_length", keys["embedding_length"] // keys["attention.head_count"])
    cfg = DraftConfig(
        hidden_size=keys["embedding_length"],
        num_attention_heads=keys["attention.head_count"],
        num_key_value_heads=keys["attention.head_count_kv"],
        head_dim=head_dim,
        intermediate_size=keys["feed_forward_length"],
        vocab_size=file.n_vocab,
        draft_vocab_size=len(file.tensors["d2t"]),
        rms_norm_eps=keys["attention.layer_norm_rms_epsilon"],
        rope_theta=keys["rope.freq_base"],
        rope_scaling={"rope_type": "linear", "factor": keys["rope.scaling.factor"]} if scaling == b"linear" else None,
        max_position_embeddings=keys["context_length"],
        target_hidden_size=keys["target_hidden_size"],
        target_num_layers=target_config.num_hidden_layers,
        aux_layer_ids=tuple(keys["target_layers"]),
        target=str(getattr(target_config, "name_or_path", "")),
    )
    ids = file.tensors["d2t"]
    if ids.min() < 0 or ids.max() >= cfg.vocab_size:
        raise ValueError(f"{path}: d2t holds ids outside the target vocabulary [0, {cfg.vocab_size})")
    d2t = ids - torch.arange(cfg.draft_vocab_size)
    return cfg, {**{k: v for k, v in file.tensors.items() if k != "d2t"}, "d2t": d2t}
