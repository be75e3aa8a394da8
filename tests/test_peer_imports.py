"""Heads the peers train, imported as written: speculators' own model class (run in its environment,
tests/peers/run.py) builds an EAGLE-3 head with its training defaults and saves it with its own save_pretrained;
`load_draft_head` reads that directory, and our head gives the logits speculators' forward gives on the same
inputs at every training-time-test step. Exported again (`--format speculators`), speculators loads it as written
and gives those logits again; a layout that cannot state the head's variants refuses it."""

import pytest
import torch
from peers.run import run_peer
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from eagle_train.checkpoint import load_draft_head
from eagle_train.export import export_head

TARGET = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 4,
    "vocab_size": 512,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
T, STEPS, WINDOW = 20, 3, 12

# speculators' own training defaults for EAGLE-3 (speculators/train/config/schema.py: norm_before_residual,
# norm_before_fc and norm_output on, every layer a sliding window), and two other layer shapes it writes
HEADS = {
    "training-defaults": (
        {"norm_before_residual": True, "norm_before_fc": True, "norm_output": True},
        {"model_type": "llama", "sliding_window": WINDOW, "layer_types": ["sliding_attention"]},
    ),
    "qwen3-layer-fc-norm": ({"fc_norm": True}, {"model_type": "qwen3", "head_dim": 16}),
    "plain": ({"norm_before_residual": False}, {"model_type": "llama"}),
}


@pytest.fixture(scope="module")
def verifier(tmp_path_factory):
    """A tiny random Llama saved by the peers' transformers: the verifier speculators reads its embedding from, and
    the target we load."""
    path = tmp_path_factory.mktemp("verifier")
    run_peer({"op": "build_verifier", "config": TARGET, "seed": 3, "dir": str(path / "model")}, path)
    return path / "model"


@pytest.mark.parametrize("name", HEADS)
def test_a_speculators_eagle3_head_imports_with_its_logits(name, verifier, tmp_path):
    flags, layer = HEADS[name]
    layer = {
        **{k: TARGET[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads")},
        "vocab_size": TARGET["vocab_size"],
        "num_hidden_layers": 1,
        "max_position_embeddings": 256,
        **layer,
    }
    if "sliding_window" in layer:
        layer["use_sliding_window"] = True
    g = torch.Generator().manual_seed(0)
    aux = torch.randn(1, T, 3 * TARGET["hidden_size"], generator=g)
    ids = torch.randint(0, TARGET["vocab_size"], (1, T), generator=g)  # token t+1 beside the states of t
    save_file({"hidden_states": aux, "input_ids": ids}, tmp_path / "inputs.safetensors")
    config = {
        "transformer_layer_config": layer,
        "draft_vocab_size": 128,
        "eagle_aux_hidden_state_layer_ids": [1, 2, 3],
        **flags,
    }
    head_dir = tmp_path / "head"
    request = {"op": "build_and_save", "library": "speculators", "model": "eagle3", "config": config, "seed": 1}
    request |= {"dir": str(head_dir), "verifier": str(verifier), "ttt_steps": STEPS}
    run_peer(
        request | {"inputs": str(tmp_path / "inputs.safetensors"), "out": str(tmp_path / "out.safetensors")}, tmp_path
    )
    theirs = load_file(tmp_path / "out.safetensors")

    target = AutoModelForCausalLM.from_pretrained(verifier)
    head = load_draft_head(head_dir, target).eval()
    assert head.config.draft_vocab_size == 128 and list(head.config.aux_layer_ids) == [1, 2, 3]
    stated = {**flags, "qk_norm": layer["model_type"] == "qwen3", "sliding_window": layer.get("sliding_window")}
    assert {key: getattr(head.config, key) for key in stated} == stated
    with torch.no_grad():
        hidden, past = head.fuse(aux), []
        positions = 1 + torch.arange(T)[None]  # speculators' default; RoPE makes the offset immaterial
        for i in range(STEPS):
            step_ids = torch.cat([ids[:, i:], torch.zeros(1, i, dtype=torch.long)], dim=1)  # teacher forcing
            hidden = head.ttt_step(hidden, step_ids, positions + i, past)
            torch.testing.assert_close(head.logits(hidden), theirs[f"logits_step{i}"], atol=1e-4, rtol=0)

    if head.config.variants():
        with pytest.raises(ValueError, match="cannot state, so its readers would run another head: use --format spec"):
            export_head(head, tmp_path / "eagle3", "eagle3")
    export_head(head, tmp_path / "again", "speculators", dtype="fp32")
    request = {"op": "load_and_run", "library": "speculators", "dir": str(tmp_path / "again"), "ttt_steps": STEPS}
    request |= {"verifier": str(verifier), "inputs": str(tmp_path / "inputs.safetensors")}
    run_peer(request | {"out": str(tmp_path / "again.safetensors")}, tmp_path)
    again = load_file(tmp_path / "again.safetensors")
    for i in range(STEPS):
        torch.testing.assert_close(again[f"logits_step{i}"], theirs[f"logits_step{i}"], atol=1e-4, rtol=0)
