"""Heads the peers train, imported as written: speculators' own model class (run in its environment,
tests/peers/run.py) builds an EAGLE-3 head with its training defaults and saves it with its own save_pretrained;
`load_draft_head` reads that directory, and our head gives the logits speculators' forward gives on the same
inputs at every training-time-test step. Exported again (`--format speculators`), speculators loads it as written
and gives those logits again; a layout that cannot state the head's variants refuses it. speculators' P-EAGLE heads
do the same at every drafting depth. z-lab's DFlash heads (`DFlashDraftModel`) import the same way and draft
losslessly in the built-in runtime."""

import json

import pytest
import torch
from conftest import tiny_target
from peers.run import run_peer
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from eagle_train.checkpoint import load_draft_head
from eagle_train.export import export_head
from inference.drafting import TreeShape
from inference.generate import Runtime

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
    run_peer({"op": "build_verifier", "config": TARGET, "seed": 3, "dir": str(path / "model")})
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
    run_peer(request | {"inputs": str(tmp_path / "inputs.safetensors"), "out": str(tmp_path / "out.safetensors")})
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
    run_peer(request | {"out": str(tmp_path / "again.safetensors")})
    again = load_file(tmp_path / "again.safetensors")
    for i in range(STEPS):
        torch.testing.assert_close(again[f"logits_step{i}"], theirs[f"logits_step{i}"], atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "layers, stated, read",
    [(1, [0, 2, 3], [0, 2, 3]), (3, [0, 1, 2, 3], [0, 1, 2, 3]), (2, None, [1, 5]), (1, None, [4])],
    ids=["1-layer", "3-layer-4-aux", "2-layer-unstated", "1-layer-unstated"],
)
def test_a_z_lab_dflash_head_imports_with_its_logits(layers, stated, read, tmp_path):
    """z-lab's released DFlash heads: any depth, any number of target layers, no lm_head, d2t or mask embedding (they
    draft through the target's lm_head and embed the mask slots by its row). z-lab's own DFlashDraftModel, saved by
    its save_pretrained, imports as a head on the published recipe that drafts z-lab's logits for a block. A config
    that states no target layers reads the ones z-lab's library derives from num_target_layers and the draft's depth
    (`read`, as z-lab's model reports them); stating others than the weights hold is refused naming both counts."""
    target = tiny_target("qwen3", seed=3, noise=0.1, head_dim=8)
    target_dir = tmp_path / "target"
    target.save_pretrained(target_dir, safe_serialization=True)
    tc, mask_token_id, block_size, context = target.config, target.config.vocab_size - 1, 8, 9
    config = {
        key: getattr(tc, key)
        for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")
    }
    config |= {"vocab_size": tc.vocab_size, "rms_norm_eps": tc.rms_norm_eps, "rope_theta": 10000.0}
    config |= {"num_hidden_layers": layers, "num_target_layers": tc.num_hidden_layers, "block_size": block_size}
    config |= {"dflash_config": {"mask_token_id": mask_token_id} | ({"target_layer_ids": stated} if stated else {})}
    config |= {"architectures": ["DFlashDraftModel"], "max_position_embeddings": 256}
    g = torch.Generator().manual_seed(6)
    aux = torch.randn(1, context + 1, len(read) * tc.hidden_size, generator=g)
    ids = torch.randint(0, mask_token_id, (1, context + 1), generator=g)
    block = torch.full((1, block_size), mask_token_id)
    block[0, 0] = ids[0, context]  # the anchor: the last verified token; the masks after it
    save_file({"hidden_states": aux[:, :context].contiguous(), "block_ids": block}, tmp_path / "inputs.safetensors")
    request = {"op": "build_and_save", "library": "dflash", "model": "dflash", "config": config, "seed": 2}
    request |= {
        "dir": str(tmp_path / "head"),
        "target": str(target_dir),
        "inputs": str(tmp_path / "inputs.safetensors"),
    }
    result = run_peer(request | {"out": str(tmp_path / "out.safetensors")})
    assert result["target_layer_ids"] == read
    theirs = load_file(tmp_path / "out.safetensors")["logits"][0]  # [block_size, V]

    head = load_draft_head(tmp_path / "head", target).eval()
    assert (head.config.block_mask, head.config.block_lm_head) == ("target", "target")
    assert list(head.config.aux_layer_ids) == [i + 1 for i in read]
    assert head.config.num_hidden_layers == layers
    with torch.no_grad():
        ours = head.slot_logits(head.forward_blocks(aux, ids, torch.tensor([[context]])))[1][0, 0]
    assert ours.shape == theirs.shape == (block_size, tc.vocab_size)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    runtime = Runtime(target, head, TreeShape.chain(block_size - 1), cuda_graphs=False)
    prompt = ids[0, :context].tolist()
    assert runtime.generate(prompt, 16).output_ids == runtime.generate_plain(prompt, 16).output_ids  # lossless

    if stated is None:  # three layers stated, two in the weights: the refusal names both counts
        written = json.loads((tmp_path / "head" / "config.json").read_text())
        written["dflash_config"]["target_layer_ids"] = [0, 2, 3]
        (tmp_path / "head" / "config.json").write_text(json.dumps(written))
        with pytest.raises(ValueError, match=f"fc.weight reads {len(read)} target layers of {tc.hidden_size}, the co"):
            load_draft_head(tmp_path / "head", target)


def speculators_layer(tc, **changes) -> dict:
    """A speculators transformer_layer_config of one decoder layer shaped like the target config `tc`."""
    layer = {key: getattr(tc, key) for key in ("hidden_size", "intermediate_size", "num_attention_heads", "head_dim")}
    layer |= {"num_key_value_heads": tc.num_key_value_heads, "vocab_size": tc.vocab_size, "num_hidden_layers": 1}
    return layer | {"model_type": "llama", "rope_theta": tc.rope_parameters["rope_theta"], **changes}


def fine_tune(config: str, target_dir, data, head_dir, run, *extra) -> dict:
    """A 6-step online run of the shipped `config` from the head at `head_dir` (init_from) into `run`: its result."""
    from eagle_cli.train import config_from_command_line
    from eagle_cli.train import run as train

    args = ["--config", config, "mode=online", f"target={target_dir}", f"data_path={data}", f"output_dir={run}"]
    args += ["max_steps=6", "warmup_steps=0", "tokens_per_batch=256", "max_length=128", "eval_fraction=0.2"]
    args += ["report_to=none", f"init_from={head_dir}", "learning_rate=3e-3", "mixed_precision=no", *extra]
    return train(config_from_command_line(args))


def test_a_speculators_head_fine_tunes_here_and_keeps_its_variants(tiny_llama_dir, small_tokenized, tmp_path):
    """`init_from` a head speculators built with its training defaults: eagle-train trains it further (its loss
    falls) and the checkpoint is still that kind of head, which speculators' layout writes back."""
    from eagle_train.hidden_states import default_aux_layer_ids

    target = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    tc = target.config
    flags = {"norm_before_residual": True, "norm_before_fc": True, "norm_output": True}
    config = {
        "transformer_layer_config": speculators_layer(tc),
        "draft_vocab_size": tc.vocab_size,  # a random target: its argmax would mostly miss a reduced vocabulary
        "eagle_aux_hidden_state_layer_ids": list(default_aux_layer_ids(tc.num_hidden_layers)),  # online's layers
    }
    request = {"op": "build_and_save", "library": "speculators", "model": "eagle3", "config": config | flags}
    run_peer(request | {"seed": 1, "dir": str(tmp_path / "head"), "verifier": str(tiny_llama_dir)})
    run = tmp_path / "run"
    result = fine_tune(
        "eagle3_smollm2", tiny_llama_dir, small_tokenized, tmp_path / "head", run, "ttt_length=2", "feature_noise=0"
    )
    assert result["eval_after"]["loss"] < result["eval_before"]["loss"]
    head = load_draft_head(run / "final", target)
    assert {flag: getattr(head.config, flag) for flag in flags} == flags
    export_head(head, tmp_path / "out", "speculators")


def sliding(window: int, layers: int) -> dict:
    """A speculators transformer_layer_config's keys for `layers` sliding-window layers (train/cli.py's)."""
    return {"sliding_window": window, "use_sliding_window": True, "layer_types": ["sliding_attention"] * layers}


# speculators' training defaults for P-EAGLE (train/config/schema.py: a Qwen3 layer, norm_before_residual, every
# layer a sliding window; norm_before_fc and norm_output off), its library defaults on three Llama layers, and a
# window shorter than a chain (K = 8), where a draft still sees its own chain's anchor (peagle/attention.py)
PEAGLE_HEADS = {
    "training-defaults": (
        {"norm_before_residual": True},
        {"model_type": "qwen3", "head_dim": 16, **sliding(WINDOW, 1)},
    ),
    "plain-3-layers": ({}, {"model_type": "llama", "num_hidden_layers": 3}),
    "norms-short-window": (
        {"norm_before_fc": True, "norm_output": True},
        {"model_type": "llama", "num_hidden_layers": 2, **sliding(4, 2)},
    ),
}
DEPTHS = 8  # speculators' num_depths (K)


def peagle_logits(peer_out, head, tokens, aux):
    """(speculators' logits, ours) [E, Vd] at the (anchor, depth) elements speculators drew, and their depths [E]:
    ours through our training forward (the elements, their inputs and their attention mask, `batch`)."""
    from eagle_train.methods.peagle import batch as pb

    theirs = load_file(peer_out)
    anchor, depth = theirs["anchor_pos"].long(), theirs["depth"].long()
    everyone = torch.ones_like(anchor, dtype=torch.bool)
    elements = pb.Elements.stack([dict(anchor=anchor, depth=depth, supervised=everyone, owned=everyone)])
    with torch.no_grad():
        inputs = pb.gather_inputs(elements, tokens, aux, head.config.mask_token_id)
        ours = head(*inputs, pb.dense_mask(elements, head.config.sliding_window))[0]
    return theirs["logits"][0], ours, depth


def assert_every_depth_close(theirs, ours, depth, what: str):
    assert sorted(set(depth.tolist())) == list(range(DEPTHS))
    for d in range(DEPTHS):
        difference = (ours[depth == d] - theirs[depth == d]).abs().max().item()
        print(f"{what}, depth {d}: max |logit difference| {difference:.2e}")
        assert difference <= 1e-4


@pytest.mark.parametrize("name", PEAGLE_HEADS)
def test_a_speculators_peagle_head_imports_with_its_logits(name, verifier, tmp_path):
    """speculators' own PEagleDraftModel (random weights; its embedding, which P-EAGLE trains and saves, random too),
    saved by its save_pretrained, imports (`load_draft_head`) as a P-EAGLE head whose training forward gives
    speculators' logits at every depth of the chains speculators draws; speculators loads our `--format speculators`
    export of it as written and drafts our logits; `--format peagle` refuses a head with speculators' variants."""
    flags, layer = PEAGLE_HEADS[name]
    layer = {
        **{k: TARGET[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads")},
        "vocab_size": TARGET["vocab_size"],
        "num_hidden_layers": 1,
        "max_position_embeddings": 256,
        **layer,
    }
    mask_token_id = TARGET["vocab_size"] - 1
    g = torch.Generator().manual_seed(0)
    aux = torch.randn(1, T, 3 * TARGET["hidden_size"], generator=g)
    tokens = torch.randint(0, mask_token_id, (1, T + 1), generator=g)  # x_0..x_T; speculators reads x_{t+1} at t
    loss_mask = torch.ones(1, T)
    loss_mask[0, 0] = 0  # else a depth-1 chain may start at anchor -1 (data.py seeds at every loss_mask position)
    inputs = {"hidden_states": aux, "input_ids": tokens[:, 1:], "loss_mask": loss_mask}
    save_file(inputs, tmp_path / "inputs.safetensors")
    config = {
        "transformer_layer_config": layer,
        "draft_vocab_size": 128,
        "eagle_aux_hidden_state_layer_ids": [1, 2, 3],
        "mask_token_id": mask_token_id,
        **flags,
    }
    request = {"op": "build_and_save", "library": "speculators", "model": "peagle", "config": config, "seed": 1}
    request |= {"dir": str(tmp_path / "head"), "verifier": str(verifier), "speculative_tokens": DEPTHS}
    request |= {"num_depths": DEPTHS, "inputs": str(tmp_path / "inputs.safetensors")}
    run_peer(request | {"out": str(tmp_path / "out.safetensors")})

    target = AutoModelForCausalLM.from_pretrained(verifier)
    head = load_draft_head(tmp_path / "head", target).eval()
    assert (head.config.method, head.config.mask_token_id, head.config.num_depths) == ("peagle", mask_token_id, DEPTHS)
    assert head.config.num_hidden_layers == layer["num_hidden_layers"]
    stated = {**flags, "qk_norm": layer["model_type"] == "qwen3", "sliding_window": layer.get("sliding_window")}
    assert {key: getattr(head.config, key) for key in stated} == stated
    assert not torch.equal(head.embed_tokens.weight, target.get_input_embeddings().weight)  # the file's own
    assert_every_depth_close(*peagle_logits(tmp_path / "out.safetensors", head, tokens, aux), f"{name} imported")

    if head.config.variants():
        with pytest.raises(ValueError, match="cannot state, so its readers would run another head: use --format spec"):
            export_head(head, tmp_path / "peagle", "peagle")
    export_head(head, tmp_path / "again", "speculators", dtype="fp32")
    request = {"op": "load_and_run", "library": "speculators", "dir": str(tmp_path / "again"), "seed": 2}
    request |= {"verifier": str(verifier), "num_depths": DEPTHS, "inputs": str(tmp_path / "inputs.safetensors")}
    result = run_peer(request | {"out": str(tmp_path / "again.safetensors")})
    assert result["nan_parameters"] == []
    assert_every_depth_close(*peagle_logits(tmp_path / "again.safetensors", head, tokens, aux), f"{name} re-exported")


def test_a_z_lab_dflash_head_on_four_target_layers_fine_tunes_here(smollm2, small_tokenized, tmp_path):
    """`init_from` a z-lab DFlash head reading four target layers (a store holds three; online training captures the
    head's own): eagle-train trains it further (its loss falls), still on z-lab's recipe and layers."""
    target = tiny_target(vocab_size=49152, num_hidden_layers=6, rope_theta=10000.0, bos_token_id=1, eos_token_id=2)
    target_dir = tmp_path / "target"  # six layers: four of them read, none the last (its output is normed)
    target.save_pretrained(target_dir)
    smollm2[1].save_pretrained(target_dir)
    tc = target.config
    config = {key: getattr(tc, key) for key in ("hidden_size", "intermediate_size", "num_attention_heads", "head_dim")}
    config |= {"num_key_value_heads": tc.num_key_value_heads, "vocab_size": tc.vocab_size, "rope_theta": 10000.0}
    config |= {"num_hidden_layers": 2, "num_target_layers": tc.num_hidden_layers, "block_size": 4}
    config |= {"dflash_config": {"target_layer_ids": [0, 1, 3, 4], "mask_token_id": 16}}
    config |= {"architectures": ["DFlashDraftModel"], "max_position_embeddings": 256}
    request = {"op": "build_and_save", "library": "dflash", "model": "dflash", "config": config, "seed": 2}
    run_peer(request | {"dir": str(tmp_path / "head"), "target": str(target_dir)})
    run = tmp_path / "run"
    recipe = "block_size=4 block_mask=target block_lm_head=target"
    with pytest.raises(ValueError, match=f"set {recipe}$"):  # what differs from the run's config, named at once
        fine_tune("dflash_smollm2", target_dir, small_tokenized, tmp_path / "head", run, "num_anchors=8")
    result = fine_tune(
        "dflash_smollm2", target_dir, small_tokenized, tmp_path / "head", run, "num_anchors=8", *recipe.split()
    )
    assert result["eval_after"]["loss"] < result["eval_before"]["loss"]
    head = load_draft_head(run / "final", target)
    assert list(head.config.aux_layer_ids) == [1, 2, 4, 5] and head.config.num_hidden_layers == 2
    assert (head.config.block_mask, head.config.block_lm_head, head.config.block_size) == ("target", "target", 4)


def test_a_speculators_peagle_head_fine_tunes_here_with_its_window(tiny_llama_dir, small_tokenized, tmp_path):
    """`init_from` a P-EAGLE head speculators built with its training defaults (a Qwen3 layer, norm_before_residual, a
    sliding window shorter than the text): eagle-train trains it further through the window (its loss falls), and the
    checkpoint is still that head, which speculators' layout writes back."""
    from eagle_train.hidden_states import default_aux_layer_ids

    target = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    tc = target.config
    config = {
        "transformer_layer_config": speculators_layer(tc, model_type="qwen3", **sliding(16, 1)),
        "draft_vocab_size": tc.vocab_size,
        "eagle_aux_hidden_state_layer_ids": list(default_aux_layer_ids(tc.num_hidden_layers)),  # online's layers
        "mask_token_id": 16,
        "norm_before_residual": True,
    }
    request = {"op": "build_and_save", "library": "speculators", "model": "peagle", "config": config, "seed": 1}
    run_peer(request | {"dir": str(tmp_path / "head"), "verifier": str(tiny_llama_dir), "speculative_tokens": 4})
    run = tmp_path / "run"
    result = fine_tune("peagle_smollm2", tiny_llama_dir, small_tokenized, tmp_path / "head", run, "num_depths=4")
    assert result["eval_after"]["loss"] < result["eval_before"]["loss"]
    head = load_draft_head(run / "final", target)
    assert (head.config.sliding_window, head.config.norm_before_residual, head.config.qk_norm) == (16, True, True)
    export_head(head, tmp_path / "out", "speculators")
