"""Training-time test loss: equal to a hand-computed reference, gradients only into the head."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import VD, H, V, as_target_logits, tiny_head

from eagle_train.hidden_states import TargetLogits
from eagle_train.methods.eagle3.head import Eagle3Head
from eagle_train.methods.eagle3.ttt import rows_used, ttt_loss
from eagle_train.training_parts import chain_rounds, simulated_acceptance_length, target_distribution


def random_batch(b=2, t=13, seed=0):
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(b, t, 3 * H, generator=g, dtype=torch.double)
    ids = torch.randint(0, V, (b, t), generator=g)
    mask = torch.rand(b, t, generator=g) < 0.7
    final = torch.randn(b, t, H, generator=g, dtype=torch.double)
    lm_head = torch.randn(V, H, generator=g, dtype=torch.double) * 0.5
    return aux, ids, mask, final, lm_head


def reference_losses(head, aux, ids, mask, final, lm_head, steps, rejection_weight=0.0):
    """Per-step (loss, acc, count) by the definition, one position at a time, through the runtime's
    cached draft step (step i's keys in slots [i*T, (i+1)*T), diagonal visibility); a row the chain
    walk rejects weighs 1 + rejection_weight in its step's mean."""
    b, t = ids.shape
    cache = head.new_cache(b, steps * t)
    full = final @ lm_head.T  # target logits [B, T, V]
    draft_targets = head.draft_to_target_ids(torch.arange(VD))  # target id of each draft id
    hidden, rows = head.fuse(aux), []
    window = head.config.sliding_window
    correct = torch.zeros(b, steps, t, dtype=torch.bool)
    for i in range(steps):
        vis = torch.zeros(t, steps * t, dtype=torch.bool)
        vis[:, :t] = torch.ones(t, t, dtype=torch.bool).tril().triu(1 - (window or t))
        for j in range(1, i + 1):
            vis[torch.arange(t), j * t + torch.arange(t)] = True
        step_ids = F.pad(ids[:, 1 + i :], (0, 1 + i))
        pos = (torch.arange(t)[None] + i).expand(b, t)
        hidden, logits = head.step(hidden, step_ids, pos, cache, torch.arange(i * t, (i + 1) * t), vis[None, None])
        rows.append([])
        for bb in range(b):
            for p in range(t):
                q = p + i + 1  # the target position this draft imitates; it predicts token q + 1
                if q + 1 >= t or not mask[bb, q + 1] or not head.t2d[full[bb, q].argmax()]:
                    continue
                target = torch.softmax(full[bb, q, draft_targets], -1)
                correct[bb, i, p] = logits[bb, p].argmax() == target.argmax()
                rows[i].append((bb, p, -(target * torch.log_softmax(logits[bb, p], -1)).sum()))
    _, rejected = chain_rounds(correct, mask)
    out = []
    for i, step_rows in enumerate(rows):
        n = len(step_rows)
        weights = torch.tensor([1 + rejection_weight * float(rejected[bb, i, p]) for bb, p, _ in step_rows])
        loss = sum(w * row[2] for w, row in zip(weights, step_rows)) / weights.sum() if n else torch.tensor(0.0)
        out.append((loss, sum(float(correct[bb, i, p]) for bb, p, _ in step_rows) / max(n, 1), n))
    return out


def test_target_distribution_is_the_target_softmax_on_the_draft_vocab():
    head = tiny_head().double()
    _, _, _, final, lm_head = random_batch()
    probs, in_draft = target_distribution(final, as_target_logits(lm_head), head.t2d)
    full = final.float() @ lm_head.float().T
    draft_targets = head.draft_to_target_ids(torch.arange(VD))
    assert torch.allclose(probs, torch.softmax(full[..., draft_targets], -1), atol=1e-6)
    assert torch.equal(in_draft, head.t2d[full.argmax(-1)])
    assert 0 < in_draft.float().mean() < 1  # the test exercises both cases
    # where the target's argmax is a draft token, the draft-vocab argmax maps back to it
    assert torch.equal(draft_targets[probs.argmax(-1)][in_draft], full.argmax(-1)[in_draft])


def test_with_in_draft_known_the_draft_rows_alone_give_the_same_distribution():
    head = tiny_head().double()
    _, _, mask, final, lm_head = random_batch(seed=6)
    target_logits = as_target_logits(lm_head)
    target_logits.scale, target_logits.softcap = 0.7, 2.0  # per-logit rules the restricted rows keep
    probs, in_draft = target_distribution(final, target_logits, head.t2d, mask)
    again, known = target_distribution(final, target_logits.restricted(head.t2d), head.t2d, mask, in_draft)
    assert known is in_draft and 0 < in_draft.float().mean() < 1
    assert torch.allclose(again, probs, atol=1e-6) and probs.any()
    with pytest.raises(ValueError, match="draft logits alone"):
        target_distribution(final, target_logits, head.t2d, mask, in_draft)


@pytest.mark.parametrize("fused_loss", [False, True])
def test_target_distribution_at_the_trained_positions_only_changes_no_loss_or_gradient(fused_loss):
    aux, ids, mask, final, lm_head = random_batch(seed=4, t=15)
    runs = []
    for loss_mask in (None, mask):
        head = tiny_head(seed=4).double()
        probs, in_draft = target_distribution(final, as_target_logits(lm_head), head.t2d, loss_mask)
        loss, metrics = ttt_loss(
            head, aux, ids, mask, probs.double(), in_draft, ttt_length=4, fused_loss=fused_loss, rejection_weight=1.0
        )
        loss.backward()
        runs.append((probs, metrics, {n: p.grad for n, p in head.named_parameters() if p.grad is not None}))
    (full, m0, g0), (part, m1, g1) = runs
    computed = torch.zeros_like(mask)
    computed[:, :-1] = mask[:, 1:]
    assert 0 < computed.float().mean() < 1  # some positions are skipped
    assert torch.allclose(part[computed], full[computed], atol=1e-6) and not part[~computed].any()
    for name in m0:  # the same rows at the same values: equal up to the fp32 lm_head's batch shape
        assert torch.allclose(m1[name].double(), m0[name].double(), atol=1e-5), name
    assert g0.keys() == g1.keys() and len(g0) > 10
    for name in g0:
        assert torch.allclose(g1[name], g0[name], atol=1e-5), name


def test_step0_loss_equals_hand_computed_cross_entropy_of_a_plain_forward():
    head = tiny_head(seed=1).double()
    aux, ids, mask, final, lm_head = random_batch(seed=1)
    probs, in_draft = target_distribution(final, as_target_logits(lm_head), head.t2d)
    with torch.no_grad():
        loss, metrics = ttt_loss(head, aux, ids, mask, probs.double(), in_draft, ttt_length=1)
        ((ref_loss, ref_acc, ref_n),) = reference_losses(head, aux, ids, mask, final, lm_head, 1)
    assert ref_n > 5
    assert metrics["count_0"] == ref_n
    assert abs(loss.item() - ref_loss.item()) < 1e-6
    assert abs(metrics["acc_0"].item() - ref_acc) < 1e-9


@pytest.mark.parametrize("fused_loss,rejection_weight", [(False, 0.0), (True, 0.0), (False, 3.0), (True, 3.0)])
def test_every_ttt_step_loss_matches_the_cached_runtime_reference(fused_loss, rejection_weight):
    head = tiny_head(seed=2).double()
    aux, ids, mask, final, lm_head = random_batch(seed=2, t=15)
    probs, in_draft = target_distribution(final, as_target_logits(lm_head), head.t2d)
    with torch.no_grad():
        loss, metrics = ttt_loss(
            head,
            aux,
            ids,
            mask,
            probs.double(),
            in_draft,
            ttt_length=4,
            decay=0.8,
            fused_loss=fused_loss,
            rejection_weight=rejection_weight,
        )
        ref = reference_losses(head, aux, ids, mask, final, lm_head, 4, rejection_weight)
    if rejection_weight:  # the weights moved the loss: rejected rows are some of the rows, not all
        plain = reference_losses(head, aux, ids, mask, final, lm_head, 4)
        assert abs(ref[0][0].item() - plain[0][0].item()) > 1e-3
    for i, (ref_loss, ref_acc, ref_n) in enumerate(ref):
        assert metrics[f"count_{i}"] == ref_n, f"step {i}"
        assert abs(metrics[f"loss_{i}"].item() - ref_loss.item()) < 1e-6, f"step {i}"
        assert abs(metrics[f"acc_{i}"].item() - ref_acc) < 1e-9, f"step {i}"
    assert ref[3][2] < ref[0][2]  # later steps lose positions at the end
    assert abs(loss.item() - sum(0.8**i * r[0].item() for i, r in enumerate(ref))) < 1e-6


@pytest.mark.parametrize(
    "variant",
    [
        {"norm_before_fc": True, "norm_before_residual": True, "norm_output": True, "sliding_window": 5},
        {"fc_norm": True, "qk_norm": True},
    ],
    ids=["speculators-defaults", "fc-norm-qwen3"],
)
@pytest.mark.parametrize("fused_loss", [False, True])
def test_a_head_of_speculators_variants_trains_as_its_runtime_drafts(variant, fused_loss):
    """The variants a head imported from speculators carries (DraftConfig.VARIANTS) act alike in training-time test
    and in the runtime's cached step: every step's loss equals the reference's, and each variant changes the loss
    (a variant the training path ignored would leave it as a plain head's)."""
    aux, ids, mask, final, lm_head = random_batch(seed=3, t=15)
    losses = {}
    for name, flags in [("variant", variant), *((key, {key: value}) for key, value in variant.items())]:
        head = tiny_head(seed=3, **flags).double()
        probs, in_draft = target_distribution(final, as_target_logits(lm_head), head.t2d)
        with torch.no_grad():
            _, metrics = ttt_loss(head, aux, ids, mask, probs.double(), in_draft, ttt_length=3, fused_loss=fused_loss)
            ref = reference_losses(head, aux, ids, mask, final, lm_head, 3)
        for i, (ref_loss, _, ref_n) in enumerate(ref):
            assert metrics[f"count_{i}"] == ref_n, (name, i)
            assert abs(metrics[f"loss_{i}"].item() - ref_loss.item()) < 1e-6, (name, i)
        losses[name] = [metrics[f"loss_{i}"].item() for i in range(3)]
    plain = tiny_head(seed=3).double()
    probs, in_draft = target_distribution(final, as_target_logits(lm_head), plain.t2d)
    with torch.no_grad():
        _, metrics = ttt_loss(plain, aux, ids, mask, probs.double(), in_draft, ttt_length=3)
    for name, per_step in losses.items():
        assert max(abs(a - metrics[f"loss_{i}"].item()) for i, a in enumerate(per_step)) > 1e-4, name


@pytest.mark.parametrize("fused_loss", [False, True])
def test_gradients_equal_the_cached_runtime_reference_and_unused_rows_cost_nothing(fused_loss):
    aux, ids, mask, final, lm_head = random_batch(seed=5, t=15)
    grads = []
    for use_ttt in (True, False):
        head = tiny_head(seed=5).double()
        full = final @ lm_head.T  # the reference's fp64 target, not target_distribution's fp32 one
        probs, in_draft = (
            torch.softmax(full[..., head.draft_to_target_ids(torch.arange(VD))], -1),
            head.t2d[full.argmax(-1)],
        )
        if use_ttt:
            loss, _ = ttt_loss(head, aux, ids, mask, probs, in_draft, ttt_length=3, fused_loss=fused_loss)
        else:
            ref = reference_losses(head, aux, ids, mask, final, lm_head, 3)
            loss = sum(0.8**i * r[0] for i, r in enumerate(ref))
        loss.backward()
        grads.append({n: p.grad for n, p in head.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 10
    for name in grads[0]:
        scale = grads[1][name].abs().max()  # RMSNorm normalises in fp32 even in an fp64 head
        assert (grads[0][name] - grads[1][name]).abs().max() <= 1e-5 * scale, name
    supervised_at = [mask[:, i + 2 :] & in_draft[:, i + 1 : -1] for i in range(3)]
    used = [rows_used(supervised_at, i, 15) for i in range(3)]
    assert 0 < used[2].sum() < used[0].sum() < mask.numel()  # the layer skips positions, fewer at later steps


def test_logit_checkpointing_gives_the_same_loss_and_gradients():
    aux, ids, mask, final, lm_head = random_batch(seed=3)
    grads = []
    for checkpoint_logits in (False, True):
        head = tiny_head(seed=3).double()
        probs, in_draft = target_distribution(final, as_target_logits(lm_head), head.t2d)
        loss, _ = ttt_loss(
            head, aux, ids, mask, probs.double(), in_draft, ttt_length=3, checkpoint_logits=checkpoint_logits
        )
        loss.backward()
        grads.append((loss.item(), {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}))
    (l0, g0), (l1, g1) = grads
    assert l0 == pytest.approx(l1, abs=1e-12)
    assert g0.keys() == g1.keys() and len(g0) > 10
    for n in g0:
        assert torch.allclose(g0[n], g1[n], atol=1e-12), n


def test_chain_rounds_hand_worked():
    """Row 0: one answer at 2..9, K=2. Rounds at anchors 1 (both drafts right: 3 tokens), 4 (first draft
    wrong), 5 (second wrong), 7 (its second draft would be x_10, past the text). Row 1: two answers, 3..4
    and 7..9, each its own generation."""
    correct = torch.zeros(2, 2, 10, dtype=torch.bool)
    correct[0, 0, [1, 5, 7]] = True
    correct[0, 1, [1, 4]] = True  # at 4 the first draft was wrong: its second never counts
    correct[1, 0, 7] = True
    mask = torch.zeros(2, 10, dtype=torch.bool)
    mask[0, 2:] = True
    mask[1, 3:5] = mask[1, 7:] = True
    rounds, rejected = chain_rounds(correct, mask)
    assert rounds == [(0, 1, 2), (0, 4, 0), (0, 5, 1), (0, 7, 1), (1, 2, 0), (1, 6, 0), (1, 7, 1)]
    assert sorted(map(tuple, rejected.nonzero().tolist())) == [
        (0, 0, 4),
        (0, 1, 5),
        (0, 1, 7),
        (1, 0, 2),
        (1, 0, 6),
        (1, 1, 7),
    ]


def test_simulated_acceptance_length():
    assert simulated_acceptance_length([]) == 1.0
    assert simulated_acceptance_length([1.0, 1.0, 1.0]) == 4.0
    assert simulated_acceptance_length([0.0, 1.0, 1.0]) == 1.0
    assert math.isclose(simulated_acceptance_length([0.8, 0.5, 0.5]), 1 + 0.8 + 0.4 + 0.2)


def test_gradients_reach_every_head_parameter_and_nothing_else(smollm2):
    """On the real target: aux states from the target, the loss's gradient lands in every head
    parameter, not in the frozen embedding and not in the target."""
    from eagle_train.hidden_states import target_hidden_states

    model, tokenizer = smollm2
    torch.manual_seed(0)
    head = Eagle3Head.from_target(model, draft_vocab_size=2048)
    ids = tokenizer("The quick brown fox jumps over the lazy dog, then it runs away.", return_tensors="pt").input_ids
    aux, final = target_hidden_states(model, ids)
    probs, in_draft = target_distribution(final, TargetLogits.of(model), head.t2d)
    mask = torch.ones_like(ids, dtype=torch.bool)
    assert in_draft.any()
    loss, _ = ttt_loss(head, aux, ids, mask, probs, in_draft, ttt_length=3)
    loss.backward()
    assert all(p.grad is None for p in model.parameters())
    assert head.embed_tokens.weight.grad is None
    assert head.embed_tokens.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    trainable = {n: p for n, p in head.named_parameters() if n != "embed_tokens.weight"}
    assert set(trainable) == {n for n, p in head.named_parameters() if p.requires_grad}
    for n, p in trainable.items():
        assert p.grad is not None and p.grad.abs().sum() > 0, n


def test_total_variation_loss_and_its_gradient_match_the_direct_computation():
    """step_loss with tv_weight w is (1 - w) CE + w TV(p, softmax(z)) per row, and its gradient with
    respect to the logits is the analytic one: dTV/dz_j = 0.5 q_j (s_j - sum_k s_k q_k), s = sign(q - p)."""
    from types import SimpleNamespace

    from eagle_train.methods.eagle3.ttt import step_loss

    torch.manual_seed(0)
    logits = torch.randn(5, VD, dtype=torch.float64, requires_grad=True)
    p = torch.softmax(3 * torch.randn(5, VD, dtype=torch.float64), -1)
    head = SimpleNamespace(logits=lambda h: h)
    w = 0.3
    loss, correct = step_loss(head, logits, p, tv_weight=w)
    loss = loss.sum()
    q = torch.softmax(logits.detach(), -1)
    ce = -(p * torch.log(q)).sum()
    tv = 0.5 * sum(abs(p[r, j] - q[r, j]) for r in range(5) for j in range(VD))
    torch.testing.assert_close(loss.detach(), (1 - w) * ce + w * tv)
    assert torch.equal(correct, q.argmax(-1) == p.argmax(-1))
    loss.backward()
    s = torch.sign(q - p)
    grad_tv = 0.5 * q * (s - (s * q).sum(-1, keepdim=True))
    grad_ce = q - p  # of -sum p log softmax(z), rows of p summing to 1
    torch.testing.assert_close(logits.grad, (1 - w) * grad_ce + w * grad_tv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_cpu_loss_is_the_eager_one(dtype):
    """On a CPU, step_loss runs `loss_rows` compiled (its passes over the [N, Vd] rows fused); it gives the eager
    loss, gradient and agreement. Bounds: the compiled sums over Vd terms run in another order, each off by at most
    Vd x fp32's unit roundoff relative (8192 x 6e-8 = 5e-4); bf16 logits get bf16 gradients, one bf16 step apart
    (2**-7 relative) where that order rounds them the other way."""
    from eagle_train.training_parts import compiled_loss_rows, loss_rows

    compiled = compiled_loss_rows()
    assert compiled is not loss_rows, "torch.compile does not work on this machine"
    torch.manual_seed(0)
    n, vd = 300, 8192
    z = (2 * torch.randn(n, vd)).to(dtype)
    z[torch.arange(n), torch.randint(vd, (n,))] += 8  # one clear argmax per row: no ties for argmax to break
    p = torch.softmax(3 * torch.randn(n, vd), -1)
    p[torch.arange(n // 2), z[: n // 2].float().argmax(-1)] += 1  # half the rows agree with the draft
    p = p / p.sum(-1, keepdim=True)
    got, want = z.clone().requires_grad_(), z.clone().requires_grad_()
    loss, agree = compiled(got, p, 0.5)
    ref, ref_agree = loss_rows(want, p, 0.5)
    (loss * torch.linspace(0.5, 1.5, n)).sum().backward()
    (ref * torch.linspace(0.5, 1.5, n)).sum().backward()
    torch.testing.assert_close(loss, ref, rtol=5e-4, atol=0)
    assert torch.equal(agree, ref_agree) and 0 < agree.sum() < n
    rtol = 5e-4 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(got.grad.float(), want.grad.float(), rtol=rtol, atol=1e-7)


def test_without_a_working_compiler_the_loss_runs_eagerly_and_says_so(monkeypatch):
    from eagle_train import training_parts

    def no_compiler(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    training_parts.compiled_loss_rows.cache_clear()
    monkeypatch.setattr(torch, "compile", no_compiler)
    try:
        with pytest.warns(UserWarning, match="torch.compile does not work here"):
            assert training_parts.compiled_loss_rows() is training_parts.loss_rows
    finally:
        training_parts.compiled_loss_rows.cache_clear()


def test_the_runtime_drafter_reads_the_window_training_time_test_reads():
    """A head with a sliding window (speculators trains one) drafts in the runtime from the keys training-time test
    trained it on: the catch-up row of the last position gives step 0's logits there, and the chain's next draft step
    step 1's (whose step-0 keys are the anchor's window, as speculators' training reads them)."""
    from inference.drafting import Drafter, TreeShape
    from inference.sampling import Sampler

    length = 11
    g = torch.Generator().manual_seed(4)
    aux = torch.randn(1, length, 3 * H, generator=g)
    x = torch.randint(0, V, (1, length + 2), generator=g)  # x_0 .. x_{L+1}
    for window in (4, None):
        head = tiny_head(seed=4, sliding_window=window, norm_output=True).eval()
        steps = []

        def step(*args, head=head, steps=steps):
            h, logits = head.step(*args)
            steps.append(logits)
            return h, logits

        drafter = Drafter(head, TreeShape.chain(2), Sampler())
        drafter.step_fn = step
        drafter.setup_cache(length + 2)
        with torch.no_grad():
            h_root, logits_root = drafter.catch_up(aux, x[:, 1 : length + 1], 0)
            tree = drafter.draft(x[0, length], h_root, logits_root, length)  # the root: the pending token x_L
            x[0, length + 1] = tree.tokens[1]  # the token step 1 reads at the last anchor: the first draft
            positions, past = torch.arange(length)[None], []
            h0 = head.ttt_step(head.fuse(aux), x[:, 1 : length + 1], positions, past)
            h1 = head.ttt_step(h0, x[:, 2 : length + 2], positions + 1, past)
        torch.testing.assert_close(logits_root, head.logits(h0)[0, -1], atol=1e-5, rtol=0)
        torch.testing.assert_close(steps[0][0, 0], head.logits(h1)[0, -1], atol=1e-5, rtol=0)
        if window:
            windowed = logits_root
    assert (windowed - logits_root).abs().max() > 1e-3  # the window changed what the head reads
