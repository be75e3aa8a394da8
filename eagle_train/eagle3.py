"""The EAGLE-3 draft head: defined once, used by the trainer, the exporter and the runtime.

Parameter names match the released EAGLE-3 checkpoints (docs/design.md section 4): `fc`, `midlayer.*`,
`norm`, `lm_head`, buffers `d2t`/`t2d`. The token embedding is the target's, frozen, and is
left out of saved checkpoints.

Two ways to run the layer share every weight and every op:
- `ttt_step`: one unrolled step of training-time test over whole sequences (step 0 causal,
  later steps add one diagonal key per earlier step);
- `step`: the runtime's draft step over an explicit KV cache and visibility mask.
"""

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from eagle_train.draft_config import DraftConfig
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


class DecoderLayer(nn.Module):
    """A Llama decoder layer; with `fused_input` its attention reads
    cat(input_layernorm(embedding), hidden_norm(hidden)) and the residual is the hidden input."""

    def __init__(self, cfg: DraftConfig, fused_input: bool):
        super().__init__()
        h = cfg.hidden_size
        self.fused_input = fused_input
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        if fused_input:
            self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = Attention(
            2 * h if fused_input else h, h, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        )
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = MLP(h, cfg.intermediate_size)

    def attention_input(self, hidden, emb):
        if self.fused_input:
            return torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], dim=-1)
        return self.input_layernorm(hidden)

    def finish(self, residual, attn_out):
        h = residual + attn_out
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward(self, hidden, emb, cos, sin, cache: KVCache | None, slots, mask):
        """One pass with an explicit KV cache (or, without one, over the given tokens alone)."""
        q, k, v = self.self_attn.qkv(self.attention_input(hidden, emb), cos, sin)
        if cache is not None:
            k, v = cache.write(slots, k, v)
        return self.finish(hidden, self.self_attn.attend(q, k, v, mask))


def ttt_attention(attn: Attention, q, past: list[tuple[torch.Tensor, torch.Tensor]]):
    """Attention of step i = len(past) - 1 during training-time test.

    past[0] holds step 0's keys/values (visible causally); past[j>0] holds step j's, each visible
    only at the same position (a diagonal). Equivalent to the runtime's per-step cache.
    """
    k0, v0 = (attn.expand_kv(x) for x in past[0])
    t = q.shape[2]
    scale = q.shape[-1] ** -0.5
    scores = torch.matmul(q, k0.transpose(-1, -2)) * scale
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    diag = [(q * attn.expand_kv(k)).sum(-1, keepdim=True) * scale for k, _ in past[1:]]
    scores = torch.cat([scores, *diag], dim=-1)
    probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(q.dtype)
    out = torch.matmul(probs[..., :t], v0)
    for j, (_, v) in enumerate(past[1:]):
        out = out + probs[..., t + j : t + j + 1] * attn.expand_kv(v)
    return attn.o_proj(out.transpose(1, 2).reshape(q.shape[0], t, -1))


class DraftHead(nn.Module):
    """What every draft head shares: EAGLE-3's fused first layer (`fc`, `midlayer`), the final norm,
    the draft lm_head, the `d2t`/`t2d` vocab map and checkpoint I/O. A head that `owns_embedding`
    saves `embed_tokens` (P-EAGLE trains it; an EAGLE-3 head imported from another trainer may carry
    its own, frozen); otherwise it is the target's, frozen and left out of saves."""

    owns_embedding = False

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h)
        self.embed_tokens.weight.requires_grad_(self.owns_embedding)
        self.fc = nn.Linear(3 * cfg.target_hidden_size, h, bias=False)
        self.midlayer = DecoderLayer(cfg, fused_input=True)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", t2d_from_d2t(self.d2t, cfg.vocab_size))

    def use_target_embedding(self, target_model):
        """Share the target's embedding (heads that do not own one)."""
        weight = target_model.get_input_embeddings().weight
        if tuple(weight.shape) != (self.config.vocab_size, self.config.hidden_size):
            raise ValueError(
                f"target embedding {tuple(weight.shape)} does not match the head "
                f"(vocab {self.config.vocab_size}, hidden {self.config.hidden_size}): "
                "the head was built for another target"
            )
        self.embed_tokens.weight.data = weight.detach().to(self.fc.weight.device)

    def use_own_embedding(self, weight: torch.Tensor):
        """Keep `weight` as this head's embedding, saved and exported with it: a head trained elsewhere
        with an embedding of its own must not be run or shipped with the target's instead."""
        if tuple(weight.shape) != (self.config.vocab_size, self.config.hidden_size):
            raise ValueError(
                f"embedding {tuple(weight.shape)} does not match the head "
                f"(vocab {self.config.vocab_size}, hidden {self.config.hidden_size})"
            )
        self.owns_embedding = True
        self.embed_tokens.weight.data = weight.detach().float().to(self.fc.weight.device)

    def set_vocab_map(self, d2t: torch.Tensor, t2d: torch.Tensor):
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise ValueError(
                f"vocab map (d2t {tuple(d2t.shape)}, t2d {tuple(t2d.shape)}) does not fit the head "
                f"(draft vocab {self.config.draft_vocab_size}, target vocab {self.config.vocab_size})"
            )
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def saved_state_dict(self) -> dict[str, torch.Tensor]:
        """The checkpoint tensors: all of them, but a borrowed (frozen target) embedding."""
        return {k: v for k, v in self.state_dict().items() if self.owns_embedding or not k.startswith("embed_tokens.")}

    def save_pretrained(self, directory):
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.config.save(directory)
        tensors = {k: v.detach().contiguous().cpu() for k, v in self.saved_state_dict().items()}
        save_file(tensors, directory / "model.safetensors")

    @classmethod
    def from_pretrained(cls, directory, target_model=None):
        """The head saved in `directory`; `target_model` lends its embedding to a head without one."""
        head = cls(DraftConfig.load(directory))
        state = load_file(Path(directory) / "model.safetensors")
        if not cls.owns_embedding and "embed_tokens.weight" in state:
            head.use_own_embedding(state["embed_tokens.weight"])
        missing, unexpected = head.load_state_dict(state, strict=False)
        if not head.owns_embedding:
            missing = [k for k in missing if not k.startswith("embed_tokens.")]
        if missing or unexpected:
            raise ValueError(f"{directory}: missing tensors {missing}, unexpected tensors {unexpected}")
        if target_model is not None and not head.owns_embedding:
            head.use_target_embedding(target_model)
        return head

    def draft_to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of the pre-norm hidden state `h`."""
        return self.lm_head(self.norm(h))


class Eagle3Head(DraftHead):
    @classmethod
    def from_target(cls, target_model, **config_kwargs) -> "Eagle3Head":
        """A head for `target_model` (any Llama-family HF causal LM) sharing its frozen embedding."""
        cfg = DraftConfig.from_target_config(target_model.config, **config_kwargs)
        head = cls(cfg)
        head.use_target_embedding(target_model)
        return head

    def ttt_step(self, hidden, input_ids, position_ids, past: list):
        """One training-time-test step over whole sequences.

        hidden: fc(aux) [B, T, H] at step 0, else the previous step's pre-norm output;
        input_ids: the tokens this step reads (shifted one further per step); past: the list of
        earlier steps' (k, v), appended to. Returns the pre-norm output h [B, T, H].
        """
        layer = self.midlayer
        cos, sin = self.rotary(position_ids)
        q, k, v = layer.self_attn.qkv(layer.attention_input(hidden, self.embed_tokens(input_ids)), cos, sin)
        past.append((k, v))
        return layer.finish(hidden, ttt_attention(layer.self_attn, q, past))

    def step(self, hidden, input_ids, position_ids, cache: KVCache | None = None, slots=None, mask=None):
        """The runtime's draft step: new tokens [B, n] at `position_ids`, written into `cache` at
        `slots`, attending to the cache entries that `mask` [B or 1, 1, n, S] shows.
        `hidden` is fc(aux) for tokens following target-verified ones, else a draft's pre-norm
        output. Returns (pre-norm h [B, n, H], draft logits [B, n, Vd])."""
        cos, sin = self.rotary(position_ids)
        h = self.midlayer(hidden, self.embed_tokens(input_ids), cos, sin, cache, slots, mask)
        return h, self.logits(h)

    def new_cache(self, batch: int, max_len: int, dtype=None, device=None) -> KVCache:
        c = self.config
        return KVCache(
            batch,
            c.num_key_value_heads,
            max_len,
            c.head_dim,
            dtype or self.fc.weight.dtype,
            device or self.fc.weight.device,
        )
