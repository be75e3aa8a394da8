"""What every draft head is built from, and which class builds a head of each method.

`DraftHead` (the parts and checkpoint tensors all heads share) and the runtime's `KVCache` are used by every
method (EAGLE-3, P-EAGLE and the block drafters DFlash and DSpark), `KVCache` also by the runtime's target model;
the Llama `DecoderLayer` by EAGLE-3 and P-EAGLE (a block head's layers are `eagle_train.methods.block.head.BlockLayer`);
a method's row (`eagle_train.methods`) names its class, which imports this module, so this one resolves no row:
the loader (`eagle_train.checkpoint.head_from_state`) builds the class a row names.
"""

from pathlib import Path

import torch
from torch import nn

from eagle_train.draft_config import DraftConfig
from eagle_train.files import write_safetensors
from eagle_train.layers import MLP, Attention, RMSNorm, RotaryEmbedding
from eagle_train.vocab_map import t2d_from_d2t


class KVCache(nn.Module):
    """A static [B, h_kv, S, d] key/value buffer written at explicit slots (CUDA-graph friendly)."""

    def __init__(self, batch: int, num_kv_heads: int, max_len: int, head_dim: int, dtype, device=None):
        super().__init__()
        shape = (batch, num_kv_heads, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """slots [T] cache indices for the T new positions; returns the whole buffers."""
        self.k.index_copy_(2, slots, k.to(self.k.dtype))
        self.v.index_copy_(2, slots, v.to(self.v.dtype))
        return self.k, self.v


class LayerCaches(nn.Module):
    """One static KVCache per draft layer of a multi-layer head (P-EAGLE, DFlash, DSpark); slot s of every layer
    belongs to the same token."""

    def __init__(self, caches: list[KVCache]):
        super().__init__()
        self.layers = nn.ModuleList(caches)


class DecoderLayer(nn.Module):
    """A Llama decoder layer; with `fused_input` its attention reads
    cat(input_layernorm(embedding), hidden_norm(hidden)) and the residual is the hidden input (with the config's
    `norm_before_residual`, its hidden_norm)."""

    def __init__(self, cfg: DraftConfig, fused_input: bool):
        super().__init__()
        h = cfg.hidden_size
        self.fused_input = fused_input
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        if fused_input:
            self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.norm_before_residual = fused_input and cfg.norm_before_residual
        self.self_attn = Attention(
            2 * h if fused_input else h,
            h,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            qk_norm=cfg.qk_norm,
            eps=cfg.rms_norm_eps,
        )
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = MLP(h, cfg.intermediate_size)

    def attention_input(self, hidden, emb):
        if self.fused_input:
            return torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], dim=-1)
        return self.input_layernorm(hidden)

    def finish(self, hidden, attn_out):
        """The layer's output from its hidden input and its attention's output: the residual is the hidden input,
        or with `norm_before_residual` its hidden_norm."""
        h = (self.hidden_norm(hidden) if self.norm_before_residual else hidden) + attn_out
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward(self, hidden, emb, cos, sin, cache: KVCache | None, slots, mask):
        """One pass with an explicit KV cache (or, without one, over the given tokens alone)."""
        q, k, v = self.self_attn.qkv(self.attention_input(hidden, emb), cos, sin)
        if cache is not None:
            k, v = cache.write(slots, k, v)
        return self.finish(hidden, self.self_attn.attend(q, k, v, mask))


class DraftHead(nn.Module):
    """What every draft head shares: `fc` over the target's fused layers, the final norm, the draft
    lm_head, the `d2t`/`t2d` vocab map and checkpoint I/O (and the norms of the variants other trainers
    write: `fuse`, `layer_output`); with `fused_first_layer` (EAGLE-3, P-EAGLE)
    EAGLE-3's fused first layer `midlayer`. A head that `owns_embedding` saves `embed_tokens` (P-EAGLE
    trains it; an EAGLE-3 head imported from another trainer may carry its own, frozen); otherwise it is
    the target's, frozen and left out of saves. A head that `borrows_lm_head` (a block head with
    `block_lm_head: target`) drafts through the target's lm_head the same way: frozen, never saved, NaN
    until attached, so a head drafting without it shows at once."""

    owns_embedding = False
    embedding_attached = False  # the embedding is a target's (or the head's own), not the constructor's random one
    fused_first_layer = True

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h)
        self.embed_tokens.weight.requires_grad_(self.owns_embedding)
        if cfg.norm_before_fc:
            self.input_norm = RMSNorm(cfg.num_aux * cfg.target_hidden_size, cfg.rms_norm_eps)
        if cfg.fc_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps) for _ in range(cfg.num_aux))
        self.fc = nn.Linear(cfg.num_aux * cfg.target_hidden_size, h, bias=False)
        if self.fused_first_layer:
            self.midlayer = DecoderLayer(cfg, fused_input=True)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        if self.borrows_lm_head:
            self.lm_head.weight.requires_grad_(False)
            nn.init.constant_(self.lm_head.weight, torch.nan)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", t2d_from_d2t(self.d2t, cfg.vocab_size))

    def attach_embedding(self, weight: torch.Tensor, *, own: bool = False):
        """The one way a head gets its token embedding. Borrowed (`own` false): the target's tensor
        itself, frozen and left out of saves. Owned: an fp32 copy saved and exported with the head
        (P-EAGLE trains its own; a head trained elsewhere with its own must not run on the target's)."""
        if tuple(weight.shape) != (self.config.vocab_size, self.config.hidden_size):
            raise ValueError(
                f"embedding {tuple(weight.shape)} does not match the head "
                f"(vocab {self.config.vocab_size}, hidden {self.config.hidden_size}): "
                "the head was built for another target"
            )
        device = self.fc.weight.device
        self.embedding_attached = True
        if own:
            self.owns_embedding = True
            self.embed_tokens.weight.data = weight.detach().to(device, torch.float32, copy=True)
        else:
            self.embed_tokens.weight.data = weight.detach().to(device)

    @property
    def borrows_lm_head(self) -> bool:
        """Whether the lm_head is the target's (frozen, left out of saves) rather than the head's own."""
        return self.config.block_lm_head == "target"

    def attach_lm_head(self, weight: torch.Tensor):
        """The one way a head that `borrows_lm_head` gets it: the target's tensor itself, frozen."""
        if tuple(weight.shape) != (self.config.draft_vocab_size, self.config.hidden_size):
            raise ValueError(
                f"lm_head {tuple(weight.shape)} does not match the head (draft vocab {self.config.draft_vocab_size}, "
                f"hidden {self.config.hidden_size}): the head was built for another target"
            )
        self.lm_head.weight.data = weight.detach().to(self.fc.weight.device)

    def use_target_weights(self, target_model):
        """Share the target's frozen tensors the head does not own: the embedding, and the lm_head of a head that
        `borrows_lm_head`."""
        self.attach_embedding(target_model.get_input_embeddings().weight)
        if self.borrows_lm_head:
            self.attach_lm_head(target_model.get_output_embeddings().weight)

    def set_vocab_map(self, d2t: torch.Tensor, t2d: torch.Tensor):
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise ValueError(
                f"vocab map (d2t {tuple(d2t.shape)}, t2d {tuple(t2d.shape)}) does not fit the head "
                f"(draft vocab {self.config.draft_vocab_size}, target vocab {self.config.vocab_size})"
            )
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def saved_state_dict(self) -> dict[str, torch.Tensor]:
        """The checkpoint tensors: all of them, but the borrowed (frozen target) embedding and lm_head."""
        borrowed = () if self.owns_embedding else ("embed_tokens.weight",)
        borrowed += ("lm_head.weight",) if self.borrows_lm_head else ()
        return {k: v for k, v in self.state_dict().items() if k not in borrowed}

    def save_pretrained(self, directory):
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.config.save(directory)
        tensors = {k: v.detach().contiguous().cpu() for k, v in self.saved_state_dict().items()}
        write_safetensors(directory / "model.safetensors", tensors)

    def draft_to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """fc of the target's fused aux states [..., num_aux * H] (normed first, as a whole or per layer, where the head
        was trained so)."""
        if self.config.norm_before_fc:
            aux = self.input_norm(aux)
        if self.config.fc_norm:
            aux = torch.cat(
                [norm(part) for norm, part in zip(self.fc_norm, aux.chunk(self.config.num_aux, dim=-1), strict=True)],
                -1,
            )
        return self.fc(aux)

    def layer_output(self, h: torch.Tensor) -> torch.Tensor:
        """The hidden state a layer stack hands on (to the next draft step and to `logits`): its output, or with
        `norm_output` its output through the final norm."""
        return self.norm(h) if self.config.norm_output else h

    def normed(self, h: torch.Tensor) -> torch.Tensor:
        """What lm_head reads of a handed-on hidden state: the final norm of it, once."""
        return h if self.config.norm_output else self.norm(h)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of the handed-on hidden state `h` (`layer_output`)."""
        return self.lm_head(self.normed(h))


def non_finite_values(tensors: dict[str, torch.Tensor]) -> str:
    """What is not finite and where, e.g. "nan in fc.weight, and inf in lm_head.weight"; empty when every floating
    tensor is finite. The one test a head passes before it is saved or loaded: a head that diverged drafts garbage."""
    found = {}
    for name, t in tensors.items():
        if t.is_floating_point() and not torch.isfinite(t).all():
            kinds = [kind for kind, bad in (("nan", t.isnan().any()), ("inf", t.isinf().any())) if bad]
            found.setdefault(" and ".join(kinds), []).append(name)
    shown = 3

    def listed(names):
        return ", ".join(names[:shown]) + (f" and {len(names) - shown} more tensors" if len(names) > shown else "")

    return ", and ".join(f"{kinds} in {listed(names)}" for kinds, names in found.items())
