"""lm_head + soft cross-entropy (optionally mixed with total variation) + top-1 agreement without
materialising the [N, Vd] log-probs.

The TTT loss computes, for each of 7 unrolled steps, draft logits over a 32k vocabulary at every
position, their log-softmax, and keeps both for backward: for 16k tokens that is 2 GiB of fp32
per tensor per step. Here the logits only ever exist one vocabulary chunk at a time:

- forward: z_c = hidden @ weight_c^T per chunk; an online logsumexp (running max + rescaled sum),
  the running sums of p.z and p, and the running argmax. loss = lse * sum(p) - sum(p * z).
- backward: recompute z_c per chunk; dz_c = g * (sum(p) * softmax(z)_c - p_c);
  d hidden += dz_c @ weight_c, d weight_c = dz_c^T @ hidden.
- total variation (`tv_weight` > 0), TV = 0.5 sum |p - q|, q = softmax(z): a second forward pass over the
  chunks, once the logsumexp is known, sums |p - q| and S = sum s.q (s = sign(q - p)); the backward adds
  dz_c = g * 0.5 * q_c * (s_c - S).

Only `hidden`, `weight`, the target probabilities and two floats per row are saved. The target
probabilities may be passed once for the whole batch with `target_rows` picking each row's
target row, so the TTT loop's per-step shifted copies of a [B, T, Vd] tensor are not needed.
On CUDA with Triton installed the forward is one Triton kernel (matmul, logsumexp, dot, argmax
in registers), TV's second pass another, and the backward's gradient of the mix is one in-place
Triton pass per chunk; the chunked PyTorch path is the reference (and the CPU path).
"""

import warnings

import torch

try:  # optional: the CUDA fast path
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None


def soft_cross_entropy(
    hidden, weight, target_probs, target_rows=None, chunk_size: int = 4096, impl: str = "auto", tv_weight: float = 0.0
):
    """Per-row soft cross-entropy of softmax(hidden @ weight^T) against `target_probs`, mixed with total variation:
    (1 - tv_weight) x CE + tv_weight x TV (`ttt.step_loss`'s loss, row by row).

    hidden [N, H] (already normed), weight [Vd, H], target_probs [M, Vd] (no gradient),
    target_rows int64 [N] indexing target_probs rows (default: row n for row n, M == N).
    Returns (loss [N] = -sum_v p_v log_softmax(z)_v (mixed as above) in fp32 (fp64 for fp64 inputs),
    agree [N] bool = argmax z == argmax p).
    Under autocast the matmuls run in the autocast dtype, like `F.linear` would.
    impl: "auto" (Triton on CUDA when it is installed and passes a one-time check on the device,
    else chunked), "chunked" or "triton".
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} must be [N, H] and [Vd, H]")
    if target_probs.dim() != 2 or target_probs.shape[1] != weight.shape[0]:
        raise ValueError(f"target_probs {tuple(target_probs.shape)} must be [M, Vd] with Vd = {weight.shape[0]}")
    if target_probs.requires_grad:
        raise ValueError("target_probs must not require grad (compute the target distribution under no_grad)")
    if target_rows is None:
        if target_probs.shape[0] != hidden.shape[0]:
            raise ValueError(
                f"target_probs has {target_probs.shape[0]} rows for {hidden.shape[0]} hidden rows; "
                "pass target_rows to pick them"
            )
        target_rows = torch.arange(hidden.shape[0], device=hidden.device)
    elif target_rows.shape != hidden.shape[:1]:
        raise ValueError(f"target_rows {tuple(target_rows.shape)} must be [N] = [{hidden.shape[0]}]")
    if not 0 <= tv_weight <= 1:
        raise ValueError(f"tv_weight must be in [0, 1] (the share of total variation), got {tv_weight}")
    if impl == "auto":
        fast = hidden.is_cuda and hidden.dtype != torch.float64 and triton is not None
        impl = "triton" if fast and triton_works(hidden.device) else "chunked"
    if impl not in ("chunked", "triton"):
        raise ValueError(f"impl {impl!r} must be 'auto', 'chunked' or 'triton'")
    if impl == "triton":
        if hidden.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"impl='triton' takes fp32, bf16 or fp16 inputs, not {hidden.dtype}; use impl='chunked'")
        if triton is None:
            raise ModuleNotFoundError("impl='triton' needs triton: pip install triton (or use impl='chunked')")
        target_probs = target_probs.contiguous()
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    with torch.autocast(device_type, enabled=False):
        loss, draft_argmax, target_argmax = _SoftCrossEntropy.apply(
            hidden, weight, target_probs, target_rows.long().contiguous(), chunk_size, impl == "triton", tv_weight
        )
    return loss, draft_argmax == target_argmax


class _SoftCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, probs, rows, chunk_size, use_triton, tv_weight):
        forward = _triton_forward if use_triton else _chunked_forward
        lse, psum, pz, draft_argmax, target_argmax = forward(hidden, weight, probs, rows, chunk_size)
        loss = lse * psum - pz
        sign_q = torch.zeros_like(lse)
        if tv_weight:
            total_variation = _triton_total_variation if use_triton else _chunked_total_variation
            tv, sign_q = total_variation(hidden, weight, probs, rows, chunk_size, lse)
            loss = (1 - tv_weight) * loss + tv_weight * tv
        ctx.save_for_backward(hidden, weight, probs, rows, lse, psum, sign_q)
        ctx.chunk_size, ctx.use_triton, ctx.tv_weight = chunk_size, use_triton, tv_weight
        ctx.mark_non_differentiable(draft_argmax, target_argmax)
        return loss, draft_argmax, target_argmax

    @staticmethod
    def backward(ctx, grad_loss, _grad_draft_argmax, _grad_target_argmax):
        hidden, weight, probs, rows, lse, psum, sign_q = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[:2]
        w_tv = ctx.tv_weight
        acc = lse.dtype
        g = grad_loss.to(acc).contiguous()  # the grad of a .sum() is an expanded stride-0 view; the kernel reads g[n]
        d_hidden = torch.zeros(hidden.shape, dtype=acc, device=hidden.device) if need_h else None
        d_weight = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device) if need_w else None
        for c0 in range(0, weight.shape[0], ctx.chunk_size):
            w = weight[c0 : c0 + ctx.chunk_size]
            z = (hidden @ w.t()).to(acc)
            if ctx.use_triton:
                _triton_softmax_grad_(z, probs, rows, c0, lse, psum, g, sign_q, w_tv)
                dz = z
            else:
                p = probs[rows, c0 : c0 + w.shape[0]].to(acc)
                q = torch.exp(z - lse[:, None])
                dz = g[:, None] * (psum[:, None] * q - p)
                if w_tv:
                    d_tv = 0.5 * q * (torch.sign(q - p) - sign_q[:, None])
                    dz = (1 - w_tv) * dz + w_tv * g[:, None] * d_tv
            dz = dz.to(hidden.dtype)
            if need_h:
                d_hidden += (dz @ w).to(acc)
            if need_w:
                d_weight[c0 : c0 + w.shape[0]] = dz.t() @ hidden
        return (d_hidden.to(hidden.dtype) if need_h else None), d_weight, None, None, None, None, None


def _chunked_total_variation(hidden, weight, probs, rows, chunk_size, lse):
    """Per row, TV = 0.5 sum |p - q| and S = sum sign(q - p) q, q = softmax(z), given z's logsumexp."""
    tv, sign_q = torch.zeros_like(lse), torch.zeros_like(lse)
    for c0 in range(0, weight.shape[0], chunk_size):
        w = weight[c0 : c0 + chunk_size]
        q = torch.exp((hidden @ w.t()).to(lse.dtype) - lse[:, None])
        d = q - probs[rows, c0 : c0 + w.shape[0]].to(lse.dtype)
        tv += 0.5 * d.abs().sum(-1)
        sign_q += (torch.sign(d) * q).sum(-1)
    return tv, sign_q


def _chunked_forward(hidden, weight, probs, rows, chunk_size):
    n = hidden.shape[0]
    acc = dict(dtype=torch.promote_types(hidden.dtype, torch.float32), device=hidden.device)
    run_max = torch.full((n,), float("-inf"), **acc)
    run_sum, pz, psum = torch.zeros(n, **acc), torch.zeros(n, **acc), torch.zeros(n, **acc)
    best = torch.full((n,), float("-inf"), **acc)
    best_idx = torch.zeros(n, dtype=torch.long, device=hidden.device)
    best_p = torch.full((n,), float("-inf"), **acc)
    best_p_idx = torch.zeros(n, dtype=torch.long, device=hidden.device)
    for c0 in range(0, weight.shape[0], chunk_size):
        w = weight[c0 : c0 + chunk_size]
        z = (hidden @ w.t()).to(acc["dtype"])
        p = probs[rows, c0 : c0 + w.shape[0]].to(acc["dtype"])
        pz += (p * z).sum(-1)
        psum += p.sum(-1)
        chunk_max, chunk_idx = z.max(-1)
        better = chunk_max > best  # strict: ties keep the earlier id, like torch.argmax
        best_idx = torch.where(better, chunk_idx + c0, best_idx)
        best = torch.maximum(best, chunk_max)
        p_max, p_idx = p.max(-1)
        best_p_idx = torch.where(p_max > best_p, p_idx + c0, best_p_idx)
        best_p = torch.maximum(best_p, p_max)
        new_max = torch.maximum(run_max, chunk_max)
        run_sum = run_sum * torch.exp(run_max - new_max) + torch.exp(z - new_max[:, None]).sum(-1)
        run_max = new_max
    return run_max + torch.log(run_sum), psum, pz, best_idx, best_p_idx


# ------------------------------------------------------------------------------------ Triton path

_TRITON_WORKS: dict = {}


def triton_works(device) -> bool:
    """Whether the Triton kernels compile and match the chunked path on `device` (checked once per
    device): a kernel that a GPU or Triton version cannot run must not end a training run, so "auto"
    then warns and falls back to the chunked path."""
    device = torch.device(device)
    if device not in _TRITON_WORKS:
        try:
            g = torch.Generator(device=device).manual_seed(0)
            h, w = torch.randn(37, 96, device=device, generator=g), torch.randn(300, 96, device=device, generator=g)
            p = torch.softmax(torch.randn(37, 300, device=device, generator=g), dim=-1)
            rows = torch.arange(37, device=device)
            got, want = _triton_forward(h, w, p, rows), _chunked_forward(h, w, p, rows, 128)
            got_tv = _triton_total_variation(h, w, p, rows, 128, want[0])
            want_tv = _chunked_total_variation(h, w, p, rows, 128, want[0])
            z, lse, psum, grad, w_tv = (
                torch.randn(37, 128, device=device, generator=g),
                want[0],
                want[1],
                torch.randn(37, device=device, generator=g),
                0.5,
            )
            q, p_c = torch.exp(z - lse[:, None]), p[:, 128:256]
            dz = grad[:, None] * (
                (1 - w_tv) * (psum[:, None] * q - p_c) + w_tv * 0.5 * q * (torch.sign(q - p_c) - want_tv[1][:, None])
            )
            _triton_softmax_grad_(z, p, rows, 128, lse, psum, grad, want_tv[1], w_tv)
            ok = (
                all(torch.allclose(a, b, rtol=1e-4, atol=1e-4) for a, b in zip(got[:3] + got_tv, want[:3] + want_tv))
                and torch.equal(got[3], want[3])
                and torch.equal(got[4], want[4])
                and torch.allclose(z, dz, rtol=1e-4, atol=1e-6)
            )
            reason = "its results differ from the chunked path"
        except Exception as e:  # noqa: BLE001 - any compile/launch failure means "do not use it"
            ok, reason = False, f"{type(e).__name__}: {e}"
        if not ok:
            warnings.warn(
                f"fused_ce: the Triton kernels do not work on {device} ({reason}); using the chunked PyTorch path",
                stacklevel=2,
            )
        _TRITON_WORKS[device] = ok
    return _TRITON_WORKS[device]


def _triton_forward(hidden, weight, probs, rows, chunk_size=None):
    n, h = hidden.shape
    v = weight.shape[0]
    out = [torch.empty(n, dtype=torch.float32, device=hidden.device) for _ in range(3)]
    draft_argmax = torch.empty(n, dtype=torch.int64, device=hidden.device)
    target_argmax = torch.empty(n, dtype=torch.int64, device=hidden.device)
    hidden, weight = hidden.contiguous(), weight.contiguous()
    block_n, block_v, block_k = 64, 128, 32
    grid = (triton.cdiv(n, block_n),)
    # fp32 inputs get true fp32 products (the reference); bf16/fp16 inputs use the tensor cores.
    precision = "ieee" if hidden.dtype == torch.float32 else "tf32"
    _fused_forward_kernel[grid](
        hidden,
        weight,
        probs,
        rows,
        *out,
        draft_argmax,
        target_argmax,
        n,
        v,
        h,
        probs.stride(0),
        BLOCK_N=block_n,
        BLOCK_V=block_v,
        BLOCK_K=block_k,
        DOT_PRECISION=precision,
    )
    lse, psum, pz = out
    return lse, psum, pz, draft_argmax, target_argmax


def _triton_total_variation(hidden, weight, probs, rows, chunk_size, lse):
    """`_chunked_total_variation` as one Triton kernel: (TV, S) per row, the logits in registers."""
    n, h = hidden.shape
    tv, sign_q = torch.empty_like(lse), torch.empty_like(lse)
    hidden, weight = hidden.contiguous(), weight.contiguous()
    block_n, block_v, block_k = 64, 128, 32
    precision = "ieee" if hidden.dtype == torch.float32 else "tf32"
    _total_variation_kernel[(triton.cdiv(n, block_n),)](
        hidden,
        weight,
        probs,
        rows,
        lse,
        tv,
        sign_q,
        n,
        weight.shape[0],
        h,
        probs.stride(0),
        BLOCK_N=block_n,
        BLOCK_V=block_v,
        BLOCK_K=block_k,
        DOT_PRECISION=precision,
    )
    return tv, sign_q


def _triton_softmax_grad_(z, probs, rows, c0, lse, psum, g, sign_q, tv_weight):
    """z [N, C] fp32 (logits of vocab chunk starting at c0) <- the loss mix's gradient, in place:
    g * ((1 - w) (psum q - p) + w 0.5 q (sign(q - p) - S)), q = exp(z - lse), w = tv_weight."""
    n, c = z.shape
    block_n, block_v = 16, 256
    grid = (triton.cdiv(n, block_n), triton.cdiv(c, block_v))
    _softmax_grad_kernel[grid](
        z,
        probs,
        rows,
        lse,
        psum,
        g,
        sign_q,
        float(tv_weight),
        n,
        c,
        c0,
        z.stride(0),
        probs.stride(0),
        BLOCK_N=block_n,
        BLOCK_V=block_v,
    )


if triton is not None:

    @triton.jit
    def _logits_and_probs(
        h_ptr,
        w_ptr,
        p_ptr,
        offs_n,
        mask_n,
        prow,
        v0,
        V,
        H,
        p_stride,
        BLOCK_N: tl.constexpr,
        BLOCK_V: tl.constexpr,
        BLOCK_K: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        """The vocab block at v0 of the rows offs_n: (offs_v, mask_v, logits z, target probs p), both fp32 and 0
        in masked columns; z is rounded to the input dtype, as a PyTorch matmul's output is, so the backward
        (which recomputes it with PyTorch) sees the same numbers."""
        offs_v = v0 + tl.arange(0, BLOCK_V)
        mask_v = offs_v < V
        z = tl.zeros((BLOCK_N, BLOCK_V), tl.float32)
        for k0 in range(0, H, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < H
            a = tl.load(
                h_ptr + offs_n[:, None] * H + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0
            )
            b = tl.load(
                w_ptr + offs_v[None, :] * H + offs_k[:, None], mask=mask_v[None, :] & mask_k[:, None], other=0.0
            )
            z = tl.dot(a, b, acc=z, input_precision=DOT_PRECISION)
        z = z.to(h_ptr.dtype.element_ty).to(tl.float32)
        p = tl.load(
            p_ptr + prow[:, None] * p_stride + offs_v[None, :], mask=mask_n[:, None] & mask_v[None, :], other=0.0
        ).to(tl.float32)
        return offs_v, mask_v, z, p

    @triton.jit
    def _fused_forward_kernel(
        h_ptr,
        w_ptr,
        p_ptr,
        rows_ptr,
        lse_ptr,
        psum_ptr,
        pz_ptr,
        argmax_ptr,
        p_argmax_ptr,
        N,
        V,
        H,
        p_stride,
        BLOCK_N: tl.constexpr,
        BLOCK_V: tl.constexpr,
        BLOCK_K: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        """One program per BLOCK_N rows: loop over vocab blocks (`_logits_and_probs`), logits stay in registers."""
        pid = tl.program_id(0)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        prow = tl.load(rows_ptr + offs_n, mask=mask_n, other=0)
        run_max = tl.full((BLOCK_N,), float("-inf"), tl.float32)
        run_sum = tl.zeros((BLOCK_N,), tl.float32)
        pz = tl.zeros((BLOCK_N,), tl.float32)
        psum = tl.zeros((BLOCK_N,), tl.float32)
        best = tl.full((BLOCK_N,), float("-inf"), tl.float32)
        best_idx = tl.zeros((BLOCK_N,), tl.int64)
        best_p = tl.full((BLOCK_N,), float("-inf"), tl.float32)
        best_p_idx = tl.zeros((BLOCK_N,), tl.int64)
        for v0 in range(0, V, BLOCK_V):
            offs_v, mask_v, z, p = _logits_and_probs(
                h_ptr, w_ptr, p_ptr, offs_n, mask_n, prow, v0, V, H, p_stride, BLOCK_N, BLOCK_V, BLOCK_K, DOT_PRECISION
            )
            pz += tl.sum(p * z, axis=1)  # masked columns have z = 0 and p = 0
            p_masked = tl.where(mask_v[None, :], p, float("-inf"))
            p_max = tl.max(p_masked, axis=1)
            p_idx = tl.argmax(p_masked, axis=1).to(tl.int64) + v0
            best_p_idx = tl.where(p_max > best_p, p_idx, best_p_idx)
            best_p = tl.maximum(best_p, p_max)
            z = tl.where(mask_v[None, :], z, float("-inf"))
            psum += tl.sum(p, axis=1)
            chunk_max = tl.max(z, axis=1)
            chunk_idx = tl.argmax(z, axis=1).to(tl.int64) + v0
            better = chunk_max > best
            best_idx = tl.where(better, chunk_idx, best_idx)
            best = tl.maximum(best, chunk_max)
            new_max = tl.maximum(run_max, chunk_max)
            run_sum = run_sum * tl.exp(run_max - new_max) + tl.sum(tl.exp(z - new_max[:, None]), axis=1)
            run_max = new_max
        tl.store(lse_ptr + offs_n, run_max + tl.log(run_sum), mask=mask_n)
        tl.store(psum_ptr + offs_n, psum, mask=mask_n)
        tl.store(pz_ptr + offs_n, pz, mask=mask_n)
        tl.store(argmax_ptr + offs_n, best_idx, mask=mask_n)
        tl.store(p_argmax_ptr + offs_n, best_p_idx, mask=mask_n)

    @triton.jit
    def _total_variation_kernel(
        h_ptr,
        w_ptr,
        p_ptr,
        rows_ptr,
        lse_ptr,
        tv_ptr,
        sign_q_ptr,
        N,
        V,
        H,
        p_stride,
        BLOCK_N: tl.constexpr,
        BLOCK_V: tl.constexpr,
        BLOCK_K: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        """One program per BLOCK_N rows, the forward kernel's loop with the logsumexp known: sums 0.5 |q - p|
        and sign(q - p) q over the vocabulary."""
        pid = tl.program_id(0)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        prow = tl.load(rows_ptr + offs_n, mask=mask_n, other=0)
        lse = tl.load(lse_ptr + offs_n, mask=mask_n, other=0.0)
        tv = tl.zeros((BLOCK_N,), tl.float32)
        sign_q = tl.zeros((BLOCK_N,), tl.float32)
        for v0 in range(0, V, BLOCK_V):
            offs_v, mask_v, z, p = _logits_and_probs(
                h_ptr, w_ptr, p_ptr, offs_n, mask_n, prow, v0, V, H, p_stride, BLOCK_N, BLOCK_V, BLOCK_K, DOT_PRECISION
            )
            q = tl.where(mask_v[None, :], tl.exp(z - lse[:, None]), 0.0)
            d = q - p
            tv += 0.5 * tl.sum(tl.abs(d), axis=1)
            sign_q += tl.sum(tl.where(d > 0, q, tl.where(d < 0, -q, 0.0)), axis=1)
        tl.store(tv_ptr + offs_n, tv, mask=mask_n)
        tl.store(sign_q_ptr + offs_n, sign_q, mask=mask_n)

    @triton.jit
    def _softmax_grad_kernel(
        z_ptr,
        p_ptr,
        rows_ptr,
        lse_ptr,
        psum_ptr,
        g_ptr,
        sign_q_ptr,
        tv_weight,
        N,
        C,
        c0,
        z_stride,
        p_stride,
        BLOCK_N: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        mask = (offs_n < N)[:, None] & (offs_v < C)[None, :]
        prow = tl.load(rows_ptr + offs_n, mask=offs_n < N, other=0)
        lse = tl.load(lse_ptr + offs_n, mask=offs_n < N, other=0.0)
        psum = tl.load(psum_ptr + offs_n, mask=offs_n < N, other=0.0)
        g = tl.load(g_ptr + offs_n, mask=offs_n < N, other=0.0)
        z = tl.load(z_ptr + offs_n[:, None] * z_stride + offs_v[None, :], mask=mask, other=0.0)
        p = tl.load(p_ptr + prow[:, None] * p_stride + c0 + offs_v[None, :], mask=mask, other=0.0).to(tl.float32)
        sign_q = tl.load(sign_q_ptr + offs_n, mask=offs_n < N, other=0.0)
        q = tl.exp(z - lse[:, None])
        d = q - p
        sign = tl.where(d > 0, 1.0, tl.where(d < 0, -1.0, 0.0))
        mix = (1 - tv_weight) * (psum[:, None] * q - p) + tv_weight * 0.5 * q * (sign - sign_q[:, None])
        dz = g[:, None] * mix
        tl.store(z_ptr + offs_n[:, None] * z_stride + offs_v[None, :], dz, mask=mask)
