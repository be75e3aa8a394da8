"""The block drafters' head: DFlash, with DSpark's additions as options of it (docs/design.md section 6).

One forward drafts a block. The block is [anchor, mask, ..., mask] at positions a..a+B-1 (B = `block_size`),
the anchor being the last token the target verified, whose own hidden state it has not computed yet. Every
draft layer is a Qwen3 decoder layer (q_norm, k_norm) whose keys and values are the block's own plus the
target's context: for the positions before a, ctx = hidden_norm(fc(the target layers, concatenated)) and in
layer l K = k_norm(W_k ctx) rotated at the context's positions, V = W_v ctx (the context is only ever keys
and values: no input norm, no MLP). Inside the block attention is non-causal (causal with `causal`).

Which slot drafts which token: by default (DFlash, what vLLM serves) draft j = 1..B-1, token x_{a+j}, is read
at slot j, the mask in x_{a+j}'s own position; with `sample_from_anchor` (DSpark) draft j = 1..B at slot j-1,
so the anchor's slot drafts too.

DSpark's options: the Markov bias, logits_j += W2 W1[prev_j] (rank `markov_rank`; prev_j the token before
draft j: the anchor for j = 1, else draft j-1), and the confidence head, sigmoid(proj([h_j; W1[prev_j]]))
with h_j the normed hidden state the lm_head reads: whether draft j is accepted.

The target has no spare trained mask token: by default the mask's embedding is learnt (`mask_embedding` [H]) and
exports ship it as the engines expect (a `mask_token_id` plus mask_embedding.pt); with `block_mask: target` the
mask slots embed by the target's row `mask_token_id`, as the DFlash paper's heads do and as z-lab's dflash and
speculators read every head. The token embedding is the target's, frozen and left out of saves; so is the
lm_head with `block_lm_head: target` (the target's, over its whole vocabulary), else the head's own.

Tensor names follow the z-lab layout vLLM and llama.cpp load: `fc`, `hidden_norm`, `layers.{i}.*`, `norm`,
`lm_head`, `d2t`, `mask_embedding`; DSpark's `markov_head.markov_w1` [V, R], `markov_head.markov_w2` [Vd, R],
`confidence_head.proj`. One stack of layers serves training (`forward_blocks`, any number of blocks at once
over whole sequences) and the runtime (`write_context`, `draft_block` over per-layer static caches).
"""

import torch
from torch import nn

from eagle_train.architectures import text_config
from eagle_train.draft_config import DraftConfig
from eagle_train.head import DraftHead, KVCache, LayerCaches
from eagle_train.layers import MLP, Attention, RMSNorm
from eagle_train.methods import family_of
from eagle_train.methods.block.config import BLOCK_LM_HEADS, BLOCK_MASKS, BLOCK_SIZE


def default_num_hidden_layers(target_hidden_size: int) -> int:
    """Draft depth for a target: 1 layer below hidden size 2048 (a small target's layer costs much of its
    step), else 5, the published DFlash heads' depth for 4B-8B targets."""
    return 1 if target_hidden_size < 2048 else 5


def num_drafts(cfg: DraftConfig) -> int:
    """Drafts one block gives: B with `sample_from_anchor`, else B - 1 (the anchor's slot drafts nothing)."""
    return cfg.block_size if cfg.sample_from_anchor else cfg.block_size - 1


class BlockLayer(nn.Module):
    """A Qwen3 decoder layer whose attention also reads keys and values made from the target's context."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)
        self.self_attn = Attention(
            h, h, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, qk_norm=True, eps=eps
        )
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = MLP(h, cfg.intermediate_size)

    def forward(self, x, cos, sin, attend):
        """`attend(attn, q, k, v)` gives the attention output over the block's q, k, v plus the context."""
        q, k, v = self.self_attn.qkv(self.input_layernorm(x), cos, sin)
        h = x + attend(self.self_attn, q, k, v)
        return h + self.mlp(self.post_attention_layernorm(h))


class MarkovHead(nn.Module):
    """DSpark's low-rank logit bias from the previous token: W2 W1[prev] (W1 over the target's vocabulary)."""

    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Parameter(torch.zeros(vocab_size, rank))
        self.markov_w2 = nn.Parameter(torch.randn(draft_vocab_size, rank) * rank**-0.5)

    def forward(self, prev_ids):
        """(bias [..., Vd], W1[prev] [..., R]) of target token ids `prev_ids`."""
        low = self.markov_w1[prev_ids]
        return low @ self.markov_w2.t(), low


class ConfidenceHead(nn.Module):
    """DSpark's acceptance predictor: one logit from [normed hidden state; W1[prev]]."""

    def __init__(self, hidden_size: int, rank: int):
        super().__init__()
        self.proj = nn.Linear(hidden_size + rank, 1)

    def forward(self, normed, low):
        return self.proj(torch.cat([normed, low.to(normed.dtype)], dim=-1)).squeeze(-1)


class BlockHead(DraftHead):
    fused_first_layer = False

    def __init__(self, cfg: DraftConfig):
        if family_of(cfg.method) != "block" or cfg.mask_token_id is None or not cfg.block_size:
            raise ValueError(
                f"BlockHead needs a config with a block method (dflash, dspark), mask_token_id and block_size "
                f"(got method={cfg.method!r}, mask_token_id={cfg.mask_token_id}, block_size={cfg.block_size})"
            )
        if num_drafts(cfg) < 1:
            raise ValueError(f"block_size {cfg.block_size} drafts nothing: use block_size >= 2")
        if cfg.confidence_head and not cfg.markov_rank:
            raise ValueError("the confidence head reads the Markov head's W1[prev]: set markov_rank > 0")
        if cfg.block_mask not in BLOCK_MASKS or cfg.block_lm_head not in BLOCK_LM_HEADS:
            raise ValueError(
                f"block_mask {cfg.block_mask!r} / block_lm_head {cfg.block_lm_head!r}: use block_mask "
                f"{' or '.join(BLOCK_MASKS)} and block_lm_head {' or '.join(BLOCK_LM_HEADS)}"
            )
        if cfg.block_lm_head == "target" and cfg.draft_vocab_size != cfg.vocab_size:
            raise ValueError(
                f"block_lm_head target drafts over the target's whole vocabulary ({cfg.vocab_size}), not a draft "
                f"vocabulary of {cfg.draft_vocab_size}: set draft_vocab_size {cfg.vocab_size}, or block_lm_head draft"
            )
        super().__init__(cfg)
        h = cfg.hidden_size
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(BlockLayer(cfg) for _ in range(cfg.num_hidden_layers))
        if cfg.block_mask == "learnt":
            self.mask_embedding = nn.Parameter(torch.randn(h) * 0.02)
        if cfg.markov_rank:
            self.markov_head = MarkovHead(cfg.vocab_size, cfg.draft_vocab_size, cfg.markov_rank)
        if cfg.confidence_head:
            self.confidence_head = ConfidenceHead(h, cfg.markov_rank)

    @classmethod
    def from_target(
        cls,
        target_model,
        *,
        method: str,
        mask_token_id: int,
        block_size: int = BLOCK_SIZE,
        num_hidden_layers: int | None = None,
        **config_kwargs,
    ) -> "BlockHead":
        """A head for `target_model` sharing its frozen embedding (and lm_head with block_lm_head target); DSpark's
        options and block_mask / block_lm_head come in `config_kwargs`."""
        tcfg = text_config(target_model.config)
        cfg = DraftConfig.from_target_config(
            target_model.config,
            method=method,
            mask_token_id=mask_token_id,
            block_size=block_size,
            num_hidden_layers=num_hidden_layers or default_num_hidden_layers(tcfg.hidden_size),
            **config_kwargs,
        )
        head = cls(cfg)
        head.use_target_weights(target_model)
        return head

    # ---- the pieces both uses share ---------------------------------------------------------

    def context(self, aux):
        """The context states the layers' keys and values are made from: hidden_norm(fuse(aux)) [..., H]."""
        return self.hidden_norm(self.fuse(aux))

    def mask_vector(self):
        """The mask slots' embedding [H]: the learnt one, or the target's row `mask_token_id` (`block_mask`)."""
        if self.config.block_mask == "target":
            return self.embed_tokens.weight[self.config.mask_token_id]
        return self.mask_embedding

    def block_embeddings(self, anchor_ids, num_blocks_shape):
        """Embeddings [*shape, B, H] of blocks [anchor, mask, ...]: anchor_ids [*shape]."""
        mask = self.mask_vector()
        first = self.embed_tokens(anchor_ids)[..., None, :].to(mask.dtype)
        masks = mask.expand(*num_blocks_shape, self.config.block_size - 1, -1)
        return torch.cat([first, masks], dim=-2)

    def draft_slots(self) -> list[int]:
        """The slot each draft j = 1..D is read at."""
        first = 0 if self.config.sample_from_anchor else 1
        return list(range(first, first + num_drafts(self.config)))

    def draft_logits(self, h, prev_ids):
        """(draft-vocabulary logits, confidence logits or None) of block outputs `h` [..., H] (pre-norm) given
        the target token before each draft, `prev_ids` [...] (the Markov bias and the confidence read it)."""
        return self.with_bias(*self.slot_logits(h), prev_ids)

    def slot_logits(self, h):
        """(normed h, the lm_head's logits) of block outputs `h` [..., H]: what no draft before a slot changes, so
        a block's slots share one read of the lm_head (the largest weight a draft reads)."""
        normed = self.norm(h)
        return normed, self.lm_head(normed)

    def with_bias(self, normed, logits, prev_ids):
        """`slot_logits`' `logits` with the Markov bias of `prev_ids`, and the confidence logits (None without a
        Markov bias): the part of `draft_logits` that reads the draft before."""
        if not self.config.markov_rank:
            return logits, None
        bias, low = self.markov_head(prev_ids)
        confidence = self.confidence_head(normed, low) if self.config.confidence_head else None
        return logits + bias.to(logits.dtype), confidence

    # ---- training: many blocks over whole sequences ------------------------------------------

    def forward_blocks(self, aux, input_ids, anchors):
        """Block outputs over whole sequences: aux [B, T, 3H_t], input_ids [B, T], anchors [B, n] (each in
        [1, T-1]). Block i of row b sits at positions anchors[b, i] + 0..B-1 and attends to the context
        before its anchor and to its own slots. Returns pre-norm h [B, n, block_size, H]."""
        b, t = input_ids.shape
        n, size = anchors.shape[1], self.config.block_size
        ctx = self.context(aux)
        ctx_cos, ctx_sin = self.rotary(torch.arange(t, device=aux.device).expand(b, t))
        offsets = torch.arange(size, device=aux.device)
        positions = (anchors[..., None] + offsets).reshape(b, n * size)
        cos, sin = self.rotary(positions)
        x = self.block_embeddings(input_ids.gather(1, anchors), (b, n)).reshape(b, n * size, -1)
        context = torch.arange(t, device=aux.device)
        sees_context = context < anchors.reshape(b, n, 1, 1)  # [B, n, 1, T]
        if self.config.sliding_window:  # the last sliding_window positions before the anchor (speculators')
            sees_context &= context >= anchors.reshape(b, n, 1, 1) - self.config.sliding_window
        same_block = torch.eye(n, dtype=torch.bool, device=aux.device)[:, None, :, None]  # [n, 1, n, 1]
        inside = offsets[None, :] <= offsets[:, None] if self.config.causal else torch.ones(size, size, dtype=bool)
        sees_block = same_block & inside.to(aux.device)[None, :, None, :]  # [n, B, n, B]
        mask = torch.cat(
            [sees_context.expand(b, n, size, t), sees_block.expand(b, n, size, n, size).flatten(-2)], dim=-1
        ).reshape(b, 1, n * size, t + n * size)

        def attend(attn, q, k, v):
            ctx_k, ctx_v = attn.kv(ctx, ctx_cos, ctx_sin)
            return attn.attend(q, torch.cat([ctx_k, k], dim=2), torch.cat([ctx_v, v], dim=2), mask)

        for layer in self.layers:
            x = layer(x, cos, sin, attend)
        return x.view(b, n, size, -1)

    # ---- the runtime: one block over static caches --------------------------------------------

    def new_cache(self, batch: int, max_len: int, dtype=None, device=None) -> LayerCaches:
        c = self.config
        dtype, device = dtype or self.fc.weight.dtype, device or self.fc.weight.device
        return LayerCaches(
            [KVCache(batch, c.num_key_value_heads, max_len, c.head_dim, dtype, device) for _ in self.layers]
        )

    def write_context(self, cache: LayerCaches, aux, position_ids, slots):
        """Write the context keys and values of target states `aux` [B, n, 3H_t] at `position_ids` [B, n]
        into every layer's cache at `slots` [n]."""
        ctx = self.context(aux)
        cos, sin = self.rotary(position_ids)
        for layer, layer_cache in zip(self.layers, cache.layers):
            layer_cache.write(slots, *layer.self_attn.kv(ctx, cos, sin))

    def draft_block(self, cache: LayerCaches, anchor_ids, position_ids, slots, mask):
        """One block: anchor_ids [B], the block's position_ids [B, block_size], written into the caches at
        `slots` [block_size], attending to the entries `mask` [B or 1, 1, block_size, S] shows. Returns the
        pre-norm outputs at the draft slots [B, D, H]."""
        x = self.block_embeddings(anchor_ids, anchor_ids.shape).to(self.fc.weight.dtype)
        cos, sin = self.rotary(position_ids)
        for layer, layer_cache in zip(self.layers, cache.layers):

            def attend(attn, q, k, v, layer_cache=layer_cache):
                return attn.attend(q, *layer_cache.write(slots, k, v), mask)

            x = layer(x, cos, sin, attend)
        return x[:, self.draft_slots()]

    def block_mask(self, block_start: torch.Tensor, cache_len: int) -> torch.Tensor:
        """`draft_block`'s mask for a block at slots from `block_start` [B]: `block_attention_mask` with this head's
        block size, causality and sliding window."""
        c = self.config
        return block_attention_mask(block_start, c.block_size, cache_len, c.causal, c.sliding_window)

    def greedy_drafts(self, h, anchor_ids):
        """Greedy drafts of a block's outputs h [B, D, H]: (target ids [B, D], logits [B, D, Vd], confidence
        [B, D] or None). With the Markov bias each draft's bias reads the draft before it (the anchor first)."""
        if not self.config.markov_rank:
            logits, _ = self.draft_logits(h, None)
            return self.draft_to_target_ids(logits.argmax(-1)), logits, None
        normed, unbiased = self.slot_logits(h)  # every slot at once: only the bias is sequential
        prev, ids, all_logits, confidences = anchor_ids, [], [], []
        for j in range(h.shape[1]):
            logits, confidence = self.with_bias(normed[:, j], unbiased[:, j], prev)
            prev = self.draft_to_target_ids(logits.argmax(-1))
            ids.append(prev)
            all_logits.append(logits)
            confidences.append(confidence)
        confidence = torch.stack(confidences, 1) if self.config.confidence_head else None
        return torch.stack(ids, 1), torch.stack(all_logits, 1), confidence


def block_attention_mask(
    block_start: torch.Tensor, size: int, cache_len: int, causal: bool, window: int | None = None
) -> torch.Tensor:
    """The runtime's mask [B, 1, size, cache_len] for a block at slots = positions block_start.. (slot =
    position): every context slot before the block (the last `window` of them when given), and the block's slots
    (causally with `causal`)."""
    slots = torch.arange(cache_len, device=block_start.device)
    offsets = torch.arange(size, device=block_start.device)
    end = block_start[:, None] + (offsets + 1 if causal else torch.full_like(offsets, size))  # [B, size]
    mask = slots[None, None] < end[..., None]
    if window:
        mask &= slots[None, None] >= block_start[:, None, None] - window
    return mask[:, None]
