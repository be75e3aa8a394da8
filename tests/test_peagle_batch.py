"""P-EAGLE training layout: depth sampling, the attention rule (hand-worked), exact partitioning."""

import pytest
import torch
from conftest import H, K, V, as_target_logits, tiny_head

from eagle_train.methods.peagle import batch as pb
from eagle_train.methods.peagle.train import PEagleObjective
from eagle_train.training_parts import target_distribution

KEPT = [i for i in range(V) if i % 5 != 3]  # a draft vocabulary that is not a prefix: all ids but 3, 8, ...


def test_attention_rule_hand_worked():
    """Row 0: length 5, depth-1 chains at anchors 1, 2 and a depth-2 chain at 1.
    Row 1: length 3 (anchors 0, 1), padded to the same width."""
    rows = [
        dict(anchor=torch.tensor([0, 1, 2, 3, 1, 2, 1]), depth=torch.tensor([0, 0, 0, 0, 1, 1, 2])),
        dict(anchor=torch.tensor([0, 1]), depth=torch.tensor([0, 0])),
    ]
    for r in rows:
        r["supervised"] = r["owned"] = torch.ones(len(r["anchor"]), dtype=torch.bool)
    mask = pb.dense_mask(pb.Elements.stack(rows))
    #            keys: (0,0) (1,0) (2,0) (3,0) (1,1) (2,1) (1,2)
    expected_0 = [
        [1, 0, 0, 0, 0, 0, 0],  # (0,0)
        [1, 1, 0, 0, 0, 0, 0],  # (1,0)
        [1, 1, 1, 0, 0, 0, 0],  # (2,0)
        [1, 1, 1, 1, 0, 0, 0],  # (3,0)
        [1, 1, 0, 0, 1, 0, 0],  # (1,1): depth 0 up to anchor 1, itself
        [1, 1, 1, 0, 0, 1, 0],  # (2,1): depth 0 up to anchor 2, itself
        [1, 1, 0, 0, 1, 0, 1],
    ]  # (1,2): depth 0 up to anchor 1, (1,1), itself
    #            keys: (0,0) (1,0) pad x5
    expected_1 = [[1, 0, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0]] + [
        [0, 0, 1, 1, 1, 1, 1]
    ] * 5  # padding sees only padding
    assert mask.shape == (2, 1, 7, 7)
    assert mask[0, 0].int().tolist() == expected_0
    assert mask[1, 0].int().tolist() == expected_1


def test_depth_sampling_nested_seeded_and_sized():
    t = 400
    loss_mask = torch.zeros(t, dtype=torch.bool)
    loss_mask[50:350] = True
    in_draft = torch.ones(t, dtype=torch.bool)
    in_draft[100:110] = False
    anchor, depth = pb.sample_chains(loss_mask, in_draft, t, 8, torch.Generator().manual_seed(1))
    again = pb.sample_chains(loss_mask, in_draft, t, 8, torch.Generator().manual_seed(1))
    assert torch.equal(anchor, again[0]) and torch.equal(depth, again[1])
    assert torch.equal(anchor[depth == 0], torch.arange(t - 1))
    n = int(pb.is_supervised(torch.arange(t - 1), 0, loss_mask, in_draft, t).sum())
    assert n == 300 - 10
    for d in range(1, 8):
        here, before = set(anchor[depth == d].tolist()), set(anchor[depth == d - 1].tolist())
        assert here <= before, f"depth {d} chains are not extensions of depth {d - 1} chains"
        assert len(here) == round(n * max(0.7**d, 0.2)), d
        sup = pb.is_supervised(anchor[depth == d], d, loss_mask, in_draft, t)
        assert sup.all()  # depth >= 1 elements are only sampled where they are trained
    other = pb.sample_chains(loss_mask, in_draft, t, 8, torch.Generator().manual_seed(2))
    assert not torch.equal(anchor, other[0])


def random_batch(seed=0, b=2, t=23, lengths=(23, 17), lm_head=None, trained_positions_only=False):
    """A trainer-style batch; the target distribution comes from `ttt.target_distribution` (at every position, or
    where the trainer computes it)."""
    g = torch.Generator().manual_seed(seed)
    loss_mask = torch.rand(b, t, generator=g) < 0.7
    for i, n in enumerate(lengths):
        loss_mask[i, n:] = False
    lm_head = torch.randn(V, H, generator=g, dtype=torch.double) * 3 if lm_head is None else lm_head
    final = torch.randn(b, t, H, generator=g, dtype=torch.double)
    t2d = tiny_head("peagle", draft_ids=KEPT).t2d
    probs, in_draft = target_distribution(
        final, as_target_logits(lm_head), t2d, loss_mask if trained_positions_only else None
    )
    return dict(
        input_ids=torch.randint(0, V - 1, (b, t), generator=g),
        loss_mask=loss_mask,
        aux_hidden=torch.randn(b, t, 3 * H, generator=g, dtype=torch.double),
        target_probs=probs,
        in_draft=in_draft,
    )


def runner(head):
    """The trainer's HeadRunner protocol: model(fn, *args) = fn(head, *args)."""
    return lambda fn, *args: fn(head, *args)


def gradients(head, batch, segments):
    head.zero_grad()
    torch.manual_seed(3)  # the same depth sampling for every segment count
    metrics = PEagleObjective(K, num_segments=segments)(runner(head), batch, lambda loss: loss.backward())
    return {n: p.grad.clone() for n, p in head.named_parameters()}, metrics


def test_partitioned_gradients_equal_unpartitioned():
    head = tiny_head("peagle", draft_ids=KEPT).double()
    batch = random_batch()
    ref, ref_metrics = gradients(head, batch, 1)
    assert ref_metrics["count_3"] > 0  # deep chains exist
    for s in (2, 4):
        got, metrics = gradients(head, batch, s)
        assert torch.allclose(metrics["loss"], ref_metrics["loss"], rtol=1e-10)
        for name, g in ref.items():
            assert g.abs().max() > 0, name
            rel = (got[name] - g).norm() / g.norm()
            assert rel < 1e-5, f"S={s} {name}: relative error {rel:.2e}"


def test_target_distribution_at_the_trained_positions_only_changes_no_gradient():
    head = tiny_head("peagle", draft_ids=KEPT).double()
    ref, ref_metrics = gradients(head, random_batch(), 1)
    got, metrics = gradients(head, random_batch(trained_positions_only=True), 1)
    assert ref_metrics["count_3"] > 0
    for name in ref_metrics:
        assert torch.allclose(metrics[name].double(), ref_metrics[name].double(), atol=1e-5), name
    for name, g in ref.items():
        assert g.abs().max() > 0 and torch.allclose(got[name], g, atol=1e-5), name


@pytest.mark.parametrize("tv_weight", [0.0, 0.4])
def test_loss_equals_a_direct_reference(tv_weight):
    """The objective's loss is the mean soft CE (mixed with total variation by tv_weight) over supervised
    elements, recomputed here from plain logits of the unpartitioned forward and the target distribution at a+d+1."""
    head = tiny_head("peagle", draft_ids=KEPT).double()
    batch = random_batch(1)
    torch.manual_seed(5)
    metrics = PEagleObjective(K, num_segments=3, tv_weight=tv_weight)(runner(head), batch, lambda loss: None)
    torch.manual_seed(5)
    lengths = torch.tensor([int(m.nonzero().max()) + 1 for m in batch["loss_mask"]])
    el = pb.build_elements(batch["loss_mask"], batch["in_draft"], lengths, K)
    with torch.no_grad():
        logits = head(*pb.gather_inputs(el, batch["input_ids"], batch["aux_hidden"], V - 1), pb.dense_mask(el))
    target = pb.gather_targets(el, batch["target_probs"])
    log_q = torch.log_softmax(logits, -1)
    ce = -(target * log_q).sum(-1)
    tv = 0.5 * (target - log_q.exp()).abs().sum(-1)
    want = ((1 - tv_weight) * ce + tv_weight * tv)[el.supervised]
    assert torch.allclose(metrics["loss"], want.mean(), rtol=1e-10)
    for d in range(K):
        assert metrics[f"count_{d}"] == (el.depth[el.supervised] == d).sum()


def test_partition_owns_each_element_once_and_carries_left_context():
    g = torch.Generator().manual_seed(0)
    batch = random_batch()
    in_draft = torch.ones_like(batch["loss_mask"])
    el = pb.build_elements(batch["loss_mask"], in_draft, torch.tensor([23, 17]), K, g)
    segs = pb.partition(el, 4, 23)
    for b in range(2):
        owned = sorted(
            (a, d)
            for s in segs
            for a, d, o in zip(s.row(b)["anchor"].tolist(), s.row(b)["depth"].tolist(), s.row(b)["owned"])
            if o
        )
        assert owned == sorted(zip(el.row(b)["anchor"].tolist(), el.row(b)["depth"].tolist()))
    last = segs[-1].row(0)
    context = ~last["owned"]
    assert (last["depth"][context] == 0).all() and context.sum() > 0
    assert not last["supervised"][context].any()
    # Memory is bounded: no segment computes as many elements as the whole batch.
    assert max(s.anchor.shape[1] for s in segs) < el.anchor.shape[1]


def test_unsupervised_elements_do_not_count():
    head = tiny_head("peagle", draft_ids=KEPT).double()
    batch = random_batch()
    batch["loss_mask"][:] = False
    metrics = PEagleObjective(K, 2)(runner(head), batch, lambda loss: loss.backward())
    assert metrics["loss"] == 0 and all(metrics[f"count_{d}"] == 0 for d in range(K))


def test_default_num_segments():
    assert pb.default_num_segments(512, 7) == 1
    assert pb.default_num_segments(2048, 7) == 2
    assert pb.default_num_segments(8192, 8) == 7


@pytest.mark.gpu
def test_block_mask_equals_dense_mask_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator().manual_seed(0)
    batch = random_batch(t=300, lengths=(300, 200))
    el = pb.build_elements(batch["loss_mask"], torch.ones_like(batch["loss_mask"]), torch.tensor([300, 200]), K, g)
    dense = pb.dense_mask(el)
    block = pb.block_mask(el.to("cuda"))
    q, k = torch.meshgrid(torch.arange(dense.shape[2]), torch.arange(dense.shape[3]), indexing="ij")
    for b in range(2):
        assert torch.equal(block.mask_mod(b, 0, q.cuda(), k.cuda()).cpu(), dense[b, 0])
    head = tiny_head("peagle", draft_ids=KEPT, head_dim=16).cuda()  # compiled FlexAttention needs head_dim >= 16
    aux, is_mask, ids, pos = pb.gather_inputs(el, batch["input_ids"], batch["aux_hidden"].float(), V - 1)
    args = [x.cuda() for x in (aux, is_mask, ids, pos)]
    with torch.no_grad():
        want = head(*args, dense.cuda())
        got = head(*args, block)
    real = el.document.cuda() >= 0
    assert (want - got)[real].abs().max() < 1e-3 * want.abs().max()


@pytest.mark.gpu
def test_partitioned_gradients_with_block_masks_on_cuda_equal_cpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    head = tiny_head("peagle", draft_ids=KEPT, head_dim=16)
    batch = {k: v.float() if v.is_floating_point() else v for k, v in random_batch().items()}
    ref, _ = gradients(head, batch, 1)
    head = head.cuda()
    for s in (1, 3):
        got, _ = gradients(head, {k: v.cuda() for k, v in batch.items()}, s)
        for name, g in ref.items():
            assert (got[name].cpu() - g).norm() <= 1e-4 * g.norm(), (s, name)
