"""Exports read by the peers' own loaders, as written: speculators loads the `speculators` export of a trained
EAGLE-3 head of SmolLM2 offline (the target's embedding shipped, the verifier a directory this machine holds);
z-lab's dflash library loads a `dflash` export of a head on the published recipe (block_mask: target,
block_lm_head: target), speculators loads `speculators` DFlash and DSpark exports of target-mask heads (a reduced
vocabulary: t2d shipped), and each drafts the logits our head drafts on the same inputs. The peers run in their own
environment (.venv-peers, scripts/install_peers.sh) through tests/peers/peer_child.py; EAGLE_PEERS_PYTHON names that
environment's python where it lives elsewhere."""

import dataclasses
from pathlib import Path

import pytest
import torch
from conftest import TINY_BLOCK, tiny_head, tiny_target
from peers.run import peer_python, run_peer
from safetensors.torch import load_file, save_file

from eagle_train.export import LAYOUTS, export_head
from eagle_train.export.layouts import says_nothing
from eagle_train.hidden_states import target_hidden_states
from eagle_train.target import HUB_IDS, SMOLLM2, resolve_target

pytestmark = pytest.mark.skipif(
    peer_python() is None, reason="the peers' libraries are not installed: bash scripts/install_peers.sh"
)
RECIPE = {"block_mask": "target", "block_lm_head": "target"}
ATOL = 1e-4  # fp32 on both sides


def test_speculators_reads_the_speculators_export_of_a_trained_eagle3_head_as_written(smollm2, tmp_path, capsys):
    """A head whose every weight moved from its init, exported by the CLI as a user does it (no --target: the head's
    own, the SmolLM2 alias): speculators' Eagle3DraftModel, offline, on the files as written, drafts our logits on
    real hidden states of a chat prompt. Without embed_tokens in the files its loader kept the weight transformers
    left uninitialised (zeros at this size) and never took the verifier's."""
    from eagle_cli.export import main as export_main

    model, tokenizer = smollm2
    head = tiny_head(seed=7, init_std=None, target_model=model, draft_vocab_size=2048, target=SMOLLM2).eval()
    with torch.no_grad():  # as training leaves them: matrices of fan-in variance, norm weights near 1
        for p in head.parameters():
            if p.requires_grad:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5 if p.ndim > 1 else 1 + 0.1 * torch.randn_like(p))
    head.save_pretrained(tmp_path / "head")
    with pytest.raises(SystemExit) as done:
        export_main(
            [str(tmp_path / "head"), "--format", "speculators", "--out", str(tmp_path / "spec"), "--dtype", "fp32"]
        )
    said = capsys.readouterr().out
    assert done.value.code == 0, said
    local = str(Path(resolve_target(SMOLLM2)).resolve())
    assert f"verifier: {local} (a local directory" in said and f"--verifier {HUB_IDS[SMOLLM2]}" in said
    shipped = load_file(tmp_path / "spec" / "model.safetensors")["embed_tokens.weight"]
    assert torch.equal(shipped, model.get_input_embeddings().weight)

    chat = [{"role": "user", "content": "Write a haiku about the sea, then explain its imagery."}]
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ids = ids["input_ids"]
    aux, _ = target_hidden_states(model, ids, aux_layer_ids=head.config.aux_layer_ids)
    T = ids.shape[1] - 1  # token t+1 beside the states of t, as speculators' trainer shifts them
    aux, ids = aux[:, :T].contiguous(), ids[:, 1:].contiguous()
    save_file({"hidden_states": aux, "input_ids": ids}, tmp_path / "inputs.safetensors")
    request = {"op": "load_and_run", "library": "speculators", "dir": str(tmp_path / "spec"), "ttt_steps": 2}
    result = run_peer(
        request | {"inputs": str(tmp_path / "inputs.safetensors"), "out": str(tmp_path / "out.safetensors")}
    )
    assert result["config"]["speculators_config"]["verifier"]["name_or_path"] == local  # loaded as written, offline
    theirs = load_file(result["out"])
    with torch.no_grad():
        hidden, past, positions = head.fuse(aux), [], 1 + torch.arange(T)[None]
        for step in range(2):
            step_ids = torch.cat([ids[:, step:], torch.zeros(1, step, dtype=torch.long)], dim=1)  # teacher forcing
            hidden = head.ttt_step(hidden, step_ids, positions + step, past)
            ours = head.logits(hidden)
            difference = (theirs[f"logits_step{step}"] - ours).abs().max().item()
            print(f"speculators eagle3, step {step}: max |logit difference| {difference:.2e} over {T} positions")
            assert difference < ATOL
            assert torch.equal(theirs[f"logits_step{step}"].argmax(-1), ours.argmax(-1))


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """(a tiny random Qwen3 target, its save_pretrained directory): the verifier both sides read."""
    model = tiny_target("qwen3", seed=3, noise=0.1, head_dim=8)
    path = tmp_path_factory.mktemp("target") / "qwen3"
    model.save_pretrained(path, safe_serialization=True)
    return model, path


def block_head(model, method, **changes):
    options = {**TINY_BLOCK[method], "mask_token_id": model.config.vocab_size - 1, "draft_vocab_size": 40, **changes}
    return tiny_head(method, seed=4, init_std=0.2, target_model=model, **options).eval()


def random_context(model, length, seed=5):
    """Aux hidden states [1, T, 3H] and ids [1, T] of a random text (the head reads the states as given)."""
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(1, length, 3 * model.config.hidden_size, generator=g)
    return aux, torch.randint(0, model.config.vocab_size - 1, (1, length), generator=g)


CONTEXT = 9  # the z-lab checks' block follows a 9-token context


def our_block_logits(head, aux, ids):
    """Our head's logits [block_size, V] of the block anchored at CONTEXT."""
    with torch.no_grad():
        return head.slot_logits(head.forward_blocks(aux, ids, torch.tensor([[CONTEXT]])))[1][0, 0]


def zlab_and_our_logits(model, path, head, tmp_path):
    """z-lab's DFlashDraftModel on our dflash export of `head` and our head, both [block_size, V], over one block
    after the context: the target's states as keys and values, the anchor then the masks; and (aux, ids)."""
    out = export_head(head, tmp_path / "dflash", "dflash", dtype="fp32")
    aux, ids = random_context(model, CONTEXT + 1)
    block = torch.full((1, head.config.block_size), head.config.mask_token_id)
    block[0, 0] = ids[0, CONTEXT]  # the anchor: the last verified token, its state not yet computed
    save_file({"hidden_states": aux[:, :CONTEXT].contiguous(), "block_ids": block}, tmp_path / "inputs.safetensors")
    request = {"op": "load_and_run", "library": "dflash", "dir": str(out), "target": str(path)}
    request.update(inputs=str(tmp_path / "inputs.safetensors"), out=str(tmp_path / "out.safetensors"))
    result = run_peer(request)
    return load_file(result["out"])["logits"][0], our_block_logits(head, aux, ids), (aux, ids)


@pytest.mark.parametrize("causal", [False, True])
def test_z_labs_dflash_reads_a_dflash_export_of_the_published_recipe(target_dir, tmp_path, causal):
    model, path = target_dir
    head = block_head(model, "dflash", causal=causal, draft_vocab_size=model.config.vocab_size, **RECIPE)
    theirs, ours, _ = zlab_and_our_logits(model, path, head, tmp_path)
    assert theirs.shape == ours.shape == (head.config.block_size, model.config.vocab_size)
    difference = (theirs - ours).abs().max().item()
    print(f"z-lab dflash (causal {causal}): max |logit difference| {difference:.2e}")
    assert difference < ATOL


def test_z_labs_dflash_drafts_a_learnt_mask_head_otherwise_as_the_export_notice_says(target_dir, tmp_path):
    """What the notice of `eagle-export --format dflash` rests on: z-lab's library embeds the mask slots by the
    target's row, not the learnt embedding, so its drafts at the mask slots are not the head's."""
    model, path = target_dir
    head = block_head(model, "dflash", draft_vocab_size=model.config.vocab_size, block_lm_head="target")
    theirs, ours, inputs = zlab_and_our_logits(model, path, head, tmp_path)
    assert (theirs[1:] - ours[1:]).abs().max().item() > 0.1
    head.config.block_mask = "target"  # the same weights, the mask slots on the target's row: z-lab's reading
    assert (theirs - our_block_logits(head, *inputs)).abs().max().item() < ATOL


ANCHORS = torch.tensor([3, 8, 12])  # the speculators checks' blocks: each < T - block_size, as speculators' are


def our_anchored_logits(head, aux, ids):
    """Our head's (logits [A * block_size, Vd], confidence [A * block_size] or None) of the blocks at ANCHORS, each
    slot's Markov bias reading the true token before its draft (speculators' training forward)."""
    size = head.config.block_size
    with torch.no_grad():
        h = head.forward_blocks(aux, ids, ANCHORS[None])[0]  # [A, B, H]
        first = 0 if head.config.sample_from_anchor else -1  # the token before slot k's draft
        prev = ids[0, (ANCHORS[:, None] + torch.arange(size) + first).clamp(min=0)]
        logits, confidence = head.draft_logits(h, prev)
    return logits.flatten(0, 1), None if confidence is None else confidence.flatten()


def speculators_logits(model, path, head, tmp_path):
    """speculators' own model loaded from our speculators export of `head` (verifier: the target's directory, as
    written in config.json): its outputs at ANCHORS over a random 20-token text, and the (aux, ids) it read."""
    out = export_head(head, tmp_path / "spec", "speculators", dtype="fp32", verifier=str(path))
    aux, ids = random_context(model, 20)
    save_file({"hidden_states": aux, "input_ids": ids, "anchor_positions": ANCHORS}, tmp_path / "inputs.safetensors")
    request = {"op": "load_and_run", "library": "speculators", "dir": str(out)}
    request.update(inputs=str(tmp_path / "inputs.safetensors"), out=str(tmp_path / "out.safetensors"))
    result = run_peer(request)
    assert result["nan_parameters"] == []  # every weight came from the files or the verifier
    return load_file(result["out"]), (aux, ids)


@pytest.mark.parametrize(
    "method, changes",
    [
        ("dflash", {"block_mask": "target"}),  # a reduced vocabulary of its own lm_head: t2d ships
        ("dspark", {"block_mask": "target"}),
        ("dflash", {**RECIPE, "draft_vocab_size": 50}),  # the whole vocabulary through the verifier's lm_head
    ],
)
def test_speculators_reads_block_exports_of_target_mask_heads(target_dir, tmp_path, method, changes):
    model, path = target_dir
    head = block_head(model, method, **changes)
    theirs, inputs = speculators_logits(model, path, head, tmp_path)
    logits, confidence = our_anchored_logits(head, *inputs)
    difference = (theirs["logits"][0] - logits).abs().max().item()
    print(f"speculators {method} {changes}: max |logit difference| {difference:.2e}")
    assert difference < ATOL
    if confidence is not None:
        assert (theirs["confidence_logits"][0] - confidence).abs().max().item() < ATOL


def test_speculators_drafts_a_learnt_mask_head_from_the_verifiers_row_as_its_refusal_says(
    target_dir, tmp_path, monkeypatch
):
    """What the refusal of a learnt-mask head for --format speculators rests on: written anyway (the refusal
    lifted), speculators' mask slots read the verifier's row mask_token_id, not the learnt embedding."""
    model, path = target_dir
    head = block_head(model, "dflash")
    with pytest.raises(ValueError, match="train with block_mask: target, or export --format dflash"):
        export_head(head, tmp_path / "refused", "speculators", verifier=str(path))
    monkeypatch.setitem(LAYOUTS, "speculators", dataclasses.replace(LAYOUTS["speculators"], refusal=says_nothing))
    theirs, inputs = speculators_logits(model, path, head, tmp_path)
    assert (theirs["logits"][0] - our_anchored_logits(head, *inputs)[0]).abs().max().item() > 0.1
    head.config.block_mask = "target"  # the same weights, the mask slots on the target's row: speculators' reading
    assert (theirs["logits"][0] - our_anchored_logits(head, *inputs)[0]).abs().max().item() < ATOL


@pytest.mark.parametrize("method, window", [("dflash", None), ("dspark", None), ("dflash", 6), ("dspark", 6)], ids=str)
def test_a_head_speculators_trains_imports_with_its_logits(target_dir, tmp_path, method, window):
    """The other way: speculators' own DFlash / DSpark model (random weights, a reduced vocabulary, the verifier's
    embedding; full-attention layers, or its training default: sliding-window layers, causal blocks), saved by its
    save_pretrained, imports (`load_draft_head`) as a target-mask head that drafts speculators' logits at the same
    anchors."""
    from eagle_train.checkpoint import load_draft_head

    model, path = target_dir
    tc = model.config
    layer = {key: getattr(tc, key) for key in ("hidden_size", "intermediate_size", "num_attention_heads")}
    layer |= {"num_key_value_heads": tc.num_key_value_heads, "head_dim": 8, "vocab_size": tc.vocab_size}
    layer |= {"model_type": "qwen3", "num_hidden_layers": 2, "rms_norm_eps": tc.rms_norm_eps}
    if window:
        layer |= {"sliding_window": window, "use_sliding_window": True, "layer_types": ["sliding_attention"] * 2}
    config = {"transformer_layer_config": layer, "draft_vocab_size": 40, "block_size": 4}
    config |= {"sliding_window_non_causal": False}  # speculators' default: causal where the layers slide
    config |= {"aux_hidden_state_layer_ids": [1, 2, 3], "mask_token_id": tc.vocab_size - 1}
    if method == "dspark":
        config |= {"markov_rank": 4}
    aux, ids = random_context(model, 20)
    save_file({"hidden_states": aux, "input_ids": ids, "anchor_positions": ANCHORS}, tmp_path / "inputs.safetensors")
    request = {"op": "build_and_save", "library": "speculators", "model": method, "config": config, "seed": 2}
    request |= {"dir": str(tmp_path / "head"), "verifier": str(path), "inputs": str(tmp_path / "inputs.safetensors")}
    run_peer(request | {"out": str(tmp_path / "out.safetensors")})
    theirs = load_file(tmp_path / "out.safetensors")

    head = load_draft_head(tmp_path / "head", model).eval()
    assert (head.config.method, head.config.block_mask, head.config.draft_vocab_size) == (method, "target", 40)
    assert (head.config.sliding_window, head.config.causal) == (window, bool(window))
    logits, confidence = our_anchored_logits(head, aux, ids)
    difference = (theirs["logits"][0] - logits).abs().max().item()
    print(f"speculators' {method} imported: max |logit difference| {difference:.2e}")
    assert difference < ATOL
    if confidence is not None:
        assert (theirs["confidence_logits"][0] - confidence).abs().max().item() < ATOL
