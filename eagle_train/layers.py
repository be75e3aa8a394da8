"""Llama building blocks for draft heads: RMSNorm, RoPE, attention over an explicit KV set, MLP.

Written out (rather than borrowed from transformers) so the trainer, exporter and runtime share
one numerically identical definition whatever transformers version the user has, and so the
runtime can drive attention with its own static caches and masks.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


ROPE_TYPES = ("default", "linear", "llama3")  # what rope_inv_freq implements


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies for the RoPE types Llama-family targets use (default, linear, llama3)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq.float()
    if rope_type == "linear":
        return (inv_freq / scaling["factor"]).float()
    if rope_type == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        is_mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        return torch.where(is_mid, mid, scaled).float()
    raise NotImplementedError(
        f"RoPE type {rope_type!r} is not supported by the draft head (supported: {', '.join(ROPE_TYPES)})"
    )


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float, scaling: dict | None = None):
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling), persistent=False)

    def forward(self, position_ids: torch.Tensor):
        """position_ids [B, T] -> (cos, sin) [B, T, head_dim] in fp32."""
        freqs = position_ids[..., None].float() * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()


def apply_rope(x, cos, sin):
    """x [B, h, T, d]; cos/sin [B, T, d]."""
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Attention(nn.Module):
    """Llama attention; `in_features` is 2H for the fused first draft layer, H otherwise. With `qk_norm`
    (Qwen3, the DFlash layers) each head's query and key pass an RMSNorm (`q_norm`, `k_norm`) before RoPE."""

    def __init__(
        self,
        in_features: int,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        qk_norm: bool = False,
        eps: float = 1e-6,
    ):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(in_features, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(in_features, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(in_features, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, eps)
            self.k_norm = RMSNorm(head_dim, eps)
        self.qk_norm = qk_norm

    def split_heads(self, x, heads: int):
        """[B, T, heads * d] -> [B, heads, T, d]."""
        return x.view(*x.shape[:2], heads, self.head_dim).transpose(1, 2)

    def kv(self, x, cos, sin):
        """Projected keys (normed, rotated) and values [B, h_kv, T, d] of `x`."""
        k = self.split_heads(self.k_proj(x), self.num_kv_heads)
        if self.qk_norm:
            k = self.k_norm(k)
        return apply_rope(k, cos, sin), self.split_heads(self.v_proj(x), self.num_kv_heads)

    def qkv(self, x, cos, sin):
        """Projected, rotated q [B, h, T, d] and k, v [B, h_kv, T, d]."""
        q = self.split_heads(self.q_proj(x), self.num_heads)
        if self.qk_norm:
            q = self.q_norm(q)
        return apply_rope(q, cos, sin), *self.kv(x, cos, sin)

    def expand_kv(self, x):
        """[B, h_kv, S, d] -> [B, h, S, d] for grouped-query attention."""
        rep = self.num_heads // self.num_kv_heads
        return x if rep == 1 else x.repeat_interleave(rep, dim=1)

    def attend(self, q, k, v, mask):
        """SDPA of q over an explicit key/value set; mask [B or 1, 1, T, S] bool, True = visible."""
        out = F.scaled_dot_product_attention(q, self.expand_kv(k), self.expand_kv(v), attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1))


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
