"""The block drafters (DFlash, DSpark): the training loss equals a block-by-block computation through the
runtime's cached path, gradients included, and no block reads a state it could not have at run time."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY_BLOCK, VD, H, V, as_target_logits, tiny_head, tiny_target

from eagle_train.checkpoint import load_draft_head
from eagle_train.methods.block.head import block_attention_mask
from eagle_train.methods.block.loss import block_loss, sample_anchors
from eagle_train.training_parts import target_distribution


def random_batch(b=2, t=15, seed=0):
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(b, t, 3 * H, generator=g, dtype=torch.double)
    ids = torch.randint(0, V - 1, (b, t), generator=g)
    mask = torch.rand(b, t, generator=g) < 0.7
    final = torch.randn(b, t, H, generator=g, dtype=torch.double)
    lm_head = torch.randn(V, H, generator=g, dtype=torch.double) * 0.5
    return aux, ids, mask, final, lm_head


def reference_loss(head, aux, ids, mask, final, lm_head, anchors, valid, gamma, tv_weight, confidence_weight):
    """The loss by the definition, one block at a time through the runtime's path: a fresh cache holding the
    context before the anchor (`write_context`), then `draft_block` at positions a..a+B-1."""
    b, t = ids.shape
    size = head.config.block_size
    full = final @ lm_head.T
    draft_targets = head.draft_to_target_ids(torch.arange(VD))
    terms, weights, bces = [], [], []
    for row in range(b):
        for a, ok in zip(anchors[row].tolist(), valid[row].tolist()):
            if not ok:
                continue
            cache = head.new_cache(1, a + size)
            head.write_context(cache, aux[row : row + 1, :a], torch.arange(a)[None], torch.arange(a))
            positions = torch.arange(a, a + size)
            h = head.draft_block(
                cache,
                ids[row, a : a + 1],
                positions[None],
                positions,
                block_attention_mask(torch.tensor([a]), size, a + size, head.config.causal),
            )[0]
            for j in range(1, h.shape[0] + 1):
                q = a + j - 1  # the target position whose distribution predicts x_{a+j}
                if a + j >= t or not mask[row, a + j] or not head.t2d[full[row, q].argmax()]:
                    continue
                logits, confidence = head.draft_logits(h[j - 1], ids[row, q])
                target = torch.softmax(full[row, q, draft_targets], -1)
                log_q = torch.log_softmax(logits, -1)
                ce = -(target * log_q).sum()
                tv = 0.5 * (target - log_q.exp()).abs().sum()
                w = math.exp(-(j - 1) / gamma)
                terms.append(w * ((1 - tv_weight) * ce + tv_weight * tv))
                weights.append(w)
                if confidence is not None:
                    accepted = (1 - tv).detach().clamp(0, 1)  # draft j's chance of acceptance when sampled
                    bces.append(w * F.binary_cross_entropy_with_logits(confidence, accepted))
    total = sum(terms) / sum(weights)
    if bces:
        total = total + confidence_weight * sum(bces) / sum(weights)
    return total


@pytest.mark.parametrize("method,causal", [("dflash", False), ("dflash", True), ("dspark", False)])
def test_block_loss_equals_block_by_block_reference_with_gradients(method, causal):
    head = tiny_head(method, causal=causal).double()
    aux, ids, mask, final, lm_head = random_batch()
    probs, in_draft = target_distribution(final, as_target_logits(lm_head), head.t2d, mask)
    anchors, valid = sample_anchors(mask, 5, torch.Generator().manual_seed(1))
    assert valid.sum() >= 6
    options = dict(gamma=2.5, tv_weight=0.3, confidence_weight=0.7)

    loss, metrics = block_loss(head, aux, ids, mask, probs.double(), in_draft, anchors, valid, **options)
    grads = torch.autograd.grad(loss, [p for p in head.parameters() if p.requires_grad])
    want = reference_loss(head, aux, ids, mask, final, lm_head, anchors, valid, **options)
    want_grads = torch.autograd.grad(want, [p for p in head.parameters() if p.requires_grad])

    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-7)  # target probs pass through fp32
    for got, expected in zip(grads, want_grads):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)
    assert metrics["count_rounds"] > 0 and metrics["count_chain_tokens"] >= metrics["count_rounds"]
    assert ("confidence_bce" in metrics) == (method == "dspark")


def test_anchors_read_only_states_the_runtime_has():
    """Anchors lie in [1, T-2], assistant tokens with an assistant token next; a block's output ignores every
    state from its anchor on (the state at a sample's last position is zero in a vLLM store)."""
    head = tiny_head("dflash").double()
    aux, ids, mask, *_ = random_batch(b=3, t=20)
    anchors, valid = sample_anchors(mask, 50, torch.Generator().manual_seed(0))
    for row in range(3):
        picked = anchors[row][valid[row]]
        assert len(set(picked.tolist())) == len(picked) == int((mask[row, 1:-1] & mask[row, 2:]).sum())
        assert all(1 <= a <= 18 and mask[row, a] and mask[row, a + 1] for a in picked.tolist())
    h = head.forward_blocks(aux, ids, anchors)
    changed = aux.clone()
    row, i = valid.nonzero()[0].tolist()
    a = int(anchors[row, i])
    changed[row, a:] = torch.randn_like(changed[row, a:])
    torch.testing.assert_close(head.forward_blocks(changed, ids, anchors)[row, i], h[row, i], rtol=0, atol=0)


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_the_published_recipe_drafts_through_the_targets_mask_row_and_lm_head(method, tmp_path):
    """block_mask: target and block_lm_head: target: the mask slots are the target's row mask_token_id and the drafts
    its lm_head, neither trained nor saved; the head reloaded on the target drafts the same."""
    target = tiny_target()
    options = dict(TINY_BLOCK[method], block_mask="target", block_lm_head="target", draft_vocab_size=V)
    head = tiny_head(method, target_model=target, **options).double()
    saved = head.saved_state_dict()
    assert "mask_embedding" not in saved and "lm_head.weight" not in saved and "embed_tokens.weight" not in saved
    trainable = {n for n, p in head.named_parameters() if p.requires_grad}
    assert "lm_head.weight" not in trainable and "embed_tokens.weight" not in trainable

    anchors = torch.tensor([[2, 6]])
    embedded = head.block_embeddings(anchors, anchors.shape)
    mask_row = target.get_input_embeddings().weight[head.config.mask_token_id].double()
    assert torch.equal(embedded[0, 0, 1:], mask_row.expand(head.config.block_size - 1, -1))
    aux, ids, *_ = random_batch(b=1, t=12)
    h = head.forward_blocks(aux, ids, anchors)
    unbiased = head.slot_logits(h)[1]
    torch.testing.assert_close(unbiased, target.lm_head(head.norm(h).float()).double(), rtol=1e-5, atol=1e-5)

    head.float().save_pretrained(tmp_path / "head")
    back = load_draft_head(tmp_path / "head", target).double()
    torch.testing.assert_close(back.slot_logits(back.forward_blocks(aux, ids, anchors))[1], unbiased)
