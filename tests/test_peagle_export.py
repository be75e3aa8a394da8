"""P-EAGLE export: the `peagle` layout (docs/design.md section 7) and speculators "peagle" round-trip
through vLLM's loading rules and our importer to the same logits, with the three mask-token keys
and mask_hidden [1, 1, 3H]."""

import json

import pytest
import torch
from conftest import NH, D, H, V, tiny_head, tiny_target_config
from safetensors import safe_open

from eagle_train.checkpoint import load_draft_head
from eagle_train.export import export_head
from eagle_train.export.draft_files import DraftFiles
from eagle_train.methods.peagle import batch as pb
from eagle_train.methods.peagle.head import PEagleHead
from engines import check_directory
from engines.rules import engine_state, head_from_engine_state

K, LAYERS, MASK_ID = 5, 3, 7


def chain_logits(head):
    """Training-mode logits of all elements of a 12-token sequence with chains at anchors 4 and 9."""
    g = torch.Generator().manual_seed(1)
    t = 12
    anchor = torch.cat([torch.arange(t - 1), torch.tensor([4, 9] * (K - 1))])
    depth = torch.cat([torch.zeros(t - 1, dtype=torch.long), torch.arange(1, K).repeat_interleave(2)])
    one = torch.ones(len(anchor), dtype=torch.bool)
    el = pb.Elements.stack([dict(anchor=anchor, depth=depth, supervised=one, owned=one)])
    ids = torch.randint(0, V, (1, t), generator=g)
    aux = torch.randn(1, t, 3 * H, generator=g)
    with torch.no_grad():
        return head(*pb.gather_inputs(el, ids, aux, head.config.mask_token_id), pb.dense_mask(el))


@pytest.fixture(scope="module")
def trained():
    head = tiny_head("peagle", num_hidden_layers=LAYERS, mask_token_id=MASK_ID, num_depths=K)
    return head, chain_logits(head)


def test_peagle_layout_keys_names_and_vllm_round_trip(tmp_path, trained):
    head, expected = trained
    out = export_head(head, tmp_path / "peagle", "peagle", dtype="fp32")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == LAYERS
    assert config["ptd_token_id"] == config["pard_token"] == config["mask_token_id"] == MASK_ID
    assert config["parallel_drafting"] is True and config["attention_bias"] is False
    assert config["eagle_train"]["num_depths"] == K
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert shapes["mask_hidden"] == (1, 1, 3 * H)
    assert shapes["embed_tokens.weight"] == (V, H)
    assert shapes["midlayer.self_attn.q_proj.weight"] == (NH * D, 2 * H)
    assert shapes["layers.1.self_attn.q_proj.weight"] == shapes["layers.2.self_attn.q_proj.weight"] == (NH * D, H)
    assert not any(k.startswith(("layers.0.", f"layers.{LAYERS}.")) for k in shapes)

    report = check_directory(out, None, tiny_target_config())
    assert list(report) == ["vllm"] and report["vllm"].ok and report["vllm"].parallel, report["vllm"].render()
    files = DraftFiles(out)
    served = head_from_engine_state(report["vllm"], engine_state(report["vllm"], files))
    assert torch.equal(chain_logits(served), expected)
    imported = load_draft_head(out, target_config=tiny_target_config())
    assert isinstance(imported, PEagleHead) and imported.config.num_depths == K
    assert imported.config.mask_token_id == MASK_ID
    assert torch.equal(chain_logits(imported), expected)
    assert torch.equal(chain_logits(load_draft_head(out)), expected)  # checkpoint.load_draft_head too


def test_speculators_peagle_round_trip(tmp_path, trained):
    head, expected = trained
    out = export_head(head, tmp_path / "spec", "speculators", dtype="fp32", speculative_tokens=K)
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "peagle" and config["architectures"] == ["PEagleSpeculator"]
    assert config["speculators_config"]["algorithm"] == "peagle"
    assert config["mask_token_id"] == MASK_ID and config["norm_before_residual"] is False
    assert config["transformer_layer_config"]["num_hidden_layers"] == LAYERS
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {
        "layers.0.self_attn.q_proj.weight",
        "layers.2.mlp.down_proj.weight",
        "mask_hidden",
        "embed_tokens.weight",
    } <= names and not any(n.startswith("midlayer.") for n in names)
    report = check_directory(out, None, tiny_target_config())["vllm"]
    assert report.ok, report.render()
    served = head_from_engine_state(report, engine_state(report, DraftFiles(out)))
    assert torch.equal(chain_logits(served), expected)
    assert torch.equal(chain_logits(load_draft_head(out)), expected)


def test_bf16_export_keeps_the_mask_token_and_flags_a_dropped_key(tmp_path, trained):
    head, expected = trained
    out = export_head(head, tmp_path / "bf16", "peagle", dtype="bf16")
    imported = load_draft_head(out)
    assert imported.config.mask_token_id == MASK_ID
    assert (chain_logits(imported) - expected).abs().max() < 0.1 * expected.abs().max()
    config = json.loads((out / "config.json").read_text())
    config["pard_token"] = MASK_ID + 1
    (out / "config.json").write_text(json.dumps(config))
    errors = [f.message for f in check_directory(out, ["vllm"])["vllm"].findings if f.severity == "error"]
    assert any("mask token ids disagree" in m for m in errors), errors


def test_eagle3_heads_and_peagle_format_do_not_mix(tmp_path):
    with pytest.raises(ValueError, match="cannot be written in the peagle layout"):
        export_head(tiny_head(), tmp_path / "x", "peagle")
    with pytest.raises(ValueError, match="cannot be written in the eagle3 layout"):
        export_head(
            tiny_head("peagle", num_hidden_layers=LAYERS, mask_token_id=MASK_ID, num_depths=K), tmp_path / "y", "eagle3"
        )
