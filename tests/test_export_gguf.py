"""eagle-export --format gguf: the file holds exactly the keys (with llama.cpp's value types) and
tensors llama.cpp's eagle3 model reads, the head's weights unchanged but for the RoPE row order,
d2t as absolute int64 ids, and the target's tokenizer byte for byte; heads or targets llama.cpp
cannot use are refused before anything is written."""

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import NH, NKV, VD, D, H, I, N, V, tiny_head
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize
from test_export import cli_exit

from eagle_train.export import export_head
from eagle_train.export.gguf import export_gguf
from eagle_train.target import SMOLLM2, resolve_target
from engines.llamacpp_build import converter_script

T = GGUFValueType
TOKENS = ["<s>", "</s>", "héllo", "Ġworld", *(f"t{i}" for i in range(V - 4))]
TOKENIZER = {  # key -> (value type, item type or None, value): one of each kind a tokenizer holds
    "tokenizer.ggml.model": (T.STRING, None, "gpt2"),
    "tokenizer.ggml.tokens": (T.ARRAY, T.STRING, TOKENS),
    "tokenizer.ggml.token_type": (T.ARRAY, T.INT32, [3, 3] + [1] * (V - 2)),
    "tokenizer.ggml.scores": (T.ARRAY, T.FLOAT32, [-float(i) / 3 for i in range(V)]),
    "tokenizer.ggml.merges": (T.ARRAY, T.STRING, ["Ġ w", "h é"]),
    "tokenizer.ggml.bos_token_id": (T.UINT32, None, 0),
    "tokenizer.ggml.eos_token_id": (T.UINT32, None, 1),
    "tokenizer.ggml.add_bos_token": (T.BOOL, None, False),
    "tokenizer.chat_template": (T.STRING, None, "{% for m in messages %}{{ m['content'] }}{% endfor %}"),
}
ROPE_HEADS = {"blk.0.attn_q.weight": NH, "blk.0.attn_k.weight": NKV}
MATMULS = {  # llama.cpp name -> the head's tensor
    "fc.weight": "fc.weight",
    "blk.0.attn_q.weight": "midlayer.self_attn.q_proj.weight",
    "blk.0.attn_k.weight": "midlayer.self_attn.k_proj.weight",
    "blk.0.attn_v.weight": "midlayer.self_attn.v_proj.weight",
    "blk.0.attn_output.weight": "midlayer.self_attn.o_proj.weight",
    "blk.0.ffn_gate.weight": "midlayer.mlp.gate_proj.weight",
    "blk.0.ffn_up.weight": "midlayer.mlp.up_proj.weight",
    "blk.0.ffn_down.weight": "midlayer.mlp.down_proj.weight",
    "output.weight": "lm_head.weight",
}
NORMS = {
    "blk.0.attn_norm.weight": "midlayer.input_layernorm.weight",
    "blk.0.attn_norm_2.weight": "midlayer.hidden_norm.weight",
    "blk.0.ffn_norm.weight": "midlayer.post_attention_layernorm.weight",
    "output_norm.weight": "norm.weight",
}


def write_target(path, vocab=V, hidden=H, extra=None, tensors=None):
    """A tiny target GGUF: a Llama header, the TOKENIZER keys (and `extra` ones), a zero token embedding and
    `tensors` {name: array}."""
    w = GGUFWriter(path, arch="llama")
    w.add_embedding_length(hidden)
    w.add_block_count(N)
    for key, (vtype, _, value) in {**TOKENIZER, **(extra or {})}.items():
        if key == "tokenizer.ggml.tokens":
            value = value[:vocab] + [f"x{i}" for i in range(vocab - len(value))]
        w.add_key_value(key, value, vtype)
    for name, t in {"token_embd.weight": np.zeros((vocab, hidden), dtype=np.float32), **(tensors or {})}.items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def target(tmp_path):
    return write_target(tmp_path / "target.gguf")


def value(field):
    """A scalar field's value, or an array's list (strings decoded)."""
    items = [field.parts[i] for i in field.data]
    items = [bytes(x).decode() if field.types[-1] == T.STRING else x.tolist()[0] for x in items]
    return items if field.types[0] == T.ARRAY else items[0]


def unpermute(w, n_heads):
    """Inverse of llama.cpp's q/k row order: back to Hugging Face's."""
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def weights(reader):
    """llama.cpp name -> (type, ggml shape, values as numpy in Hugging Face order)."""
    out = {}
    for t in reader.tensors:
        data = np.array(t.data)
        if t.tensor_type not in (GGMLQuantizationType.F32, GGMLQuantizationType.I64):
            data = dequantize(data, t.tensor_type)
        out[t.name] = (t.tensor_type, [int(n) for n in t.shape], data.reshape(list(reversed(t.shape.tolist()))))
    return out


def test_keys_are_llama_cpps_with_their_exact_types(tmp_path, target):
    head = tiny_head(aux_layer_ids=(1, 4, 6))
    reader = GGUFReader(export_gguf(head, tmp_path / "head.gguf", target))
    expected = {
        "general.architecture": (T.STRING, "eagle3"),
        "general.name": (T.STRING, "tiny-target EAGLE-3 draft"),
        "general.file_type": (T.UINT32, 0),
        "eagle3.context_length": (T.UINT32, 1024),
        "eagle3.embedding_length": (T.UINT32, H),
        "eagle3.block_count": (T.UINT32, 1),
        "eagle3.feed_forward_length": (T.UINT32, I),
        "eagle3.attention.head_count": (T.UINT32, NH),
        "eagle3.attention.head_count_kv": (T.UINT32, NKV),
        "eagle3.attention.layer_norm_rms_epsilon": (T.FLOAT32, np.float32(1e-5)),
        "eagle3.rope.freq_base": (T.FLOAT32, 100000.0),
        "eagle3.rope.dimension_count": (T.UINT32, D),
        "eagle3.target_layers": (T.ARRAY, [1, 4, 6]),
        "eagle3.target_hidden_size": (T.UINT32, H),
        "eagle3.norm_before_residual": (T.BOOL, False),
        "eagle3.norm_before_fc": (T.BOOL, False),
    }
    fields = {k: f for k, f in reader.fields.items() if not k.startswith(("GGUF.", "tokenizer."))}
    assert set(fields) == set(expected)
    for key, (vtype, want) in expected.items():
        assert (fields[key].types[0], value(fields[key])) == (vtype, want), key
    assert fields["eagle3.target_layers"].types == [T.ARRAY, T.INT32]


def test_the_targets_tokenizer_is_copied_byte_for_byte(tmp_path, target):
    reader = GGUFReader(export_gguf(tiny_head(), tmp_path / "head.gguf", target))
    source = GGUFReader(target)
    copied = {k: f for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    assert set(copied) == set(TOKENIZER)
    for key, (vtype, item, want) in TOKENIZER.items():
        field = copied[key]
        assert field.types == ([vtype, item] if item else [vtype]), key
        got = value(field)
        assert (np.float32(got) == np.float32(want)).all() if item == T.FLOAT32 else got == want, key
        # the whole encoding after the key (type, length, items) is the target's
        raw = [bytes(p) for p in field.parts[2:]]
        assert raw == [bytes(p) for p in source.fields[key].parts[2:]], key


@pytest.mark.parametrize("head_dim, own_embedding", [(D, False), (2 * D, False), (D, True)])
def test_tensors_are_the_heads_in_llama_cpp_names_and_shapes(tmp_path, target, head_dim, own_embedding):
    head = tiny_head(seed=3, head_dim=head_dim)
    embedding = {}
    if own_embedding:
        head.attach_embedding(torch.randn(V, H), own=True)
        embedding = {"token_embd.weight": "embed_tokens.weight"}
    reader = GGUFReader(export_gguf(head, tmp_path / "head.gguf", target))
    tensors = weights(reader)
    assert set(tensors) == {*MATMULS, *NORMS, *embedding, "d2t"}  # no t2d: llama.cpp rejects extras
    state = head.saved_state_dict()
    for name, source in {**MATMULS, **NORMS, **embedding}.items():
        kind, shape, data = tensors[name]
        want = state[source].numpy()
        assert (kind, shape) == (GGMLQuantizationType.F32, list(reversed(want.shape))), name
        if name in ROPE_HEADS:
            assert not np.array_equal(data, want), name  # permuted ...
            data = unpermute(data, ROPE_HEADS[name])  # ... and nothing else
        np.testing.assert_array_equal(data, want, err_msg=name)
    kind, shape, d2t = tensors["d2t"]
    assert (kind, shape) == (GGMLQuantizationType.I64, [VD])
    np.testing.assert_array_equal(d2t, (torch.arange(VD) + head.d2t).numpy())
    assert head.t2d[torch.from_numpy(d2t)].all() and len(set(d2t.tolist())) == VD
    fields = reader.fields
    if head_dim == D:  # = hidden / heads: llama.cpp's default
        assert "eagle3.attention.key_length" not in fields
    else:
        for key in ("eagle3.attention.key_length", "eagle3.attention.value_length", "eagle3.rope.dimension_count"):
            assert (fields[key].types, value(fields[key])) == ([T.UINT32], head_dim), key


def adjacent_pair_rope(x, positions, inv_freq):
    """llama.cpp's RoPE (LLAMA_ROPE_TYPE_NORM): dims 2i and 2i + 1 of each head rotate by pos * f_i."""
    angle = positions[:, None, None] * inv_freq.numpy()[None, None, :]  # [T, 1, d/2]
    even, odd = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = even * np.cos(angle) - odd * np.sin(angle)
    out[..., 1::2] = even * np.sin(angle) + odd * np.cos(angle)
    return out


def test_llama_cpp_rope_on_the_written_q_k_gives_the_heads_attention_scores(tmp_path, target):
    """The permutation is right, not just invertible: q·k after llama.cpp's RoPE equals the head's."""
    head = tiny_head()
    tensors = weights(GGUFReader(export_gguf(head, tmp_path / "head.gguf", target)))
    x = torch.randn(1, 5, 2 * H)
    positions = torch.tensor([[0, 3, 7, 20, 100]])
    with torch.no_grad():
        cos, sin = head.rotary(positions)
        q, k, _ = head.midlayer.self_attn.qkv(x, cos, sin)  # [1, h, T, d]
    scores = torch.einsum("hqd,hkd->hqk", q[0], head.midlayer.self_attn.expand_kv(k)[0]).numpy()

    def roped(name, heads):
        y = (x[0].numpy() @ tensors[name][2].T).reshape(5, heads, D)
        return adjacent_pair_rope(y, positions[0].numpy(), head.rotary.inv_freq).repeat(NH // heads, axis=1)

    q_cpp, k_cpp = roped("blk.0.attn_q.weight", NH), roped("blk.0.attn_k.weight", NKV)
    np.testing.assert_allclose(np.einsum("qhd,khd->hqk", q_cpp, k_cpp), scores, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "outtype, kind, file_type", [("f16", GGMLQuantizationType.F16, 1), ("q8_0", GGMLQuantizationType.Q8_0, 7)]
)
def test_outtype_sets_the_matmul_weights_and_norms_stay_f32(tmp_path, target, outtype, kind, file_type):
    head = tiny_head()
    reader = GGUFReader(export_gguf(head, tmp_path / "head.gguf", target, outtype=outtype))
    assert value(reader.fields["general.file_type"]) == file_type
    tensors, state = weights(reader), head.saved_state_dict()
    for name, source in MATMULS.items():
        got_kind, shape, data = tensors[name]
        want = state[source].numpy()
        assert (got_kind, shape) == (kind, list(reversed(want.shape))), name
        if name in ROPE_HEADS:
            data = unpermute(data, ROPE_HEADS[name])
        # q8_0: per block of 32, |error| <= scale / 2 with scale = max|w| / 127
        tol = np.abs(want).max() / 127 if outtype == "q8_0" else 1e-3
        np.testing.assert_allclose(data, want, rtol=0, atol=tol, err_msg=name)
        assert not np.array_equal(data, want)  # really converted
    for name, source in NORMS.items():
        assert tensors[name][0] == GGMLQuantizationType.F32
        np.testing.assert_array_equal(tensors[name][2], state[source].numpy())
    assert tensors["d2t"][0] == GGMLQuantizationType.I64


def test_rope_scaling_is_written_the_way_llama_cpp_applies_it(tmp_path, target):
    linear = tiny_head(seed=3, rope_scaling={"rope_type": "linear", "factor": 4.0})
    fields = GGUFReader(export_gguf(linear, tmp_path / "linear.gguf", target)).fields
    assert (fields["eagle3.rope.scaling.type"].types, value(fields["eagle3.rope.scaling.type"])) == (
        [T.STRING],
        "linear",
    )
    assert (fields["eagle3.rope.scaling.factor"].types, value(fields["eagle3.rope.scaling.factor"])) == (
        [T.FLOAT32],
        4.0,
    )
    llama3 = tiny_head(
        seed=3,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,  # one frequency in the smooth band
        },
    )
    reader = GGUFReader(export_gguf(llama3, tmp_path / "llama3.gguf", target))
    assert "eagle3.rope.scaling.type" not in reader.fields
    kind, shape, factors = weights(reader)["rope_freqs.weight"]
    assert (kind, shape) == (GGMLQuantizationType.F32, [D // 2])
    # llama.cpp: frequency_i = theta^(-2i/d) / factor_i must be the head's scaled frequency
    plain = 1.0 / 100000.0 ** (np.arange(0, D, 2) / D)
    np.testing.assert_allclose(plain / factors, llama3.rotary.inv_freq.numpy(), rtol=1e-6)
    assert math.isclose(factors.min(), 1.0) and math.isclose(factors.max(), 8.0, rel_tol=1e-6)
    assert ((factors > 1.01) & (factors < 7.99)).sum() == 1


def test_refusals_write_nothing(tmp_path, target):
    out = tmp_path / "head.gguf"
    charsmap = {"tokenizer.ggml.precompiled_charsmap": (T.ARRAY, T.UINT8, b"\x01\x02")}  # its type would change
    cases = [
        (tiny_head("peagle", mask_token_id=7, num_depths=3), target, "f32", "EAGLE-3 heads only"),
        (tiny_head(), "HuggingFaceTB/SmolLM2-135M-Instruct", "f32", r"--target TARGET\.gguf"),
        (tiny_head(), tmp_path, "f32", r"--target TARGET\.gguf"),
        (tiny_head(), write_target(tmp_path / "big.gguf", vocab=V + 1), "f32", f"tokenizer has {V + 1} tokens"),
        (tiny_head(), write_target(tmp_path / "wide.gguf", hidden=2 * H), "f32", "embedding_length is 64"),
        (tiny_head(), write_target(tmp_path / "ugm.gguf", extra=charsmap), "f32", "UINT8.*cannot be copied"),
        (tiny_head(seed=3, intermediate_size=48), target, "q8_0", "not a multiple of 32: export it as f16"),
        (tiny_head(), target, "q4_0", "unknown gguf outtype"),
    ]
    for head, target_file, outtype, message in cases:
        with pytest.raises(ValueError, match=message):
            export_gguf(head, out, target_file, outtype=outtype)
        assert not out.exists(), message
    with pytest.raises(FileNotFoundError, match="does not exist"):
        export_gguf(tiny_head(), out, tmp_path / "missing.gguf")


def test_cli_exports_a_smollm2_head_against_the_alias(tmp_path, capsys):
    """The real path: a checkpoint sized for SmolLM2, the alias resolving to its GGUF, q8_0."""
    head = tiny_head(seed=5, init_std=0.05, **{**SMOLLM2_SIZED, "intermediate_size": 1536, "draft_vocab_size": 256})
    head.save_pretrained(tmp_path / "checkpoint-7" / "head")
    out = tmp_path / "smollm2-eagle3.gguf"
    argv = [str(tmp_path / "checkpoint-7"), "--format", "gguf", "--out", str(out), "--target", SMOLLM2]
    assert cli_exit([*argv, "--outtype", "q8_0"]) == 0
    assert "--spec-type draft-eagle3" in capsys.readouterr().out
    reader = GGUFReader(out)
    assert value(reader.fields["eagle3.target_layers"]) == [2, 15, 27]
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == 49152
    assert (
        value(reader.fields["tokenizer.ggml.model"]) == "gpt2"
        and len(reader.fields["tokenizer.ggml.merges"].data) == 48900
    )
    assert {t.name: t.tensor_type for t in reader.tensors}["blk.0.ffn_down.weight"] == GGMLQuantizationType.Q8_0

    assert cli_exit(argv[:-2]) == 2  # no --target
    assert "needs --target TARGET.gguf" in capsys.readouterr().err
    assert cli_exit([*argv[:-1], "HuggingFaceTB/SmolLM2-135M-Instruct"]) == 2
    assert "--target TARGET.gguf" in capsys.readouterr().err
    assert cli_exit([*argv[:2], "eagle3", *argv[3:], "--outtype", "f16"]) == 2
    assert "--outtype is for --format gguf" in capsys.readouterr().err


SMOLLM2_SIZED = dict(  # a head with SmolLM2's sizes (llama.cpp's converter reads the real target's config)
    hidden_size=576,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    intermediate_size=128,
    vocab_size=49152,
    draft_vocab_size=49152,
    target_hidden_size=576,
    target_num_layers=30,
    aux_layer_ids=(2, 15, 27),
    rope_theta=100000.0,
    target=SMOLLM2,
)


CONVERTER_ONLY_KEYS = {  # optional keys llama.cpp's converter adds, none of which its eagle3 loader needs
    "general.quantization_version",
    "general.size_label",
    "general.type",
    "eagle3.vocab_size",
    "eagle3.attention.key_length",
    "eagle3.attention.value_length",
}


@pytest.mark.parametrize(
    "changes, own_embedding",
    [({}, False), ({"aux_layer_ids": (1, 11, 26), "draft_vocab_size": 512}, True)],
    ids=["default", "non-default aux ids, draft vocab 512 and an own embedding"],
)
def test_equals_what_llama_cpps_own_converter_writes(tmp_path, changes, own_embedding):
    """The same head through `--format eagle3` and llama.cpp's convert_hf_to_gguf.py gives the same
    keys (but for optional ones) and byte-identical tensors as `--format gguf`."""
    script = converter_script()
    if script is None:
        pytest.skip("no llama.cpp build with its converter: `eagle-llamacpp build` keeps one")
    head = tiny_head(seed=5, init_std=0.05, **{**SMOLLM2_SIZED, **changes})
    if own_embedding:
        head.attach_embedding(torch.randn(head.config.vocab_size, head.config.hidden_size) * 0.05, own=True)
    ours = export_gguf(head, tmp_path / "ours.gguf", SMOLLM2)
    export_head(head, tmp_path / "eagle3", "eagle3", dtype="fp32")
    # the converter reads the target's config and tokenizer.json (a tokenizer.model would send it down sentencepiece)
    hf_target = tmp_path / "target"
    hf_target.mkdir()
    for f in Path(resolve_target(SMOLLM2)).iterdir():
        if f.suffix in (".json", ".jinja"):
            (hf_target / f.name).symlink_to(f)
    theirs = tmp_path / "theirs.gguf"
    env = {**os.environ, "PYTHONPATH": str(script.parent / "gguf-py"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(script), str(tmp_path / "eagle3"), "--target-model-dir", str(hf_target)]
    done = subprocess.run([*cmd, "--outtype", "f32", "--outfile", str(theirs)], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]

    a, b = GGUFReader(ours), GGUFReader(theirs)

    def head_keys(reader):  # ours copies the tokenizer from the target's GGUF, theirs from tokenizer.json
        return {k for k in reader.fields if not k.startswith(("GGUF.", "general.name", "tokenizer."))}

    keys = head_keys(a)
    assert keys == head_keys(b) - CONVERTER_ONLY_KEYS
    # tokenizer keys are left out: the converter picks its tokenizer path by the installed transformers
    # (gpt2 BPE with 5.x, llama_hf at the floor 4.56); ours are the target GGUF's, byte for byte (tested above)
    for k in keys:
        assert a.fields[k].types == b.fields[k].types, k
        assert value(a.fields[k]) == value(b.fields[k]), k
    ta, tb = {t.name: t for t in a.tensors}, {t.name: t for t in b.tensors}
    assert set(ta) == set(tb)
    assert ("token_embd.weight" in ta) == own_embedding
    for name in ta:
        assert ta[name].tensor_type == tb[name].tensor_type, name
        assert np.array_equal(np.array(ta[name].data), np.array(tb[name].data)), name


def test_a_head_with_speculators_variants_is_refused_in_one_line(tmp_path):
    """llama.cpp's draft heads apply none of DraftConfig's VARIANTS: such a head (imported from speculators) is
    refused before anything is read or written, naming the layout that states them."""
    with pytest.raises(ValueError, match=r"applies norm_output .* use --format speculators") as refused:
        export_gguf(tiny_head(norm_output=True), tmp_path / "head.gguf", target=tmp_path / "no-target.gguf")
    assert "\n" not in str(refused.value) and not (tmp_path / "head.gguf").exists()
