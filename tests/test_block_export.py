"""Block heads (DFlash, DSpark) exported: the z-lab `dflash` layout, DeepSpec's `dspark` layout (with the target's
embed_tokens, its mask row the learnt one) and the speculators form of both read back as the same head; vLLM's rules
catch what its loaders would get wrong; a DSpark head asked of vLLM on a CPU is refused in one line (no vLLM needed:
engines/block_rules.py, engines/vllm_child.py)."""

import json

import pytest
import torch
from conftest import V, tiny_head
from safetensors.torch import load_file, save_file

from eagle_train.checkpoint import load_draft_head
from eagle_train.export import export_head, read_export
from eagle_train.export.layouts import MASK_EMBEDDING_FILE
from eagle_train.target import SMOLLM2
from engines import ENGINES, check_directory, vllm_child
from engines.block_rules import restated_hf_config

CASES = [  # (method, layout, config changes)
    ("dflash", "dflash", {}),
    ("dflash", "dflash", {"causal": True}),
    ("dflash", "speculators", {"block_mask": "target"}),  # speculators reads the verifier's mask row
    ("dspark", "dspark", {}),
    ("dspark", "dspark", {"sample_from_anchor": False, "confidence_head": False}),
    ("dspark", "speculators", {"block_mask": "target"}),
    ("dflash", "dflash", {"block_mask": "target", "block_lm_head": "target", "draft_vocab_size": V}),
]
SETTINGS = (
    *("method", "aux_layer_ids", "mask_token_id", "block_size", "causal", "sample_from_anchor", "markov_rank"),
    *("block_mask", "block_lm_head"),
)


def target_embedding(head) -> torch.Tensor:
    """A stand-in for the target's token embedding (the tiny heads have no target)."""
    return torch.randn(head.config.vocab_size, head.config.hidden_size, generator=torch.Generator().manual_seed(1))


def export(tmp_path, method="dflash", layout=None, dtype="fp32", **changes):
    head = tiny_head(method, **changes)
    layout = layout or method
    embedding = target_embedding(head) if layout == "dspark" else None
    return head, export_head(head, tmp_path / layout, layout, dtype=dtype, target_embedding=embedding)


@pytest.mark.parametrize("method, layout, changes", CASES)
def test_each_layout_reads_back_as_the_same_head(tmp_path, method, layout, changes):
    head, out = export(tmp_path, method, layout, **changes)
    back = load_draft_head(out)
    for key in (*SETTINGS, "confidence_head", "draft_vocab_size", "hidden_size", "num_hidden_layers", "rope_theta"):
        assert getattr(back.config, key) == getattr(head.config, key), key
    want, got = head.saved_state_dict(), back.saved_state_dict()
    assert set(got) == set(want)
    for name, t in want.items():
        assert torch.equal(got[name], t), name


def test_dflash_layout_is_z_labs(tmp_path):
    head, out = export(tmp_path)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["is_causal"] is False  # z-lab's library reads it at the top level, vLLM under dflash_config
    assert config["dflash_config"] == {
        "mask_token_id": head.config.mask_token_id,
        "target_layer_ids": [i - 1 for i in head.config.aux_layer_ids],
        "causal": False,
        "sample_from_anchor": False,
    }
    assert config["block_size"] == head.config.block_size and config["draft_vocab_size"] == head.config.draft_vocab_size
    names = set(load_file(out / "model.safetensors"))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "lm_head.weight", "d2t"} <= names
    assert not names & {"embed_tokens.weight", "t2d", "mask_embedding"}  # the target's; follows from d2t; its own file
    mask = torch.load(out / MASK_EMBEDDING_FILE, weights_only=True)
    assert mask["mask_token_id"] == head.config.mask_token_id and torch.equal(mask["embedding"], head.mask_embedding)


def test_dspark_layout_is_deepspecs_with_the_engines_markov_names(tmp_path):
    head, out = export(tmp_path, "dspark")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"]
    assert config["target_layer_ids"] == [i - 1 for i in head.config.aux_layer_ids]
    assert (config["markov_rank"], config["markov_head_type"], config["sample_from_anchor"]) == (4, "vanilla", True)
    assert config["enable_confidence_head"] and config["confidence_head_with_markov"]
    tensors = load_file(out / "model.safetensors")
    assert torch.equal(tensors["markov_head.markov_w1.weight"], head.markov_head.markov_w1.detach())
    assert tensors["markov_head.markov_w2.weight"].shape == (head.config.draft_vocab_size, 4)
    assert tensors["confidence_head.proj.weight"].shape == (1, head.config.hidden_size + 4)


@pytest.mark.parametrize(
    "method, changes, drafts",  # drafts a block of 8 gives (README): DFlash 7, DSpark 8 (its anchor's slot drafts too)
    [("dflash", {}, 7), ("dspark", {}, 8), ("dspark", {"sample_from_anchor": False, "confidence_head": False}, 7)],
)
def test_speculators_block_config_is_what_vllms_speculators_reader_wants(tmp_path, method, changes, drafts):
    """The keys vLLM's speculators reader takes, at the paths it reads them (vllm/transformers_utils/configs/
    speculators/base.py: method = speculators_model_type, num_speculative_tokens = speculators_config.
    proposal_methods[0].speculative_tokens, speculators_config.verifier.name_or_path and a transformer_layer_config
    dict required; algos.py update_dflash: aux_hidden_state_layer_ids required, eagle_aux_hidden_state_layer_ids =
    those ids, the drafter's target_layer_ids = each id - 1), against the tiny head's values written out."""
    _, out = export(tmp_path, method, "speculators", block_size=8, block_mask="target", **changes)
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == method
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == drafts
    assert config["speculators_config"]["verifier"]["name_or_path"] == "tiny-target"
    assert isinstance(config["transformer_layer_config"], dict)
    assert config["aux_hidden_state_layer_ids"] == [2, 4, 5]  # the tiny head's (conftest TINY_DRAFT)
    assert config["mask_token_id"] == 49  # the tiny head's: the last of its 50 ids
    assert config["sample_from_anchor"] is (drafts == 8)
    hf = restated_hf_config(config)  # what --check reads where vLLM is not installed: vLLM's mapping of the above
    assert hf["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert (hf["dflash_config"] if method == "dflash" else hf)["target_layer_ids"] == [1, 3, 4]


def test_a_bare_tensor_mask_embedding_is_read_too(tmp_path):
    head, out = export(tmp_path)
    torch.save(head.mask_embedding.detach() * 2, out / MASK_EMBEDDING_FILE)  # vLLM's loader takes this form too
    _, tensors = read_export(out)
    assert torch.equal(tensors["mask_embedding"], head.mask_embedding.detach() * 2)


def test_a_good_dflash_export_passes_vllms_rules(tmp_path):
    _, out = export(tmp_path)
    (report,) = check_directory(out).values()
    assert report.ok, report.render()
    assert report.loads["model.mask_embedding"] == [MASK_EMBEDDING_FILE]
    assert report.loads["model.layers.0.self_attn.qkv_proj.weight"] == [
        f"layers.0.self_attn.{p}_proj.weight" for p in "qkv"
    ]


def errors(out) -> list[str]:
    (report,) = check_directory(out, ["vllm"]).values()
    return [f.message for f in report.findings if f.severity == "error"]


def rewrite_config(out, change):
    config = json.loads((out / "config.json").read_text())
    change(config)
    (out / "config.json").write_text(json.dumps(config))


def test_vllms_rules_catch_broken_dflash_exports(tmp_path):
    _, out = export(tmp_path)
    (out / MASK_EMBEDDING_FILE).unlink()
    assert any("no mask_embedding.pt" in e for e in errors(out))

    _, out = export(tmp_path / "layers")
    rewrite_config(out, lambda c: c["dflash_config"].update(target_layer_ids=[2, 4, 5]))  # ours, not ours - 1
    assert any("would capture target layers [3, 5, 6]" in e for e in errors(out))

    _, out = export(tmp_path / "tensor")
    tensors = load_file(out / "model.safetensors")
    del tensors["layers.1.mlp.up_proj.weight"]
    save_file(tensors, out / "model.safetensors")
    assert any("no layers.1.mlp.up_proj.weight" in e for e in errors(out))

    _, out = export(tmp_path / "mask-id")
    rewrite_config(out, lambda c: c["dflash_config"].update(mask_token_id=3))
    assert any("is for mask_token_id 49, config.json says 3" in e for e in errors(out))

    _, out = export(tmp_path / "anchor")
    rewrite_config(out, lambda c: c["dflash_config"].update(sample_from_anchor=True))
    assert any("sample_from_anchor true" in e for e in errors(out))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_dspark_ships_the_targets_embedding_with_the_learnt_mask_row_and_passes_vllms_rules(tmp_path, dtype):
    head, out = export(tmp_path, "dspark", dtype=dtype)
    shipped, mask_id = load_file(out / "model.safetensors")["embed_tokens.weight"], head.config.mask_token_id
    want = target_embedding(head).to(shipped.dtype)
    want[mask_id] = head.mask_embedding.detach().to(shipped.dtype)
    assert torch.equal(shipped, want)  # vLLM's DSpark embeds the mask slots by this row
    mask = torch.load(out / MASK_EMBEDDING_FILE, weights_only=True)  # still there: llama.cpp's converter reads it
    assert torch.equal(mask["embedding"], head.mask_embedding.detach().to(shipped.dtype))
    (report,) = check_directory(out).values()
    assert report.engine == "vllm" and report.ok, report.render()
    assert report.loads["model.embed_tokens.weight"] == ["embed_tokens.weight"]


def test_dspark_reads_back_without_the_shipped_embedding_and_its_mask_from_the_row_without_the_file(tmp_path):
    head, out = export(tmp_path, "dspark")
    _, tensors = read_export(out)
    assert "embed_tokens.weight" not in tensors  # the target's: the head borrows it
    (out / MASK_EMBEDDING_FILE).unlink()
    back = load_draft_head(out)
    assert torch.equal(back.mask_embedding, head.mask_embedding)
    assert torch.equal(back.markov_head.markov_w1, head.markov_head.markov_w1)


def test_a_dspark_export_needs_the_targets_embedding(tmp_path, capsys):
    from eagle_cli.export import main as export_main

    with pytest.raises(ValueError) as refused:
        export_head(tiny_head("dspark"), tmp_path / "no-target", "dspark")
    assert len(str(refused.value).splitlines()) == 1 and "target_embedding" in str(refused.value)
    assert not (tmp_path / "no-target").exists()
    with pytest.raises(ValueError, match=r"the target embedding is \[3, 4\]"):
        export_head(tiny_head("dspark"), tmp_path / "wrong", "dspark", target_embedding=torch.zeros(3, 4))
    for mask in ("learnt", "target"):  # a head on the target's mask row ships no embedding: no target needed
        tiny_head("dspark", block_mask=mask).save_pretrained(tmp_path / mask)
        with pytest.raises(SystemExit) as done:
            export_main([str(tmp_path / mask), "--format", "dspark", "--out", str(tmp_path / f"cli-{mask}")])
        said = capsys.readouterr().err.strip().splitlines()
        if mask == "learnt":
            assert done.value.code == 2 and "--format dspark needs --target" in said[-1]
        else:
            assert done.value.code == 0 and (tmp_path / "cli-target" / "config.json").is_file()


def test_vllms_rules_catch_a_dspark_export_whose_mask_row_is_not_learnt(tmp_path):
    head, out = export(tmp_path / "row", "dspark")
    tensors = load_file(out / "model.safetensors")
    tensors["embed_tokens.weight"][head.config.mask_token_id] = target_embedding(head)[head.config.mask_token_id]
    save_file(tensors, out / "model.safetensors")
    assert any("is not the learnt mask embedding" in e and "--target" in e for e in errors(out))

    _, out = export(tmp_path / "none", "dspark")
    tensors = load_file(out / "model.safetensors")
    del tensors["embed_tokens.weight"]
    save_file(tensors, out / "model.safetensors")
    assert any("no embed_tokens.weight" in e and "never reads mask_embedding.pt" in e for e in errors(out))


def test_other_engines_have_no_block_loader(tmp_path):
    _, out = export(tmp_path, "dspark")
    for name in ("sglang", "trtllm"):
        (report,) = check_directory(out, [name]).values()
        assert not report.ok and "no DFlash / DSpark loader" in report.findings[0].message


def test_dspark_asked_of_vllm_on_a_cpu_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    from eagle_cli.evaluate import main as eval_main
    from eagle_cli.export import main as export_main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _, out = export(tmp_path, "dspark")
    with pytest.raises(SystemExit) as done:
        export_main(["--check", str(out), "--engine", "vllm", "--target", SMOLLM2])
    said = capsys.readouterr().err.strip()
    assert done.value.code == 2 and len(said.splitlines()) == 1
    assert "does not draft with a DSpark head on a CPU" in said and "llama.cpp" in said and "built-in" in said
    monkeypatch.setattr(vllm_child, "missing", lambda: "")  # eagle-eval says first when vLLM is not installed
    with pytest.raises(SystemExit, match="does not draft with a DSpark head on a CPU"):
        eval_main(["--engine", "vllm", "--target", SMOLLM2, "--draft", str(out), "--out", str(tmp_path / "r.json")])
    assert ENGINES["vllm"].head_refusal("dflash") == ""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert vllm_child.dspark_refusal() == ""  # vLLM's V2 GPU runner drafts DSpark


@pytest.mark.parametrize(
    "method, changes, fix",
    [
        ("dflash", {}, "train with block_mask: target, or export --format dflash"),
        ("dflash", {"block_mask": "target", "draft_vocab_size": V}, "train with block_lm_head: target or a reduced"),
        ("dspark", {}, "train with block_mask: target, or export --format dspark --target T"),
    ],
)
def test_speculators_refuses_in_one_line_a_block_head_it_would_not_read_as_trained(tmp_path, method, changes, fix):
    """Each refusal names a layout that holds the head: a DSpark head's own, never --format dflash, which refuses
    every DSpark head."""
    with pytest.raises(ValueError) as refused:
        export(tmp_path, method, "speculators", **changes)
    assert len(str(refused.value).splitlines()) == 1 and fix in str(refused.value)
    assert not (tmp_path / "speculators").exists()


@pytest.mark.parametrize("mask", ["learnt", "target"])
def test_a_dspark_head_refused_by_the_dflash_layout_is_pointed_only_at_layouts_that_take_it(tmp_path, mask):
    """--format dflash refuses every DSpark head; its refusal names the layouts that hold this one (a learnt mask:
    not speculators, which would refuse it in turn)."""
    with pytest.raises(ValueError) as refused:
        export_head(tiny_head("dspark", block_mask=mask), tmp_path / "dflash", "dflash")
    fits = "--format dspark --target T" if mask == "learnt" else "--format dspark or --format speculators"
    assert str(refused.value).endswith(f"(use {fits})")


def test_speculators_ships_t2d_beside_d2t_for_a_reduced_vocabulary_and_neither_for_the_whole(tmp_path):
    head, out = export(tmp_path, "dspark", "speculators", block_mask="target")
    tensors = load_file(out / "model.safetensors")
    assert torch.equal(tensors["t2d"], head.t2d) and torch.equal(tensors["d2t"], head.d2t)
    _, out = export(
        tmp_path / "whole", "dflash", "speculators", block_mask="target", block_lm_head="target", draft_vocab_size=V
    )
    assert not set(load_file(out / "model.safetensors")) & {"t2d", "d2t", "lm_head.weight", "mask_embedding"}
    assert not (out / MASK_EMBEDDING_FILE).exists()


@pytest.mark.parametrize(
    "changes, noted",
    [
        ({}, "block_mask, block_lm_head not target"),
        ({"block_mask": "target"}, "block_lm_head not target"),
        ({"block_mask": "target", "block_lm_head": "target", "draft_vocab_size": V}, None),
    ],
)
def test_a_dflash_export_says_in_one_line_when_z_labs_library_cannot_read_it(tmp_path, capsys, changes, noted):
    from eagle_cli.export import main as export_main

    tiny_head("dflash", **changes).save_pretrained(tmp_path / "head")
    with pytest.raises(SystemExit):
        export_main([str(tmp_path / "head"), "--format", "dflash", "--out", str(tmp_path / "out")])
    lines = [line for line in capsys.readouterr().out.splitlines() if "z-lab" in line]
    if noted is None:
        assert lines == []
    else:
        (line,) = lines
        assert noted in line and "block_mask: target and block_lm_head: target" in line


@pytest.mark.parametrize("method, layout", [("dflash", "dflash"), ("dspark", "dspark"), ("dspark", "speculators")])
def test_a_published_recipe_export_ships_no_mask_or_lm_head_and_passes_vllms_rules(tmp_path, method, layout):
    head = tiny_head(method, block_mask="target", block_lm_head="target", draft_vocab_size=V)
    out = export_head(head, tmp_path / layout, layout, dtype="fp32")  # dspark: no target embedding to ship
    assert not set(load_file(out / "model.safetensors")) & {"embed_tokens.weight", "lm_head.weight", "d2t"}
    assert not (out / MASK_EMBEDDING_FILE).exists()
    (report,) = check_directory(out).values()
    assert report.ok, report.render()
    assert "lm_head <- the target's lm_head" in report.filled
    assert any("the target's row of token 49, as trained" in f.message for f in report.findings)
