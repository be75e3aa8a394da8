"""The runtime's own forward of Llama-family targets (`llama_forward_problem` says which), for speed.

Built on the Hugging Face model's weights (shared, not copied) so that verification can do what
`transformers` does not: write keys/values into a static, preallocated cache at explicit slots,
attend under an arbitrary boolean visibility mask (a chain or a tree of drafts in one pass), and
return the draft head's aux hidden states at exactly the positions it ran. Accepted tree paths
are compacted inside the cache; rejected entries are simply overwritten later.
"""

import torch
import torch.nn.functional as F
from torch import nn

from eagle_train.architectures import text_config
from eagle_train.draft_config import target_rope
from eagle_train.head import KVCache
from eagle_train.hidden_states import TargetLogits, aux_layer_ids_for
from eagle_train.layers import MLP, ROPE_TYPES, RMSNorm, RotaryEmbedding, apply_rope


def shared_norm(hf_norm) -> RMSNorm:
    """Our RMSNorm (same op as HF's) reading the HF module's weight in place."""
    eps = getattr(hf_norm, "variance_epsilon", None) or hf_norm.eps
    norm = RMSNorm(hf_norm.weight.shape[0], eps)
    norm.weight = hf_norm.weight
    return norm


class FewRowLinear(nn.Module):
    """An HF Linear (weights shared) that multiplies a few rows on the CPU as W @ x^T.

    Decoding multiplies 1 to K+1 rows, and at those shapes MKL's kernel behind F.linear reads the
    weights far slower than W @ x^T does. One row (a gemv) is faster doubled, and 3 rows faster with
    a 4th (PADDED). CUDA and inputs of more than MAX_ROWS rows take F.linear. docs/performance.md
    has the figures; `scripts/bench/few_row_linear.py` measures them.
    """

    MAX_ROWS = 8
    PADDED = {1: 2, 3: 4}  # row counts that multiply faster with repeated rows added

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x):
        rows = x.reshape(-1, x.shape[-1])
        n = rows.shape[0]
        if x.device.type != "cpu" or n > self.MAX_ROWS:
            return F.linear(x, self.weight, self.bias)
        # row-major rows: a column-major x (the MLP multiplies two outputs of this layer, which are
        # transposed views) makes x^T contiguous, and W @ x^T then takes a much slower kernel
        padded = self.PADDED.get(n, n)
        rows = torch.cat([rows, rows[: padded - n]]) if padded > n else rows.contiguous()
        out = (self.weight @ rows.T).T[:n]
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], -1)


def use_few_row_linears(module: nn.Module) -> nn.Module:
    """Swap every nn.Linear inside `module` (in place) for a FewRowLinear sharing its weights; the
    state_dict keeps its keys. The runtime does this to its target view and to the draft head; off the
    CPU nothing changes (FewRowLinear takes F.linear there)."""
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, FewRowLinear(child))
        else:
            use_few_row_linears(child)
    return module


class TargetLayer(nn.Module):
    def __init__(self, hf_layer, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        attn = hf_layer.self_attn
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.input_layernorm = shared_norm(hf_layer.input_layernorm)
        self.post_attention_layernorm = shared_norm(hf_layer.post_attention_layernorm)
        # HF's Linear modules (TargetModel makes them FewRowLinear): Qwen2's qkv bias and Llama's
        # attention/mlp bias come along.
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
        self.q_norm = shared_norm(attn.q_norm) if hasattr(attn, "q_norm") else None  # Qwen3
        self.k_norm = shared_norm(attn.k_norm) if hasattr(attn, "k_norm") else None
        mlp = hf_layer.mlp
        self.mlp = MLP(*reversed(mlp.gate_proj.weight.shape))  # [out, in]: an HF Linear or a FewRowLinear
        self.mlp.gate_proj, self.mlp.up_proj, self.mlp.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self.cache: KVCache | None = None

    def attention(self, x, cos, sin, slots, mask):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k, v = self.cache.write(slots, k, v)
        width = mask.shape[-1]  # attend to the first `width` cache slots only
        out = F.scaled_dot_product_attention(q, k[:, :, :width], v[:, :, :width], attn_mask=mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))

    def forward(self, x, cos, sin, slots, mask):
        x = x + self.attention(self.input_layernorm(x), cos, sin, slots, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


LLAMA_FORWARD_TYPES = ("llama", "mistral", "qwen2", "qwen3")  # the model_types TargetModel is written for


def llama_forward_problem(cfg) -> str | None:
    """Why `TargetModel` would not compute this target exactly (None: it does): it is written for
    LLAMA_FORWARD_TYPES with SiLU MLPs, full attention and the RoPE types `eagle_train.layers` implements.
    `inference.hf_target` serves the others through the model's own modules."""
    if cfg.model_type not in LLAMA_FORWARD_TYPES:
        return f"model_type {cfg.model_type!r} is none of {', '.join(LLAMA_FORWARD_TYPES)}"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r} (only silu)"
    window = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) else None
    if window and window < cfg.max_position_embeddings:
        return f"a sliding window of {window} tokens in a context of {cfg.max_position_embeddings} (full attention)"
    rope_type = (target_rope(cfg)[1] or {}).get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        return f"RoPE type {rope_type!r} (only {', '.join(ROPE_TYPES)})"
    return None


class TargetView(nn.Module):
    """What the runtime's two views of the target share (this module's `TargetModel`, `inference.hf_target`'s
    `HFTarget`): the device and dtype of the target's logits, and a cache sized once for the longest sequence.
    Each view has `config`, `target_logits`, `max_len`, `allocate(max_len)` and `forward`."""

    graphable = True  # one CUDA graph per shape replays a step (inference.graphs)

    @property
    def device(self):
        return self.target_logits.lm_head.weight.device

    @property
    def dtype(self):
        return self.target_logits.lm_head.weight.dtype

    def setup_cache(self, max_len: int):
        """A cache of `max_len` slots (reused when already large enough)."""
        if max_len > self.config.max_position_embeddings:
            raise ValueError(
                f"{max_len} tokens exceed the target's context ({self.config.max_position_embeddings}); "
                "use shorter prompts or fewer --max-new-tokens"
            )
        if max_len > self.max_len:
            self.allocate(max_len)
            self.max_len = max_len

    def logits(self, final):
        return self.target_logits(final)


class TargetModel(TargetView):
    """forward(input_ids [1,n], position_ids [1,n], slots [n], mask [1,1,n,W]) -> (final [1,n,H], aux [1,n,3H]).

    `mask[..., j]` says whether a query sees cache slot j (True = visible); its width W bounds the
    attended slots (the full cache length for fixed-shape CUDA graphs, less on the CPU). `final`
    is post-norm (what the lm_head reads, see `logits`); `aux` concatenates the inputs of decoder
    layers `aux_layer_ids` (HF `output_hidden_states` indices), the draft head's input.
    """

    def __init__(self, hf_model, aux_layer_ids=None):
        super().__init__()
        cfg = text_config(hf_model.config)
        why = llama_forward_problem(cfg)
        if why is not None:
            raise ValueError(f"the runtime's Llama forward does not compute this target: {why}")
        self.config = cfg
        self.aux_layer_ids = aux_layer_ids_for(cfg.num_hidden_layers, aux_layer_ids)
        num_kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.num_kv_heads = num_kv
        base = hf_model.model
        self.embed_tokens = base.embed_tokens
        self.layers = nn.ModuleList(
            TargetLayer(layer, cfg.num_attention_heads, num_kv, self.head_dim) for layer in base.layers
        )
        self.norm = shared_norm(base.norm)
        self.target_logits = TargetLogits.of(hf_model)
        theta, scaling = target_rope(cfg)
        self.rotary = RotaryEmbedding(self.head_dim, theta, scaling).to(self.device)
        self.max_len = 0
        use_few_row_linears(self)  # swaps our references only: the HF model keeps its own Linears

    def allocate(self, max_len: int):
        """Every layer's [1, h_kv, max_len, d] cache."""
        for layer in self.layers:
            layer.cache = KVCache(1, self.num_kv_heads, max_len, self.head_dim, self.dtype, self.device)

    def forward(self, input_ids, position_ids, slots, mask):
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(position_ids)
        kept = {}
        for i, layer in enumerate(self.layers):
            if i in self.aux_layer_ids:
                kept[i] = x
            x = layer(x, cos, sin, slots, mask)
        return self.norm(x), torch.cat([kept[i] for i in self.aux_layer_ids], dim=-1)

    def compact(self, src_slots: torch.Tensor, dst_slots: torch.Tensor):
        """Move the cache entries of an accepted tree path (src) to consecutive slots (dst)."""
        for layer in self.layers:
            c = layer.cache
            c.k.index_copy_(2, dst_slots, c.k.index_select(2, src_slots))
            c.v.index_copy_(2, dst_slots, c.v.index_select(2, src_slots))
