"""The P-EAGLE head: vLLM tensor names, save/load, and train/serve consistency of the K parallel drafts."""

import pytest
import torch
from conftest import NH, NKV, VD, D, H, K, V, tiny_draft_config, tiny_head
from safetensors.torch import load_file

from eagle_train.checkpoint import load_draft_head
from eagle_train.methods.peagle import batch as pb
from eagle_train.methods.peagle.head import PEagleHead
from inference.drafting import TreeShape
from inference.parallel_drafting import ParallelDrafter
from inference.sampling import Sampler


def training_logits(head, aux, ids, anchor: int, k: int):
    """Training-mode logits of the chain at `anchor`: depth-0 elements 0..anchor plus (anchor, 1..k-1)."""
    a = torch.cat([torch.arange(anchor + 1), torch.full((k - 1,), anchor)])
    d = torch.cat([torch.zeros(anchor + 1, dtype=torch.long), torch.arange(1, k)])
    one = torch.ones(len(a), dtype=torch.bool)
    el = pb.Elements.stack([dict(anchor=a, depth=d, supervised=one, owned=one)])
    x, is_mask, tok, pos = pb.gather_inputs(el, ids, aux, head.config.mask_token_id)
    return head(x, is_mask, tok, pos, pb.dense_mask(el, head.config.sliding_window))[0, anchor:]


def parallel_drafts(head, k=K, max_len=32):
    """The runtime's P-EAGLE drafter over a fresh cache (greedy, eager)."""
    drafter = ParallelDrafter(head, TreeShape.chain(k), Sampler())
    drafter.setup_cache(max_len)
    return drafter


@pytest.mark.parametrize("window", [None, 3], ids=["full", "window-3"])
def test_parallel_drafts_equal_training_outputs(window):
    """Also for a head with a sliding window (speculators'), shorter than a chain here: a mask row sees the context
    within the window of its own position and, whatever the window, its chain."""
    head = tiny_head("peagle", num_hidden_layers=3, sliding_window=window).double()
    t = 14
    aux = torch.randn(1, t, 3 * H, dtype=torch.double)
    ids = torch.randint(0, V - 1, (1, t))
    drafter = parallel_drafts(head)
    with torch.no_grad():
        # The runtime first drafts from anchor 5 (prefill 0..5), then, after "verifying" 6..9,
        # drafts from anchor 9 over the same cache: the mask slots 6..8 written by the first call
        # must be overwritten, not read.
        _, first = drafter.catch_up(aux[:, :6], ids[:, 1:7], 0)
        _, second = drafter.catch_up_padded(aux[:, 6:10], ids[:, 7:11], 6)
        assert first.shape == (K, VD)
        assert (first - training_logits(head, aux, ids, 5, K)).abs().max() < 1e-10
        assert (second - training_logits(head, aux, ids, 9, K)).abs().max() < 1e-10
        tree = drafter.draft(ids[0, 10], None, second, 10)
    assert torch.equal(tree.tokens[1:], head.draft_to_target_ids(second.argmax(-1)))
    assert tree.parents.tolist() == [0, *range(K)] and tree.depths.tolist() == list(range(K + 1))  # a chain
    assert (second[1] - second[2]).abs().max() > 1e-3  # the slots really differ


def test_saved_tensors_follow_the_vllm_peagle_layout(tmp_path):
    head = tiny_head("peagle", num_hidden_layers=3)
    head.save_pretrained(tmp_path)
    shapes = {k: tuple(v.shape) for k, v in load_file(tmp_path / "model.safetensors").items()}
    assert shapes["embed_tokens.weight"] == (V, H)
    assert shapes["mask_hidden"] == (1, 1, 3 * H)
    assert shapes["midlayer.self_attn.q_proj.weight"] == (NH * D, 2 * H)
    assert shapes["midlayer.hidden_norm.weight"] == (H,)
    for i in (1, 2):
        assert shapes[f"layers.{i}.self_attn.q_proj.weight"] == (NH * D, H)
        assert shapes[f"layers.{i}.self_attn.k_proj.weight"] == (NKV * D, H)
        assert f"layers.{i}.hidden_norm.weight" not in shapes
    assert not any(k.startswith("layers.0.") or k.startswith("layers.3.") for k in shapes)
    assert shapes["lm_head.weight"] == (VD, H) and shapes["d2t"] == (VD,) and shapes["t2d"] == (V,)
    again = load_draft_head(tmp_path)
    assert isinstance(again, PEagleHead) and again.config.num_depths == K
    for k, v in head.saved_state_dict().items():
        assert torch.equal(v, again.state_dict()[k]), k


def test_config_without_mask_token_is_refused():
    cfg = tiny_draft_config(method="peagle")
    cfg.mask_token_id = None
    with pytest.raises(ValueError, match="mask_token_id"):
        PEagleHead(cfg)
