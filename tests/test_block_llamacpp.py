"""Block heads (DFlash, DSpark) as llama.cpp's `dflash` GGUF: the file holds the keys and tensors its loader reads
and reads back into the same head; with a real build (EAGLE_LLAMACPP_BIN or `eagle-llamacpp build`), random SmolLM2
heads decode plain decoding's text, and llama.cpp's first block of drafts is the head's own, candidate for candidate.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import H, N, V, tiny_head
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from test_export_gguf import value, write_target

from eagle_train.checkpoint import load_draft_head
from eagle_train.export.gguf import export_gguf, spec_type
from engines import llamacpp_build, llamacpp_rules, llamacpp_run

T = GGUFValueType
TARGET_CONFIG = SimpleNamespace(num_hidden_layers=N, name_or_path="tiny-target")


@pytest.fixture
def target(tmp_path):
    """The tiny target GGUF with its RoPE base (the head's) and a random token embedding."""
    path = write_target(tmp_path / "target.gguf", extra={"llama.rope.freq_base": (T.FLOAT32, None, 100000.0)})
    return path


def target_embedding(path):
    [t] = [t for t in GGUFReader(path).tensors if t.name == "token_embd.weight"]
    return np.array(t.data).reshape(V, H)


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_keys_and_tensors_are_what_llama_cpps_dflash_loader_reads(tmp_path, target, method):
    head = tiny_head(method)
    reader = GGUFReader(export_gguf(head, tmp_path / "head.gguf", target))
    cfg = head.config
    expected = {
        "general.architecture": (T.STRING, "dflash"),
        "dflash.block_count": (T.UINT32, 2),
        "dflash.target_layers": (T.ARRAY, [2, 4, 5]),  # layer inputs, as llama.cpp extracts them
        "dflash.block_size": (T.UINT32, 4),
        "dflash.attention.causal": (T.BOOL, False),
        "dflash.sample_from_anchor": (T.BOOL, cfg.sample_from_anchor),
        "dflash.has_confidence_head": (T.BOOL, cfg.confidence_head),
        "tokenizer.ggml.mask_token_id": (T.UINT32, V - 1),
    }
    for key, (vtype, want) in expected.items():
        field = reader.fields[key]
        assert field.types[0] == vtype and value(field) == want, key
    assert reader.fields["dflash.target_layers"].types[1] == T.INT32
    tensors = {t.name: t for t in reader.tensors}
    layer = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm", "ffn_norm"]
    layer += ["ffn_gate", "ffn_up", "ffn_down"]
    names = {"token_embd", "fc", "enc.output_norm", "output_norm", "output"}
    names |= {f"blk.{i}.{n}" for i in range(2) for n in layer}
    if method == "dspark":
        names |= {"markov_w1", "markov_w2", "conf_proj"}
    assert set(tensors) == {f"{n}.weight" for n in names} | {"d2t"} | (
        {"conf_proj.bias"} if method == "dspark" else set()
    )
    assert tensors["d2t"].tensor_type == GGMLQuantizationType.I64
    assert np.array_equal(tensors["d2t"].data, (torch.arange(cfg.draft_vocab_size) + head.d2t).numpy())
    # the target's embedding but for the mask token's row, which is the learnt mask embedding
    embedding, original = np.array(tensors["token_embd.weight"].data), target_embedding(target)
    assert np.array_equal(np.delete(embedding, V - 1, 0), np.delete(original, V - 1, 0))
    assert np.array_equal(embedding[V - 1], head.mask_embedding.detach().numpy())
    # Hugging Face's RoPE row order: llama.cpp rotates this architecture NeoX-style
    assert np.array_equal(tensors["blk.1.attn_k.weight"].data, head.layers[1].self_attn.k_proj.weight.detach().numpy())
    if method == "dspark":
        assert list(tensors["markov_w1.weight"].shape) == [cfg.markov_rank, V]  # ggml order: {R, V}
        assert list(tensors["conf_proj.weight"].shape) == [H + cfg.markov_rank, 1]


@pytest.mark.parametrize("method", ["dflash", "dspark"])
@pytest.mark.parametrize("outtype, tolerance", [("f32", 0.0), ("f16", 1e-3)])
def test_round_trip_gives_the_same_head(tmp_path, target, method, outtype, tolerance):
    head = tiny_head(method)
    back = load_draft_head(export_gguf(head, tmp_path / "head.gguf", target, outtype), target_config=TARGET_CONFIG)
    want, got = head.config.to_dict(), back.config.to_dict()
    assert {k for k in want if want[k] != got[k]} == {"rms_norm_eps", "target_architectures"}  # f32; not in the file
    assert got["rms_norm_eps"] == pytest.approx(want["rms_norm_eps"])
    ours, theirs = head.saved_state_dict(), back.saved_state_dict()
    assert set(ours) == set(theirs)
    for name, t in ours.items():
        scale = t.float().abs().max().clamp(min=1e-12)
        assert ((theirs[name].float() - t.float()).abs().max() / scale).item() <= tolerance, name


def test_refusals_name_the_fix(tmp_path, target):
    with pytest.raises(ValueError, match="not a multiple of 32: export it as f16"):
        export_gguf(tiny_head("dspark"), tmp_path / "q.gguf", target, "q8_0")  # markov rank 4
    with pytest.raises(ValueError, match="mask_token_id 50 is outside the vocabulary"):
        export_gguf(tiny_head("dflash", mask_token_id=V), tmp_path / "m.gguf", target)
    assert not list(tmp_path.glob("?.gguf"))


def test_a_target_mask_head_keeps_the_targets_mask_row(tmp_path, target):
    head = tiny_head("dflash", block_mask="target")
    reader = GGUFReader(export_gguf(head, tmp_path / "head.gguf", target))
    [t] = [t for t in reader.tensors if t.name == "token_embd.weight"]
    assert np.array_equal(np.array(t.data).reshape(V, H), target_embedding(target))


@pytest.mark.parametrize("tied", [True, False])
def test_a_head_drafting_through_the_targets_lm_head_carries_it_as_its_output(tmp_path, tied):
    """As llama.cpp's converter does for a DFlash draft without an lm_head: the target's output.weight, or its token
    embedding (without the mask row) where the target ties them."""
    embedding, output = (torch.randn(V, H).numpy() for _ in range(2))
    target = write_target(
        tmp_path / "target.gguf",
        extra={"llama.rope.freq_base": (T.FLOAT32, None, 100000.0)},
        tensors={"token_embd.weight": embedding, **({} if tied else {"output.weight": output})},
    )
    head = tiny_head("dflash", block_lm_head="target", draft_vocab_size=V)
    tensors = {t.name: np.array(t.data) for t in GGUFReader(export_gguf(head, tmp_path / "head.gguf", target)).tensors}
    assert np.array_equal(tensors["output.weight"].reshape(V, H), embedding if tied else output)
    assert not np.array_equal(tensors["token_embd.weight"].reshape(V, H), embedding)  # the learnt mask row


@pytest.mark.parametrize(
    "method, changes, flags",
    [
        ("dflash", {}, ["draft-dflash", 3]),  # block_size 4: the anchor's slot drafts nothing
        ("dspark", {}, ["draft-dspark", 4]),  # sample_from_anchor: every slot drafts
        ("dspark", dict(sample_from_anchor=False), ["draft-dspark", 3]),
        ("dflash", dict(sample_from_anchor=True), ["draft-dspark", 4]),  # draft-dflash reads the masks' slots only
        ("dspark", dict(markov_rank=0, confidence_head=False, sample_from_anchor=False), ["draft-dflash", 3]),
    ],
)
def test_drafting_flags_follow_the_file(tmp_path, target, method, changes, flags):
    head = tiny_head(method, **changes)
    file = export_gguf(head, tmp_path / "head.gguf", target)
    drafting = llamacpp_run.drafting(file)
    assert drafting.spec_type == flags[0] == spec_type(head.config)
    assert drafting.flags(10) == ["--spec-type", flags[0], "--spec-draft-n-max", flags[1]]
    assert drafting.flags(2)[-1] == 2


def test_unreadable_file_goes_to_llama_cpp_as_eagle3(tmp_path):
    assert llamacpp_run.drafting(tmp_path / "missing.gguf").spec_type == "draft-eagle3"


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_static_findings_pass_the_export_and_name_what_is_broken(tmp_path, target, method):
    head = tiny_head(method)
    file = export_gguf(head, tmp_path / "head.gguf", target)
    assert [f.message for f in llamacpp_rules.static_findings(file, str(target), head) if f.severity == "error"] == []
    other = tiny_head(method, aux_layer_ids=(2, 4, 9), mask_token_id=3)  # layer 9 of an 8-layer target
    messages = [
        f.message
        for f in llamacpp_rules.static_findings(export_gguf(other, tmp_path / "o.gguf", target), str(target), head)
    ]
    assert any("reaches outside the target's layer inputs 0..8" in m for m in messages)
    assert any("tokenizer.ggml.mask_token_id is 3, the head's mask token is 49" in m for m in messages)


# ---- a real llama.cpp build ----------------------------------------------------------------------

CANDIDATE = re.compile(r"draft candidate\s+(\d+), pos\s+(\d+):\s+(\d+) \(\s*([\d.]+)\)")


@pytest.fixture(scope="module")
def f32_target():
    """SmolLM2 as an f32 GGUF (llama.cpp's converter on the dequantized alias): the target the Python side runs,
    so llama.cpp's target features are the built-in's up to float rounding."""
    if llamacpp_build.tools_dir() is None:
        pytest.skip(
            "no llama.cpp build (EAGLE_LLAMACPP_BIN unset, none in the cache): `eagle-llamacpp build` builds one"
        )
    from eagle_train.target import SMOLLM2, cache_dir, resolve_target

    return llamacpp_build.convert_target(resolve_target(SMOLLM2), cache_dir() / "llamacpp" / "smollm2-135m-f32.gguf")


def random_block_head(model, method, lm_head="draft"):
    """A random SmolLM2 head on 8192 of the 49152 tokens (a random sorted subset), or on all of them through the
    target's lm_head (`lm_head` target); DSpark's Markov W1 drawn too (it starts at zero), so its bias shapes every
    draft."""
    from eagle_train.methods.block.head import BlockHead

    torch.manual_seed(0)
    extra = dict(sample_from_anchor=True, markov_rank=64, confidence_head=True) if method == "dspark" else {}
    vocab = model.config.vocab_size if lm_head == "target" else 8192
    head = BlockHead.from_target(
        model, method=method, mask_token_id=16, block_size=8, draft_vocab_size=vocab, block_lm_head=lm_head, **extra
    )
    cfg = head.config
    if lm_head == "draft":
        ids = torch.randperm(cfg.vocab_size)[: cfg.draft_vocab_size].sort().values
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        head.set_vocab_map(ids - torch.arange(cfg.draft_vocab_size), t2d)
    if method == "dspark":
        torch.nn.init.normal_(head.markov_head.markov_w1)
    return head.eval()


def first_block(head, model, ids):
    """The head's first block after the prompt as llama.cpp drafts it: context = the prompt but its last token,
    the block at the last token; per draft the top-3 target ids and their probabilities among the top 10."""
    from eagle_train.hidden_states import target_hidden_states

    x = torch.tensor([ids])
    aux, _ = target_hidden_states(model, x, aux_layer_ids=head.config.aux_layer_ids)
    with torch.no_grad():
        h = head.forward_blocks(aux, x, torch.tensor([[len(ids) - 1]]))[:, 0, head.draft_slots()]
        _, logits, _ = head.greedy_drafts(h, x[:, -1])
    top = logits[0].topk(10, dim=-1)
    return head.draft_to_target_ids(top.indices[:, :3]).tolist(), top.values.softmax(-1)[:, :3].tolist()


@pytest.mark.parametrize("method, lm_head", [("dflash", "draft"), ("dspark", "draft"), ("dflash", "target")])
def test_random_smollm2_head_decodes_as_plain_with_the_heads_own_drafts(smollm2, f32_target, tmp_path, method, lm_head):
    """llama.cpp drafts with the exported file what the head drafts: the first block's candidates, its own lm_head's
    or, for a head that drafts through the target's lm_head (the published DFlash recipe), the target's copied in."""
    from inference.evaluate import chat_ids

    model, tokenizer = smollm2
    head = random_block_head(model, method, lm_head)
    file = export_gguf(head, tmp_path / "head.gguf", f32_target)
    ids = chat_ids(tokenizer, [{"role": "user", "content": "What is the capital of France? Answer in one word."}])
    prompt = tokenizer.decode(ids, clean_up_tokenization_spaces=False)
    drafts = llamacpp_run.drafting(file)
    assert drafts.spec_type == spec_type(head.config) == f"draft-{method}"

    plain = llamacpp_run.run_plain(f32_target, prompt, 12, threads=1)
    run = llamacpp_run.run_head(f32_target, file, prompt, 12, 16, threads=1)  # K clamped to the block's drafts
    assert run.prompt_tokens == plain.prompt_tokens == len(ids) and llamacpp_run.same_text(plain, run)
    # every round drafts a whole block (the last one no further than the budget left); a random head has nothing
    # accepted, so the counters only show that they are read: the first block's drafts are compared below
    assert drafts.max_drafts <= run.drafted <= run.forwards * drafts.max_drafts
    assert run.forwards == run.tokens - run.accepted

    # llama.cpp's debug log lists each draft's top candidates: the same tokens, the same probabilities
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_bytes(prompt.encode())
    cmd = [llamacpp_build.require_tools() / "llama-speculative-simple", "-m", f32_target, "-md", file]
    cmd += [*drafts.flags(16), "-bf", prompt_file, "--no-escape", "--temp", "0", "-n", "1", "-t", "1", "-v"]
    stderr = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, check=True).stderr
    logged = [(int(pos), int(tok), float(p)) for k, pos, tok, p in CANDIDATE.findall(stderr)[: 3 * drafts.max_drafts]]
    tokens, probs = first_block(head, model, ids)
    assert [t for _, t, _ in logged] == [t for row in tokens for t in row]
    assert [p for _, _, p in logged] == pytest.approx([p for row in probs for p in row], abs=2e-3)


def test_dspark_equals_what_llama_cpps_converter_writes(smollm2, tmp_path):
    """A DSpark head through `--format dspark` (DeepSpec's layout + mask_embedding.pt) and llama.cpp's converter
    gives byte-identical tensors (token_embd with the mask row included) and the same keys but for optional ones.
    (Its DFlashDraftModel class cannot take a reduced vocabulary: "Can not map tensor 'model.d2t'"; the loader
    can, which the live test above runs.)"""
    from eagle_train.export import export_head
    from eagle_train.export.gguf import field_value
    from eagle_train.target import SMOLLM2, resolve_target

    script = llamacpp_build.converter_script()
    if script is None:
        pytest.skip("no llama.cpp build with its converter: `eagle-llamacpp build` keeps one")
    head = random_block_head(smollm2[0], "dspark")
    ours = GGUFReader(export_gguf(head, tmp_path / "ours.gguf", SMOLLM2))
    embedding = smollm2[0].get_input_embeddings().weight
    layout = export_head(head, tmp_path / "dspark", "dspark", dtype="fp32", target_embedding=embedding)
    target = tmp_path / "target"  # config, tokenizer.json and the weights the mask row's embedding comes from
    target.mkdir()
    for f in Path(resolve_target(SMOLLM2)).iterdir():
        if f.suffix in (".json", ".jinja", ".safetensors"):
            (target / f.name).symlink_to(f)
    out = tmp_path / "theirs.gguf"
    env = {**os.environ, "PYTHONPATH": str(script.parent / "gguf-py"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, script, layout, "--target-model-dir", target, "--outtype", "f32", "--outfile", out]
    done = subprocess.run([str(c) for c in cmd], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = GGUFReader(out)

    def keys(reader):  # the tokenizer is ours from the target's GGUF, theirs from tokenizer.json
        skip = ("GGUF.", "general.", "tokenizer.")
        return {k for k in reader.fields if not k.startswith(skip)} | {"tokenizer.ggml.mask_token_id"}

    optional = {"dflash.attention.key_length", "dflash.attention.value_length"}  # head_dim = hidden / heads
    assert keys(ours) - {"dflash.rope.dimension_count"} == keys(theirs) - optional
    for k in keys(ours) & keys(theirs):
        assert ours.fields[k].types == theirs.fields[k].types, k
        assert field_value(ours.fields[k]) == field_value(theirs.fields[k]), k
    a, b = {t.name: t for t in ours.tensors}, {t.name: t for t in theirs.tensors}
    assert set(a) == set(b)
    for name in a:
        assert a[name].tensor_type == b[name].tensor_type, name
        assert np.array_equal(np.array(a[name].data), np.array(b[name].data)), name


def test_eval_drafts_a_block_heads_whole_block_unless_told(tmp_path, target, monkeypatch):
    """eagle-eval --engine llamacpp on the fake tools: a block head's file drafts its block (K = its drafts, or
    --parallel K below that); --parallel on an EAGLE-3 file is refused."""
    from test_llamacpp import fake_tools

    from eagle_cli.evaluate import main

    args = fake_tools(tmp_path, monkeypatch)
    head = export_gguf(tiny_head("dflash"), tmp_path / "head.gguf", target)
    base = ["--engine", "llamacpp", "--target", "smollm2-135m", "--bench", "mt_bench", "--num-prompts", "1"]
    for extra, k in (([], 3), (["--parallel", "2"], 2)):
        out = tmp_path / f"r{k}.json"
        main([*base, "--draft", str(head), "--max-new-tokens", "4", "--no-ngram", *extra, "--out", str(out)])
        spec = args("llama-speculative-simple")

        def last(flag, spec=spec):  # the latest run's value: the fake tools append every run's arguments
            return spec[len(spec) - spec[::-1].index(flag)]

        assert (last("--spec-type"), last("--spec-draft-n-max")) == ("draft-dflash", str(k))
        drafting = json.loads(out.read_text())["drafting"]
        assert (drafting["depth"], drafting["parallel"], drafting["chain"]) == (k, True, False)
    eagle3 = export_gguf(tiny_head(), tmp_path / "eagle3.gguf", target)
    with pytest.raises(SystemExit, match="--parallel K drafts a DFlash or DSpark head's block"):
        main([*base, "--draft", str(eagle3), "--parallel", "2", "--out", str(tmp_path / "e.json")])
