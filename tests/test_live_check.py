"""eagle-export --check PATH --engine llamacpp: the static findings on a head GGUF (against the target's
GGUF and the head it came from), each naming the likely cause, without llama.cpp; without a build the
check says how to get one and never passes; with a build and a trained head (EAGLE_TEST_TRAINED_HEAD),
the live comparison on three broken files as llama.cpp really behaves with them.

What llama.cpp does with the broken exports of a trained SmolLM2 head (/work/exp/ttt1/final, built-in
0.278 accepted drafts per forward), 4 MT-Bench first turns x 32 tokens, chain K=3, Q4_1 target: every
file loads and decodes plain decoding's text as often as the good one (2/4 on Q4_1, 4/4 on f32);
tokens per forward 1.330 good, 1.327 target_layers [1, 14, 26] instead of [2, 15, 27], 1.057 the
same reversed, 1.000 d2t shifted by +1, 1.358 rope.freq_base 10000 instead of 100000. So the live
comparison catches the shifted d2t and the reversed layers; the off-by-one layers and the RoPE base
cost this head nothing on short prompts (also at 128 tokens) and are caught by the static findings.
"""

import copy
import dataclasses
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import set_random_vocab_map, tiny_head
from gguf import GGUFWriter

import eagle_train.export.gguf as gguf_module
from eagle_cli.export import main as cli_main
from eagle_train.checkpoint import load_draft_head
from eagle_train.export.gguf import export_gguf
from eagle_train.target import SMOLLM2
from eagle_train.vocab_map import t2d_from_d2t
from engines import ENGINES, llamacpp_build
from engines.live import FAR, Pooled, verdict
from engines.llamacpp_rules import static_findings

BROKEN = ("layers", "reversed", "d2t", "rope")  # the ways a file is broken below
H, NH, NKV, D, FF, V, VD, N = 64, 4, 2, 16, 64, 512, 128, 8  # a tiny Llama target and head (q8_0 rows: 32s)
SIZES = dict(  # tiny_head's at these sizes; a GGUF does not carry the target's architectures
    hidden_size=H,
    num_attention_heads=NH,
    num_key_value_heads=NKV,
    head_dim=D,
    intermediate_size=FF,
    vocab_size=V,
    draft_vocab_size=VD,
    target_hidden_size=H,
    target="tiny",
    target_architectures=[],
)


def cause(what: str, layers) -> str:
    """The likely cause the check names for a file broken as `what`, for a head trained on `layers`."""
    wrong = {"layers": [i - 1 for i in layers], "reversed": list(layers)[::-1]}
    if what in wrong:
        return f"wrong extract layers (eagle3.target_layers {wrong[what]} instead of {list(layers)})"
    return {"d2t": "d2t off by +1", "rope": "a wrong RoPE base (10000 instead of 100000)"}[what]


def broken(head, what: str):
    """A copy of `head` whose export is broken as `what` says."""
    head = copy.deepcopy(head)
    cfg = head.config
    if what == "layers":  # the SGLang / TensorRT-LLM ids
        cfg.aux_layer_ids = tuple(i - 1 for i in cfg.aux_layer_ids)
    elif what == "reversed":
        cfg.aux_layer_ids = cfg.aux_layer_ids[::-1]
    elif what == "d2t":  # absolute ids + 1, clipped at the vocabulary's end
        ids = (torch.arange(cfg.draft_vocab_size) + head.d2t + 1).clamp(max=cfg.vocab_size - 1)
        d2t = ids - torch.arange(cfg.draft_vocab_size)
        head.set_vocab_map(d2t, t2d_from_d2t(d2t, cfg.vocab_size))
    elif what == "rope":  # llama.cpp's default, what a file without the key gets
        cfg.rope_theta = 10000.0
    return head


def write_target(path, layers=N):
    """A tiny Llama target GGUF: the sizes, RoPE base and tokenizer the check compares a head with."""
    w = GGUFWriter(path, arch="llama")
    w.add_embedding_length(H)
    w.add_block_count(layers)
    w.add_rope_freq_base(100000.0)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(V)])
    w.add_tensor("token_embd.weight", np.zeros((V, H), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def export_all(head, target, out: Path) -> dict:
    """{"good" and each BROKEN name: the head's GGUF, broken that way}."""
    files = {"good": export_gguf(head, out / "good.gguf", target)}
    for what in BROKEN:
        files[what] = export_gguf(broken(head, what), out / f"{what}.gguf", target)
    return files


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(target GGUF, source head, its directory, its GGUFs good and broken)."""
    out = tmp_path_factory.mktemp("tiny")
    target, head = write_target(out / "target.gguf"), tiny_head(init_std=0.05, draft_ids=None, **SIZES)
    set_random_vocab_map(head, among=V - 1)  # room for a +1 d2t shift
    head.save_pretrained(out / "head")
    return target, head, out / "head", export_all(head, target, out)


def errors(findings):
    return [f for f in findings if f.severity == "error"]


# ---- static findings (no llama.cpp) --------------------------------------------------------------

LAYERS = (2, 4, 5)  # the tiny head's


def test_good_export_has_no_findings_in_any_outtype(tiny, tmp_path):
    target, head, _, files = tiny
    assert static_findings(files["good"], target, head) == []
    for outtype in ("f16", "q8_0"):  # compared within one rounding step of the file's type
        assert static_findings(export_gguf(head, tmp_path / f"{outtype}.gguf", target, outtype), target, head) == []


@pytest.mark.parametrize("what", BROKEN)
def test_each_broken_file_gets_one_error_naming_its_cause_and_the_fix(tiny, what):
    target, head, _, files = tiny
    [error] = errors(static_findings(files[what], target, head))
    assert error.cause == cause(what, LAYERS)
    assert "re-export it: eagle-export HEAD --format gguf" in error.message


def test_messages_say_how_the_file_went_wrong(tiny):
    target, head, _, files = tiny
    findings = {what: static_findings(files[what], target, head) for what in BROKEN}
    assert "every id -1" in findings["layers"][0].message and "SGLang / TensorRT-LLM" in findings["layers"][0].message
    assert [f.severity for f in findings["reversed"]] == ["warning", "error"]  # not increasing, then: reversed
    assert "reversed" in findings["reversed"][1].message
    assert "shifted by +1" in findings["d2t"][0].message
    assert "the target's 100000" in findings["rope"][0].message and "default 10000" in findings["rope"][0].message


def test_without_the_source_only_what_the_target_shows_is_caught(tiny):
    """target_layers in range and a shifted d2t look like any head's: only the source tells them apart."""
    target, _, _, files = tiny
    assert errors(static_findings(files["layers"], target, None)) == []
    assert errors(static_findings(files["d2t"], target, None)) == []
    assert [f.cause for f in errors(static_findings(files["rope"], target, None))] == [cause("rope", LAYERS)]


def test_d2t_written_as_offsets_is_named_with_or_without_the_source(tiny, tmp_path, monkeypatch):
    target, head, _, _ = tiny
    offsets = copy.deepcopy(head)
    offsets.d2t.sub_(torch.arange(VD))  # export writes arange + d2t: the head's offsets
    monkeypatch.setattr(gguf_module, "check_vocab_map", lambda head: None)  # the exporter would refuse it
    file = export_gguf(offsets, tmp_path / "offsets.gguf", target)
    for source in (head, None):  # offsets repeat: several draft ids, one target id
        [error] = errors(static_findings(file, target, source))
        assert error.cause == "d2t written as offsets" and "looks like EAGLE's offsets" in error.message


def test_another_heads_weights_are_named(tiny):
    target, _, _, files = tiny
    other = tiny_head(seed=1, init_std=0.05, draft_ids=None, **SIZES)
    set_random_vocab_map(other, among=V - 1)
    findings = errors(static_findings(files["good"], target, other))
    assert {f.cause for f in findings} == {"weights that are not the source head's", "d2t of another vocab map"}


def test_layers_the_target_does_not_have_are_named(tiny, tmp_path):
    _, _, _, files = tiny
    shallow = write_target(tmp_path / "shallow.gguf", layers=4)  # the head reads layer 5's input
    [error] = errors(static_findings(files["good"], shallow, None))
    assert error.cause == "target_layers of another target" and "0..4" in error.message


def test_load_draft_head_reads_back_the_head_export_wrote(tiny, tmp_path):
    target, head, _, files = tiny
    embedding = torch.nn.Embedding(V, H)
    target_model = SimpleNamespace(
        config=SimpleNamespace(num_hidden_layers=N, name_or_path="tiny"), get_input_embeddings=lambda: embedding
    )
    back = load_draft_head(files["good"], target_model)
    assert back.config.rms_norm_eps == pytest.approx(head.config.rms_norm_eps)  # stored as f32
    assert dataclasses.replace(back.config, rms_norm_eps=head.config.rms_norm_eps) == head.config
    for name, t in head.saved_state_dict().items():
        assert torch.equal(back.saved_state_dict()[name], t), name  # Q/K rows back in Hugging Face's order
    assert torch.equal(back.embed_tokens.weight, embedding.weight)
    own, with_own = torch.randn(V, H), copy.deepcopy(head)
    with_own.attach_embedding(own, own=True)
    back = load_draft_head(export_gguf(with_own, tmp_path / "own.gguf", target), target_model)
    assert torch.equal(back.embed_tokens.weight, own) and back.owns_embedding


# ---- the verdict (measured figures in, finding out) -----------------------------------------------


def test_far_is_under_half_the_builtin_accepted_drafts_per_forward():
    builtin = Pooled(124, 97)  # 0.278 accepted per forward
    assert verdict("llama.cpp", Pooled(129, 97), builtin, [], True).severity == "info"
    assert verdict("llama.cpp", Pooled(129, 112), builtin, [], True).severity == "info"  # 0.152: over half
    far = verdict("llama.cpp", Pooled(128, 128), builtin, ["d2t off by +1"], True)
    assert far.severity == "error" and far.message.endswith("Likely cause: d2t off by +1")
    unexplained = verdict("llama.cpp", Pooled(128, 128), builtin, [], False)
    assert "static rules above do not see" in unexplained.message and "pass --source HEAD" in unexplained.message


# ---- the command line, and no llama.cpp build ------------------------------------------------------


def cli_exit(argv) -> int:
    with pytest.raises(SystemExit) as e:
        cli_main(argv)
    return e.value.code


def test_without_a_build_the_check_says_how_to_get_one_and_never_passes(tiny, tmp_path, monkeypatch, capsys):
    target, _, source, files = tiny
    monkeypatch.delenv("EAGLE_LLAMACPP_BIN", raising=False)
    monkeypatch.setenv("EAGLE_TRAIN_CACHE", str(tmp_path))
    argv = ["--check", str(files["good"]), "--engine", "llamacpp", "--target", target, "--source", str(source)]
    assert cli_exit(argv) == 3
    out = capsys.readouterr().out
    assert ": SKIPPED" in out and "run `eagle-llamacpp build`" in out
    argv[1] = str(files["rope"])
    assert cli_exit(argv) == 1  # the static findings still fail it
    assert "PROBLEMS" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--check", "h.gguf", "--engine", "llamacpp"], "against --target"),
        (["--check", "dir", "--engine", "vllm", "--source", "head"], "--source is for the live checks"),
        (["--check", "dir", "--engine", "sglang", "--source", "head", "--target", "t"], "--source is for the live"),
        (["--check", "dir", "--threads", "1"], "--threads is for --check PATH --engine llamacpp"),
        (["--check", "dir", "--engine", "sglang", "--threads", "1"], "--threads is for --check PATH --engine llamacpp"),
        (["--check", "dir", "--engine", "vllm", "--target", "t", "--threads", "1"], "vLLM binds its own threads"),
    ],
)
def test_cli_refuses_options_the_check_does_not_take(argv, message, capsys):
    assert cli_exit(argv) == 2
    assert message in capsys.readouterr().err


def test_a_head_directory_is_its_own_source(tiny, capsys):
    target, _, source, _ = tiny
    argv = ["--check", str(source), "--engine", "llamacpp", "--target", target, "--source", str(source)]
    assert cli_exit(argv) == 2
    assert "a head directory is its own source" in capsys.readouterr().err


# ---- live, with a llama.cpp build and a trained head -------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(the trained head's directory, its layers, its GGUFs good and broken against the Q4_1 target)."""
    if llamacpp_build.tools_dir() is None:
        pytest.skip("no llama.cpp build (EAGLE_LLAMACPP_BIN unset, none in the cache): `eagle-llamacpp build`")
    path = os.environ.get("EAGLE_TEST_TRAINED_HEAD")
    if not path:
        pytest.skip(
            "EAGLE_TEST_TRAINED_HEAD is unset: the live degradation needs a SmolLM2 head that drafts "
            "(AL clearly above 1), e.g. the quickstart's runs/eagle3/final"
        )

    head = load_draft_head(Path(path))
    return Path(path), head.config.aux_layer_ids, export_all(head, SMOLLM2, tmp_path_factory.mktemp("trained"))


def live(artifact, source=None):
    return ENGINES["llamacpp"].check_live(artifact, SMOLLM2, source=source, threads=1)


def test_live_good_head_passes(trained, capsys):
    assert cli_exit(["--check", str(trained[0]), "--engine", "llamacpp", "--target", SMOLLM2, "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert ": OK" in out and "drafts as well as the built-in runtime with the source head" in out


@pytest.mark.parametrize("what", BROKEN)
def test_live_broken_files_fail_naming_the_cause(trained, what):
    source, layers, files = trained
    report = live(files[what], source)
    assert report.exit_code == 1 and cause(what, layers) in [f.cause for f in report.findings]
    *_, live_verdict = report.findings
    assert report.engine_run.forwards > 0  # llama.cpp loads every one of them and decodes
    if what in ("d2t", "reversed"):  # llama.cpp drafts (almost) nothing acceptable: the live part catches it
        assert live_verdict.severity == "error" and live_verdict.message.endswith(
            f"Likely cause: {cause(what, layers)}"
        )
        assert report.engine_run.accepted < FAR * report.builtin_run.accepted
    else:  # measured: no acceptance lost on these prompts; the static error alone fails the check
        assert live_verdict.severity == "info" and "the errors above stand" in live_verdict.message


def test_live_without_the_source_cannot_judge_a_head_that_drafts_nothing(trained):
    """The file read back carries its shifted d2t into the built-in runtime too: both accept nothing."""
    report = live(trained[2]["d2t"])
    assert report.exit_code == 3 and "pass --source HEAD" in report.skipped
    assert report.engine_run.accepted == report.builtin_run.accepted == 0
