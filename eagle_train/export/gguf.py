"""The llama.cpp draft-head GGUF: the one place that knows that format.

llama.cpp (`--spec-type draft-eagle3`) loads an EAGLE-3 head as a model of its own, architecture
"eagle3": Llama keys under `eagle3.*`, the head's tensors under llama.cpp names, the target's
tokenizer copied in, and d2t as absolute target ids (docs/design.md section 7.6). PyPI gguf
does not know the architecture yet, so its own keys are spelled out here. llama.cpp checks every
key's type exactly and refuses a file holding a tensor it did not ask for, so nothing else is written.

Block heads (DFlash, DSpark: `--spec-type draft-dflash|draft-dspark`) are architecture "dflash":
Qwen3 keys plus `dflash.*`, Qwen3 layer tensors under `blk.{i}.*` in Hugging Face's RoPE row order
(llama.cpp rotates this architecture NeoX-style, as we do), the Markov and confidence heads, and
the learnt mask embedding as the row `tokenizer.ggml.mask_token_id` of a token embedding that is
otherwise the target's (what llama.cpp's converter makes of mask_embedding.pt).

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
from eagle_train.export.layouts import variants_refusal
from eagle_train.layers import rope_inv_freq
from eagle_train.methods import METHODS, family_of, row
from eagle_train.target import target_gguf
from eagle_train.unreadable import HEAD_FIX, open_gguf

ARCH = "eagle3"
BLOCK_ARCH = "dflash"  # llama.cpp's architecture for DFlash and DSpark heads
ARCHS = (ARCH, BLOCK_ARCH)
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
# A block head's tensors: those outside the layers, then one layer's (`layers.{i}.` <-> `blk.{i}.`).
BLOCK_MATMULS = {
    "fc.weight": "fc.weight",
    "lm_head.weight": "output.weight",  # over the draft vocabulary, scattered to target ids by d2t
    "markov_head.markov_w1": "markov_w1.weight",  # [V, R], read at target ids
    "markov_head.markov_w2": "markov_w2.weight",  # [Vd, R]
}
BLOCK_SMALL = {  # 1-D or one-row tensors, always f32
    "hidden_norm.weight": "enc.output_norm.weight",
    "norm.weight": "output_norm.weight",
    "confidence_head.proj.weight": "conf_proj.weight",
    "confidence_head.proj.bias": "conf_proj.bias",
}
BLOCK_LAYER_MATMULS = {
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
BLOCK_LAYER_NORMS = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
}
MASK_EMBEDDING = "mask_embedding"  # written as row mask_token_id of token_embd.weight
MASK_KEY = "tokenizer.ggml.mask_token_id"
# Array item types GGUFWriter infers from Python values (gguf 0.13 cannot be told one).
COPYABLE_ITEM_TYPES = (GGUFValueType.STRING, GGUFValueType.FLOAT32, GGUFValueType.INT32, GGUFValueType.BOOL)


def field_value(field):
    """A GGUFReader field's value as Python: strings as their bytes (copied unchanged), numbers as
    int/float/bool, arrays as lists. (gguf 0.13's reader has no ReaderField.contents.)"""
    string = field.types[-1] == GGUFValueType.STRING
    values = [bytes(field.parts[i]) if string else field.parts[i].tolist()[0] for i in field.data]
    return values if field.types[0] == GGUFValueType.ARRAY else values[0]


def gguf_arch(path) -> str:
    """A GGUF file's `general.architecture`: eagle3 or dflash for a head (ARCHS), a model's own otherwise."""
    return field_value(open_gguf(path, "draft GGUF", HEAD_FIX).fields["general.architecture"]).decode()


def read_target(target) -> GGUFReader:
    """The target's GGUF: it lends the head its tokenizer (llama.cpp requires one)."""
    path = target_gguf(target)
    if path is None:
        raise ValueError(
            f"the gguf export needs the target as a GGUF file (--target TARGET.gguf), not {target!r}: "
            "llama.cpp serves the target from one and the head copies its tokenizer"
        )
    return open_gguf(path, "target GGUF", "re-download it")


def block_names(n_layers: int) -> tuple[dict[str, str], dict[str, str]]:
    """A block head's (matmul, f32) tensors: head name -> llama.cpp name."""
    matmuls, small = dict(BLOCK_MATMULS), dict(BLOCK_SMALL)
    for i in range(n_layers):
        matmuls.update({f"layers.{i}.{k}": f"blk.{i}.{v}" for k, v in BLOCK_LAYER_MATMULS.items()})
        small.update({f"layers.{i}.{k}": f"blk.{i}.{v}" for k, v in BLOCK_LAYER_NORMS.items()})
    return matmuls, small


def check_head(head, target: GGUFReader) -> None:
    """Refuse heads llama.cpp's eagle3 or dflash model cannot hold, or that were trained for another target."""
    cfg, method = head.config, row(head.config.method)
    names = set(head.saved_state_dict()) - {EMBEDDING[0]}
    if method.gguf_spec_type is None:
        titles = {}  # family -> the titles of its methods llama.cpp drafts with
        for m in METHODS.values():
            if m.gguf_spec_type:
                titles.setdefault(m.family, []).append(m.title)
        drafts = ", ".join(f"{family}s with {' and '.join(names)} heads only" for family, names in titles.items())
        raise ValueError(
            f"a {method.title} head cannot be written as a llama.cpp GGUF: llama.cpp drafts {drafts} (export "
            f"{method.title} heads with --format {' or --format '.join(method.layouts)})"
        )
    if method.family == "block":
        unplaced = names - {"d2t", "t2d", MASK_EMBEDDING} - set().union(*block_names(cfg.num_hidden_layers))
        if unplaced:
            raise ValueError(f"llama.cpp's dflash model has no place for the head's tensors {sorted(unplaced)}")
        if not 0 <= cfg.mask_token_id < cfg.vocab_size:
            raise ValueError(f"the head's mask_token_id {cfg.mask_token_id} is outside the vocabulary")
    elif names != HEAD_TENSORS:
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


def add_model_keys(writer: GGUFWriter, cfg, file_type: LlamaFileType, name: str, n_layers: int) -> None:
    """The keys every draft architecture shares, under the writer's architecture."""
    writer.add_name(name)
    writer.add_file_type(file_type)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(n_layers)
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


def add_keys(writer: GGUFWriter, cfg, file_type: LlamaFileType, name: str) -> None:
    add_model_keys(writer, cfg, file_type, name, 1)
    # Our aux ids index target layer inputs (HF hidden_states), as llama.cpp reads them; fc's input order.
    writer.add_key_value(f"{ARCH}.target_layers", [int(i) for i in cfg.aux_layer_ids], GGUFValueType.ARRAY)
    writer.add_uint32(f"{ARCH}.target_hidden_size", cfg.target_hidden_size)
    # Our layer keeps the un-normed residual and has no norm before fc.
    writer.add_bool(f"{ARCH}.norm_before_residual", False)
    writer.add_bool(f"{ARCH}.norm_before_fc", False)


def add_block_keys(writer: GGUFWriter, cfg, file_type: LlamaFileType, name: str) -> None:
    """A block head's keys: Qwen3's, its target layers (layer inputs, as ours), its block and options."""
    add_model_keys(writer, cfg, file_type, name, cfg.num_hidden_layers)
    writer.add_key_value(f"{BLOCK_ARCH}.target_layers", [int(i) for i in cfg.aux_layer_ids], GGUFValueType.ARRAY)
    writer.add_uint32(f"{BLOCK_ARCH}.block_size", cfg.block_size)
    writer.add_bool(f"{BLOCK_ARCH}.attention.causal", cfg.causal)
    writer.add_bool(f"{BLOCK_ARCH}.sample_from_anchor", cfg.sample_from_anchor)
    writer.add_bool(f"{BLOCK_ARCH}.has_confidence_head", cfg.confidence_head)


def copy_keys(source: GGUFReader, writer: GGUFWriter, wanted, whose: str = "the target GGUF's") -> None:
    """Every key of `source` that `wanted(key)` accepts, with its value type."""
    for key, field in source.fields.items():
        if not wanted(key):
            continue
        vtype = field.types[0]
        if vtype == GGUFValueType.ARRAY and (len(field.types) != 2 or field.types[1] not in COPYABLE_ITEM_TYPES):
            items = "/".join(t.name for t in field.types[1:])
            raise ValueError(f"{whose} {key} is an array of {items}, which cannot be copied with its type")
        writer.add_key_value(key, field_value(field), vtype)


def copy_tokenizer(target: GGUFReader, writer: GGUFWriter, skip: tuple[str, ...] = ()) -> None:
    """Every `tokenizer.*` key of the target but `skip`, with its value type."""
    copy_keys(target, writer, lambda key: key.startswith("tokenizer.") and key not in skip)


def with_target_tokenizer(path, target) -> Path:
    """The model GGUF at `path` with the target GGUF's tokenizer keys in place of its own. llama.cpp pairs a draft
    with its target only when their vocabularies agree, and the tokenizer a converter writes from a model directory
    depends on the transformers that saved it and the converter's version; the target's own file is the one the draft
    will run beside."""
    return with_tokenizer(path, read_target(target))


def with_tokenizer(path, tokenizer: GGUFReader) -> Path:
    """The model GGUF at `path` rewritten in place, its `tokenizer.*` keys those of `tokenizer`'s file."""
    path = Path(path)
    source = GGUFReader(path)
    partial = path.with_name(path.name + ".partial")
    writer = GGUFWriter(partial, arch=field_value(source.fields["general.architecture"]).decode())
    own = ("GGUF.", "tokenizer.", "general.architecture")  # the reader's framing, the tokenizer, the writer's arch
    copy_keys(source, writer, lambda key: not key.startswith(own), whose="the converted GGUF's")
    copy_tokenizer(tokenizer, writer)
    for t in source.tensors:
        writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return partial.replace(path)


def add_matrix(writer: GGUFWriter, gguf_name: str, w: np.ndarray, qtype: GGMLQuantizationType, name: str) -> None:
    block = GGML_QUANT_SIZES[qtype][0]
    if w.shape[1] % block:
        raise ValueError(f"{name} has {w.shape[1]} columns, not a multiple of {block}: export it as f16 or f32")
    writer.add_tensor(gguf_name, quantize(np.ascontiguousarray(w), qtype), raw_dtype=qtype)


def add_common_tensors(writer: GGUFWriter, cfg, state: dict) -> None:
    """d2t as absolute target ids, and llama3 RoPE's frequency factors."""
    writer.add_tensor("d2t", (torch.arange(cfg.draft_vocab_size) + state["d2t"]).numpy().astype(np.int64))
    if (cfg.rope_scaling or {}).get("rope_type") == "llama3":
        # llama.cpp divides each RoPE frequency by its factor
        factors = rope_inv_freq(cfg.head_dim, cfg.rope_theta, None) / rope_inv_freq(
            cfg.head_dim, cfg.rope_theta, cfg.rope_scaling
        )
        writer.add_tensor("rope_freqs.weight", factors.numpy().astype(np.float32))


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
        add_matrix(writer, gguf_name, w, qtype, name)
    for name, gguf_name in NORM_TENSORS.items():
        writer.add_tensor(gguf_name, state[name].float().numpy())
    add_common_tensors(writer, cfg, state)


def target_matrix(target: GGUFReader, gguf_name: str, cfg) -> np.ndarray | None:
    """The target GGUF's [V, H] tensor `gguf_name` in f32 (dequantized); None when it has none."""
    found = [t for t in target.tensors if t.name == gguf_name]
    if not found:
        return None
    t = found[0]
    try:
        w = dequantize(t.data, t.tensor_type)
    except NotImplementedError as e:
        raise ValueError(
            f"the target GGUF's {gguf_name} is {t.tensor_type.name}, which gguf cannot read back: "
            "give the target as an f32, f16, q8_0 or q4 GGUF"
        ) from e
    return np.array(w, dtype=np.float32).reshape(cfg.vocab_size, cfg.hidden_size)


def target_embedding(target: GGUFReader, cfg) -> np.ndarray:
    """The target GGUF's token embedding [V, H] in f32 (dequantized)."""
    embedding = target_matrix(target, EMBEDDING[1], cfg)
    if embedding is None:
        raise ValueError(f"the target GGUF has no {EMBEDDING[1]}, which a block head's file carries its mask row in")
    return embedding


def add_block_tensors(writer: GGUFWriter, head, qtype: GGMLQuantizationType, target: GGUFReader) -> None:
    """A block head's tensors; the token embedding (the target's, or the head's own) gets the mask embedding
    as row mask_token_id: llama.cpp embeds the block's masks by that token's row. A head that drafts through the
    target's lm_head carries it as its own output (the target's output.weight, or its token embedding when tied),
    as llama.cpp's converter copies it into a DFlash draft without one."""
    cfg = head.config
    state = {k: v.detach().cpu() for k, v in head.saved_state_dict().items()}
    own = EMBEDDING[0] in state
    embedding = state[EMBEDDING[0]].float().numpy().copy() if own else target_embedding(target, cfg)  # row replaced
    if head.borrows_lm_head:
        output = target_matrix(target, "output.weight", cfg)
        if output is None:  # tied: the target's embedding, before its mask row is replaced
            output = target_embedding(target, cfg) if own else embedding.copy()
        add_matrix(writer, "output.weight", output, qtype, "the target's lm_head")
    if MASK_EMBEDDING in state:  # block_mask target: the target's row as it is
        embedding[cfg.mask_token_id] = state[MASK_EMBEDDING].float().numpy()
    add_matrix(writer, EMBEDDING[1], embedding, qtype, EMBEDDING[0])
    matmuls, small = block_names(cfg.num_hidden_layers)
    for name, gguf_name in matmuls.items():
        if name in state:
            add_matrix(writer, gguf_name, state[name].float().numpy(), qtype, name)
    for name, gguf_name in small.items():
        if name in state:
            writer.add_tensor(gguf_name, state[name].float().numpy())
    add_common_tensors(writer, cfg, state)


def block_method(switched_on: bool) -> str:
    """The block method a head in llama.cpp's dflash architecture is, which its file does not name: llama.cpp tells
    them by the head's options (its draft-dflash reads the masks' slots only), so a head with the Markov head or
    drafting from the anchor's slot is the block method whose row switches those on, else the one switching none."""
    return next(name for name, m in METHODS.items() if m.family == "block" and bool(m.head_options) == switched_on)


def spec_type(cfg) -> str:
    """llama.cpp's `--spec-type` for a head: its row's, a block head's that of the method its options make it."""
    block = family_of(cfg.method) == "block"
    return row(block_method(bool(cfg.markov_rank or cfg.sample_from_anchor)) if block else cfg.method).gguf_spec_type


def export_gguf(head, out_path, target, outtype: str = "f32") -> Path:
    """Write `head` as one llama.cpp GGUF at `out_path`.

    `target` is the target's `.gguf` file (or an alias shipping one): its tokenizer is copied in and
    its sizes are checked against the head's. `outtype` (f32, f16, q8_0) applies to the matmul
    weights and an own embedding; norms stay f32 and d2t int64. A block head (DFlash, DSpark) also
    takes the target's token embedding, its mask row replaced by the head's mask embedding.
    """
    if outtype not in OUTTYPES:
        raise ValueError(f"unknown gguf outtype {outtype!r}; choose one of {', '.join(OUTTYPES)}")
    qtype, file_type = OUTTYPES[outtype]
    refusal = variants_refusal(head.config)  # llama.cpp's draft heads apply none of them
    if refusal:
        raise ValueError(refusal)
    reader = read_target(target)
    check_head(head, reader)
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    cfg = head.config
    name = cfg.target or Path(str(target)).stem
    if family_of(cfg.method) == "block":
        writer = GGUFWriter(out, arch=BLOCK_ARCH)
        add_block_keys(writer, cfg, file_type, f"{name} {cfg.method} draft")
        copy_tokenizer(reader, writer, skip=(MASK_KEY,))
        writer.add_uint32(MASK_KEY, cfg.mask_token_id)
        add_block_tensors(writer, head, qtype, reader)
    else:
        writer = GGUFWriter(out, arch=ARCH)
        add_keys(writer, cfg, file_type, f"{name} EAGLE-3 draft")
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


def block_gguf_names(n_layers: int) -> dict[str, str]:
    """llama.cpp name -> head name in a dflash file of `n_layers` layers (the embedding under its own)."""
    names = {gguf_name: name for part in block_names(n_layers) for name, gguf_name in part.items()}
    return {**names, EMBEDDING[1]: EMBEDDING[0], "rope_freqs.weight": "rope_freqs.weight"}


@dataclass
class HeadFile:
    """A head GGUF as llama.cpp reads it: its `<arch>.*` keys (prefix dropped, llama.cpp's defaults
    filled in), the tokenizer's size, and its tensors under the head's names in fp32 and Hugging
    Face's RoPE row order, d2t as the absolute ids the file holds (a dflash file's token embedding
    whole, as `embed_tokens.weight`)."""

    keys: dict
    n_vocab: int
    tensors: dict[str, torch.Tensor]
    types: dict[str, GGMLQuantizationType]
    foreign: list[str]  # tensors export_gguf never writes (enc.output_norm in an eagle3 file, ...)
    arch: str = ARCH
    mask_token_id: int | None = None  # tokenizer.ggml.mask_token_id


def read_gguf(path) -> HeadFile:
    reader = open_gguf(path, "draft head GGUF", HEAD_FIX)
    arch = field_value(reader.fields["general.architecture"]).decode()
    if arch not in ARCHS:
        raise ValueError(f"{path} is a {arch!r} GGUF, not a draft head ({' or '.join(map(repr, ARCHS))})")
    keys = {k.removeprefix(f"{arch}."): field_value(f) for k, f in reader.fields.items() if k.startswith(f"{arch}.")}
    keys.setdefault("attention.head_count_kv", keys.get("attention.head_count"))
    keys.setdefault("rope.freq_base", 10000.0)  # llama.cpp's default when the key is absent
    names = GGUF_NAMES if arch == ARCH else block_gguf_names(keys.get("block_count", 0))
    tensors, types, foreign = {}, {}, []
    for t in reader.tensors:
        if t.name == "d2t":
            tensors["d2t"] = torch.from_numpy(np.array(t.data, dtype=np.int64))
        elif t.name in names:
            tensors[names[t.name]] = torch.from_numpy(dequantize(t.data, t.tensor_type).astype(np.float32))
        else:
            foreign.append(t.name)
            continue
        types[names.get(t.name, t.name)] = t.tensor_type
    if arch == ARCH:
        for name, heads in (("q_proj", "attention.head_count"), ("k_proj", "attention.head_count_kv")):
            name = f"midlayer.self_attn.{name}.weight"
            if name in tensors and keys.get(heads):
                tensors[name] = torch.from_numpy(rope_pairs_halves(tensors[name].numpy(), keys[heads]))
    tokens, mask = reader.fields.get("tokenizer.ggml.tokens"), reader.fields.get(MASK_KEY)
    n_vocab = len(tokens.data) if tokens else 0
    return HeadFile(keys, n_vocab, tensors, types, foreign, arch, field_value(mask) if mask else None)


def read_gguf_head(path, target_config) -> tuple[DraftConfig, dict[str, torch.Tensor]]:
    """The config and tensors (head names, d2t as offsets) of a head GGUF written by `export_gguf`:
    what llama.cpp runs, for `eagle_train.checkpoint.load_draft_head` to rebuild when the head it came
    from is not at hand. The target's config gives what the file does not carry (its layer count)."""
    file = read_gguf(path)
    if file.arch == BLOCK_ARCH:
        return read_block_head(path, file, target_config)
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
    cfg = file_config(file, target_config, target_hidden_size=keys["target_hidden_size"])
    return cfg, {**{k: v for k, v in file.tensors.items() if k != "d2t"}, "d2t": d2t_offsets(path, file, cfg)}


def file_config(file: HeadFile, target_config, **extra) -> DraftConfig:
    """The DraftConfig of a head file's keys; the target's config gives its layer count."""
    keys = file.keys
    scaling = keys.get("rope.scaling.type")
    lm_head = file.tensors.get("lm_head.weight")
    return DraftConfig(
        hidden_size=keys["embedding_length"],
        num_attention_heads=keys["attention.head_count"],
        num_key_value_heads=keys["attention.head_count_kv"],
        head_dim=keys.get("attention.key_length", keys["embedding_length"] // keys["attention.head_count"]),
        intermediate_size=keys["feed_forward_length"],
        vocab_size=file.n_vocab,
        draft_vocab_size=len(file.tensors["d2t"]) if "d2t" in file.tensors else len(lm_head),
        rms_norm_eps=keys["attention.layer_norm_rms_epsilon"],
        rope_theta=keys["rope.freq_base"],
        rope_scaling={"rope_type": "linear", "factor": keys["rope.scaling.factor"]} if scaling == b"linear" else None,
        max_position_embeddings=keys["context_length"],
        target_num_layers=target_config.num_hidden_layers,
        aux_layer_ids=tuple(keys["target_layers"]),
        target=str(getattr(target_config, "name_or_path", "")),
        **extra,
    )


def d2t_offsets(path, file: HeadFile, cfg: DraftConfig) -> torch.Tensor:
    """The file's absolute d2t ids as the head's offsets (target id - draft id)."""
    ids = file.tensors["d2t"]
    if ids.min() < 0 or ids.max() >= cfg.vocab_size:
        raise ValueError(f"{path}: d2t holds ids outside the target vocabulary [0, {cfg.vocab_size})")
    return ids - torch.arange(cfg.draft_vocab_size)


def read_block_head(path, file: HeadFile, target_config) -> tuple[DraftConfig, dict[str, torch.Tensor]]:
    """A dflash file's head, of the method its options make it (`block_method`: the block methods differ in
    nothing else), its mask embedding the token embedding's row mask_token_id."""
    keys, tensors = file.keys, dict(file.tensors)
    scaling = keys.get("rope.scaling.type")
    unreadable = [
        *file.foreign,
        *(["rope_freqs.weight (llama3 RoPE)"] if "rope_freqs.weight" in tensors else []),
        *([f"rope.scaling.type {scaling.decode()}"] if scaling not in (None, b"linear") else []),
    ]
    if unreadable:
        raise ValueError(f"{path} holds what the head cannot be rebuilt from: {', '.join(unreadable)}")
    matmuls, small = block_names(keys.get("block_count", 0))
    optional = {"markov_head.markov_w1", "markov_head.markov_w2", "confidence_head.proj.weight"}
    optional |= {"confidence_head.proj.bias"}
    missing = sorted({*matmuls, *small, EMBEDDING[0]} - optional - set(tensors))
    if missing or file.mask_token_id is None:
        raise ValueError(f"{path} lacks the tensors {missing}" + ("" if missing else f" and the key {MASK_KEY}"))
    markov = tensors.get("markov_head.markov_w1")
    sample_from_anchor = bool(keys.get("sample_from_anchor", markov is not None))  # llama.cpp's default for DSpark
    cfg = file_config(
        file,
        target_config,
        target_hidden_size=keys["embedding_length"],  # llama.cpp reads target layers as wide as the head
        num_hidden_layers=keys["block_count"],
        method=block_method(markov is not None or sample_from_anchor),
        mask_token_id=file.mask_token_id,
        block_size=keys.get("block_size", 16),  # llama.cpp's default
        causal=bool(keys.get("attention.causal", False)),
        sample_from_anchor=sample_from_anchor,
        markov_rank=markov.shape[1] if markov is not None else 0,
        confidence_head="confidence_head.proj.weight" in tensors,
    )
    state = {k: v for k, v in tensors.items() if k not in ("d2t", EMBEDDING[0])}
    state[MASK_EMBEDDING] = tensors[EMBEDDING[0]][cfg.mask_token_id]
    if "d2t" in tensors:
        state["d2t"] = d2t_offsets(path, file, cfg)
    return cfg, state
