"""The fused lm_head + soft cross-entropy equals the plain log_softmax computation, value and gradient."""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from eagle_train.fused_ce import soft_cross_entropy

HAS_TRITON = importlib.util.find_spec("triton") is not None


def reference(hidden, weight, probs, tv_weight=0.0):
    logits = hidden @ weight.t()
    log_q = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    loss = -(probs * log_q).sum(-1)
    if tv_weight:
        loss = (1 - tv_weight) * loss + tv_weight * 0.5 * (probs - log_q.exp()).abs().sum(-1)
    return loss, logits.argmax(-1) == probs.argmax(-1)


def make_inputs(n=37, h=24, v=1000, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=dtype) * 2
    weight = torch.randn(v, h, generator=g, dtype=dtype)
    probs = torch.softmax(torch.randn(n, v, generator=g, dtype=dtype) * 3, dim=-1)
    probs[5] = 0  # a padded row (shift_left fills with zeros): loss and gradient must be 0
    probs[7] *= 0.5  # mass != 1 must still give the exact gradient
    upstream = torch.randn(n, generator=g, dtype=torch.float32)
    return hidden, weight, probs, upstream


def grads(fn, hidden, weight, probs, upstream):
    hidden = hidden.clone().requires_grad_(True)
    weight = weight.clone().requires_grad_(True)
    loss, agree = fn(hidden, weight, probs)
    (loss.double() * upstream.double()).sum().backward()
    return loss.detach(), agree, hidden.grad, weight.grad


@pytest.mark.parametrize("chunk_size", [128, 333, 1000, 4096])
def test_matches_log_softmax_reference_fp64(chunk_size):
    inputs = make_inputs()
    want = grads(reference, *inputs)
    got = grads(lambda h, w, p: soft_cross_entropy(h, w, p, chunk_size=chunk_size, impl="chunked"), *inputs)
    for a, b in zip(got, want):
        if a.dtype == torch.bool:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert float(got[0][5]) == 0.0 and float(got[2][5].abs().max()) == 0.0


@pytest.mark.parametrize("tv_weight", [0.3, 1.0])
@pytest.mark.parametrize("chunk_size", [128, 1000])
def test_total_variation_mix_matches_the_direct_computation_fp64(chunk_size, tv_weight):
    """tv_weight w: each row's loss is (1 - w) CE + w TV(p, softmax(z)), value and gradient as autograd
    differentiates the direct computation (TV's two-pass chunked forward and its analytic backward)."""
    inputs = make_inputs()
    want = grads(lambda h, w, p: reference(h, w, p, tv_weight), *inputs)
    got = grads(
        lambda h, w, p: soft_cross_entropy(h, w, p, chunk_size=chunk_size, impl="chunked", tv_weight=tv_weight),
        *inputs,
    )
    for a, b in zip(got, want):
        if a.dtype == torch.bool:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    ce = grads(lambda h, w, p: soft_cross_entropy(h, w, p, chunk_size=chunk_size), *inputs)
    assert (got[0] - ce[0]).abs().max() > 1e-3  # the mix is not CE under another name


def test_matches_reference_fp32():
    hidden, weight, probs, upstream = make_inputs(n=64, h=32, v=2048, dtype=torch.float32, seed=1)
    want = grads(reference, hidden, weight, probs, upstream)
    got = grads(lambda h, w, p: soft_cross_entropy(h, w, p, chunk_size=500), hidden, weight, probs, upstream)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-4)
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[2], want[2], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[3], want[3], rtol=1e-4, atol=1e-5)


def test_target_rows_pick_rows_of_a_shared_probs_tensor():
    """Passing the whole batch's probs once plus row indices == passing the gathered rows."""
    hidden, weight, probs, upstream = make_inputs(n=20, v=300)
    rows = torch.randperm(20, generator=torch.Generator().manual_seed(3))[:12]
    h = hidden[:12]
    want = grads(lambda a, b, p: soft_cross_entropy(a, b, p[rows], chunk_size=64), h, weight, probs, upstream[:12])
    got = grads(
        lambda a, b, p: soft_cross_entropy(a, b, p, target_rows=rows, chunk_size=64), h, weight, probs, upstream[:12]
    )
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_saves_no_vocab_sized_tensor_for_backward():
    """What backward keeps is hidden, weight, probs and O(N) rows: no [N, Vd] logits or log-probs."""
    hidden, weight, probs, _ = make_inputs(n=50, h=16, v=4000, dtype=torch.float32)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        soft_cross_entropy(hidden, weight, probs, chunk_size=512)[0].sum()
    big = [tuple(t.shape) for t in saved if t.numel() >= 50 * 4000 and t.data_ptr() != probs.data_ptr()]
    assert big == []
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        saved.clear()
        reference(hidden, weight, probs)[0].sum()
    assert any(t.numel() >= 50 * 4000 and t.data_ptr() != probs.data_ptr() for t in saved)  # the check can fail


def test_bad_input_is_refused_before_compute():
    hidden, weight, probs, _ = make_inputs(n=8, v=10)
    with pytest.raises(ValueError, match="target_probs"):
        soft_cross_entropy(hidden, weight, probs[:, :9])
    with pytest.raises(ValueError, match="target_rows"):
        soft_cross_entropy(hidden, weight, torch.cat([probs, probs]))
    with pytest.raises(ValueError, match="no_grad"):
        soft_cross_entropy(hidden, weight, probs.clone().requires_grad_(True))


def test_real_smollm2_head_loss(smollm2):
    """On SmolLM2's real hidden states and target distribution over a 32k draft vocab, the fused
    loss and gradient equal the TTT reference (`lm_head(norm(h))`, log_softmax) in fp32."""
    from eagle_train.hidden_states import target_hidden_states
    from eagle_train.methods.eagle3.head import Eagle3Head

    model, tokenizer = smollm2
    ids = tokenizer("The capital of France is Paris. The capital of Italy is", return_tensors="pt")["input_ids"]
    aux, final = target_hidden_states(model, ids)
    torch.manual_seed(0)
    head = Eagle3Head.from_target(model)
    vd, v = head.config.draft_vocab_size, head.config.vocab_size
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[torch.randperm(v)[:vd]] = True
    t2d[model.lm_head(final).argmax(-1)] = True
    t2d[torch.nonzero(t2d).squeeze(1)[vd:]] = False  # exactly vd ids, the target's argmaxes kept
    probs = torch.softmax(model.lm_head(final)[0][:, t2d], dim=-1)
    x = head.norm(head.fc(aux))[0].detach()
    want = grads(reference, x, head.lm_head.weight.detach(), probs, torch.ones(x.shape[0]))
    got = grads(
        lambda h, w, p: soft_cross_entropy(h, w, p, chunk_size=4096),
        x,
        head.lm_head.weight.detach(),
        probs,
        torch.ones(x.shape[0]),
    )
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-4)
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[2], want[2], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(got[3], want[3], rtol=1e-4, atol=1e-6)


TRITON_CHECK = """
import torch
from eagle_train.fused_ce import soft_cross_entropy
from tests.test_fused_ce import make_inputs, grads, reference
hidden, weight, probs, upstream = make_inputs(n=70, h=40, v=300, dtype=torch.float32, seed=2)
want = grads(reference, hidden, weight, probs, upstream)
got = grads(lambda h, w, p: soft_cross_entropy(h, w, p, chunk_size=128, impl="triton"), hidden, weight, probs, upstream)
torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-4)
assert torch.equal(got[1], want[1])
torch.testing.assert_close(got[2], want[2], rtol=1e-4, atol=1e-5)
torch.testing.assert_close(got[3], want[3], rtol=1e-4, atol=1e-5)
# loss.sum(): its gradient reaches backward as a stride-0 view; target_rows a strided view
def sum_grads(fn):
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    fn(h, w)[0].sum().backward()
    return h.grad, w.grad
big, rows = torch.cat([probs, probs]), torch.arange(140)[::2]
want = sum_grads(lambda h, w: reference(h, w, big[rows]))
got = sum_grads(lambda h, w: soft_cross_entropy(h, w, big, target_rows=rows, impl="triton"))
for a, b in zip(got, want):
    torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)
# mixed with total variation: its own kernel's second pass and the mix's gradient
for tv_weight in (0.3, 1.0):
    want = grads(lambda h, w, p: reference(h, w, p, tv_weight), hidden, weight, probs, upstream)
    got = grads(lambda h, w, p: soft_cross_entropy(h, w, p, chunk_size=128, impl="triton", tv_weight=tv_weight),
                hidden, weight, probs, upstream)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[2], want[2], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[3], want[3], rtol=1e-4, atol=1e-5)
from eagle_train.fused_ce import triton_works
assert triton_works("cpu")  # the self-check "auto" runs before it picks Triton on a device
print("ok")
"""


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_kernels_in_the_interpreter():
    """The Triton kernels' logic, run by Triton's CPU interpreter (TRITON_INTERPRET=1 must be set
    before triton is imported, hence the subprocess)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=root)
    out = subprocess.run(
        [sys.executable, "-c", TRITON_CHECK], env=env, capture_output=True, text=True, cwd=root, timeout=300
    )
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not HAS_TRITON, reason="needs CUDA and triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tv_weight", [0.0, 0.5])
def test_triton_matches_chunked_on_cuda(dtype, tv_weight):
    hidden, weight, probs, upstream = make_inputs(n=1000, h=576, v=32000, dtype=torch.float32, seed=4)
    cuda = [t.cuda() for t in (hidden.to(dtype), weight.to(dtype), probs, upstream)]
    want = grads(lambda h, w, p: soft_cross_entropy(h, w, p, impl="chunked", tv_weight=tv_weight), *cuda)
    got = grads(lambda h, w, p: soft_cross_entropy(h, w, p, impl="triton", tv_weight=tv_weight), *cuda)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got[0], want[0], **tol)
    assert (got[1] == want[1]).float().mean() > 0.99
    torch.testing.assert_close(got[2].float(), want[2].float(), **tol)
    torch.testing.assert_close(got[3].float(), want[3].float(), **tol)
    if dtype == torch.float32:
        ref = grads(lambda h, w, p: reference(h, w, p, tv_weight), *cuda)
        torch.testing.assert_close(got[0], ref[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("ttt_length,tv_weight", [(1, 0.0), (3, 0.0), (3, 0.5)])
def test_ttt_loss_fused_equals_log_softmax_path(tiny_llama, ttt_length, tv_weight):
    """`ttt_loss(fused_loss=True)` (config key fused_loss) gives the log_softmax path's loss,
    per-step metrics and head gradients, with right padding and partial loss masks, with and
    without total variation in the mix."""
    from eagle_train.methods.eagle3.head import Eagle3Head
    from eagle_train.methods.eagle3.ttt import ttt_loss

    model, _ = tiny_llama
    torch.manual_seed(0)
    head = Eagle3Head.from_target(model, draft_vocab_size=700).double()
    b, t, vd = 3, 11, 700
    aux = torch.randn(b, t, 3 * head.config.target_hidden_size, dtype=torch.float64)
    ids = torch.randint(0, head.config.vocab_size, (b, t))
    loss_mask = torch.rand(b, t) < 0.7
    loss_mask[2, 6:] = False  # a right-padded sequence
    probs = torch.softmax(torch.randn(b, t, vd, dtype=torch.float64) * 2, dim=-1)
    in_draft = torch.rand(b, t) < 0.9
    results = []
    for fused in (False, True):
        head.zero_grad()
        loss, metrics = ttt_loss(
            head, aux, ids, loss_mask, probs, in_draft, ttt_length=ttt_length, fused_loss=fused, tv_weight=tv_weight
        )
        loss.backward()
        grads = {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}
        results.append((loss.detach(), metrics, grads))
    (l0, m0, g0), (l1, m1, g1) = results
    # step_loss takes log_softmax in fp32 (logits.float()), so the two paths agree to fp32 precision
    torch.testing.assert_close(l1, l0, rtol=1e-6, atol=1e-8)
    assert m0.keys() == m1.keys() and all(torch.allclose(m0[k].double(), m1[k].double(), rtol=1e-6) for k in m0)
    assert g0.keys() == g1.keys() and len(g0) > 5
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-5, atol=1e-7)
