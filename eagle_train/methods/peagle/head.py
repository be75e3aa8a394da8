"""The P-EAGLE draft head: EAGLE-3's fused first layer plus N-1 plain Llama layers, all K drafts
from one forward pass (docs/design.md section 5).

Draft slot 1 reads (fc(g_p), embed(next token)) exactly like EAGLE-3; slots 2..K read
(fc(mask_hidden), embed(mask_token_id)) at positions p+1..p+K-1. `mask_hidden` is stored before
fc (width 3H) and the mask token's embedding row is trained, so unlike EAGLE-3 the head owns
and saves its `embed_tokens` (initialised from the target's).

Tensor names follow the vLLM P-EAGLE layout: `midlayer.*` is layer 0 and the plain layers are
`layers.1.*` .. `layers.{N-1}.*` (a ModuleDict keyed "1".."N-1" gives exactly those names).

One stack of layers serves both uses:
- `forward`: training over flattened (anchor, depth) elements with any attention mask (a dense
  boolean mask, or a FlexAttention BlockMask on CUDA);
- `step`: the runtime's cached step over per-layer static KV caches (`mask_inputs` gives the
  parallel-drafting slots, `visible` the attention rule; `inference.parallel_drafting` lays out a round).
"""

import functools

import torch
from torch import nn

from eagle_train.architectures import text_config
from eagle_train.draft_config import DraftConfig
from eagle_train.head import DecoderLayer, DraftHead, KVCache, LayerCaches
from eagle_train.methods.peagle.batch import visible
from eagle_train.methods.peagle.config import NUM_DEPTHS


def default_num_hidden_layers(target_hidden_size: int) -> int:
    """Draft depth N for a target: 2 layers below hidden size 2048 (SmolLM2, Qwen-0.5B: the
    draft is then a sizeable fraction of the target already), 4 from there on, the depth the
    published P-EAGLE heads for 8B-class targets use."""
    return 2 if target_hidden_size < 2048 else 4


@functools.cache
def compiled_flex_attention():
    """FlexAttention compiled once per process: uncompiled it materialises the full score matrix,
    which is what the block mask is there to avoid."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True)


class PEagleHead(DraftHead):
    owns_embedding = True

    def __init__(self, cfg: DraftConfig):
        if cfg.method != "peagle" or cfg.mask_token_id is None or not cfg.num_depths:
            raise ValueError(
                f"PEagleHead needs a config with method 'peagle', mask_token_id and num_depths "
                f"(got method={cfg.method!r}, mask_token_id={cfg.mask_token_id}, num_depths={cfg.num_depths})"
            )
        if not 0 <= cfg.mask_token_id < cfg.vocab_size:
            raise ValueError(
                f"mask_token_id {cfg.mask_token_id} is outside the target vocabulary [0, {cfg.vocab_size})"
            )
        super().__init__(cfg)
        self.mask_hidden = nn.Parameter(torch.randn(1, 1, 3 * cfg.target_hidden_size))
        self.layers = nn.ModuleDict(
            {str(i): DecoderLayer(cfg, fused_input=False) for i in range(1, cfg.num_hidden_layers)}
        )

    # ---- construction and I/O -------------------------------------------------------------

    @classmethod
    def from_target(
        cls,
        target_model,
        *,
        mask_token_id: int,
        num_depths: int = NUM_DEPTHS,
        num_hidden_layers: int | None = None,
        **config_kwargs,
    ) -> "PEagleHead":
        """A head for `target_model` whose trainable embedding starts as a copy of the target's."""
        tcfg = text_config(target_model.config)
        cfg = DraftConfig.from_target_config(
            target_model.config,
            method="peagle",
            mask_token_id=mask_token_id,
            num_depths=num_depths,
            num_hidden_layers=num_hidden_layers or default_num_hidden_layers(tcfg.hidden_size),
            **config_kwargs,
        )
        head = cls(cfg)
        head.attach_embedding(target_model.get_input_embeddings().weight, own=True)
        return head

    # ---- forward ----------------------------------------------------------------------------

    def blocks(self) -> list[DecoderLayer]:
        return [self.midlayer, *self.layers.values()]

    def input_hidden(self, aux: torch.Tensor, is_mask: torch.Tensor) -> torch.Tensor:
        """fc of the 3H input: the target's aux states, or `mask_hidden` where `is_mask`."""
        aux = torch.where(is_mask[..., None], self.mask_hidden.to(aux.dtype), aux)
        return self.fuse(aux)

    def mask_inputs(self, batch: int, count: int, device=None):
        """(fc(mask_hidden), mask token ids) for `count` parallel-drafting slots: [B, count, H], [B, count]."""
        device = device or self.fc.weight.device
        hidden = self.fuse(self.mask_hidden.to(self.fc.weight.dtype)).expand(batch, count, -1)
        ids = torch.full((batch, count), self.config.mask_token_id, dtype=torch.long, device=device)
        return hidden, ids

    def run_layers(self, hidden, input_ids, position_ids, attend) -> torch.Tensor:
        """The layer stack; `attend(layer_index, attn, q, k, v)` returns the attention output."""
        cos, sin = self.rotary(position_ids)
        emb = self.embed_tokens(input_ids)
        h = hidden
        for i, layer in enumerate(self.blocks()):
            q, k, v = layer.self_attn.qkv(layer.attention_input(h, emb), cos, sin)
            h = layer.finish(h, attend(i, layer.self_attn, q, k, v))
        return self.layer_output(h)

    def hidden_states(self, aux, is_mask, input_ids, position_ids, mask) -> torch.Tensor:
        """Training over flattened elements: aux [B, E, 3H] (ignored where is_mask), is_mask [B, E],
        input_ids / position_ids [B, E], mask a bool [B or 1, 1, E, E] (True = visible) or a
        FlexAttention BlockMask. Returns the last layer's handed-on output [B, E, H] (`layer_output`)."""
        if isinstance(mask, torch.Tensor):

            def attend(i, attn, q, k, v):
                return attn.attend(q, k, v, mask)
        else:
            flex_attention = compiled_flex_attention()

            def attend(i, attn, q, k, v):
                out = flex_attention(q, k, v, block_mask=mask, enable_gqa=attn.num_heads != attn.num_kv_heads)
                return attn.o_proj(out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1))

        return self.run_layers(self.input_hidden(aux, is_mask), input_ids, position_ids, attend)

    def forward(self, aux, is_mask, input_ids, position_ids, mask) -> torch.Tensor:
        """Draft logits [B, E, Vd] of `hidden_states`."""
        return self.logits(self.hidden_states(aux, is_mask, input_ids, position_ids, mask))

    def new_cache(self, batch: int, max_len: int, dtype=None, device=None) -> LayerCaches:
        c = self.config
        return LayerCaches(
            [
                KVCache(
                    batch,
                    c.num_key_value_heads,
                    max_len,
                    c.head_dim,
                    dtype or self.fc.weight.dtype,
                    device or self.fc.weight.device,
                )
                for _ in self.blocks()
            ]
        )

    def step(self, hidden, input_ids, position_ids, cache: LayerCaches, slots, mask, draft_rows=None):
        """The runtime's draft step through every layer: new tokens [B, n] at `position_ids`,
        written at `slots` of each layer's cache, attending to the entries `mask`
        [B or 1, 1, n, S] shows. `hidden` is fc(aux) or fc(mask_hidden) per token.
        Returns (last layer output h [B, n, H], draft logits [B, n, Vd]), the logits of the rows
        `draft_rows` [K] alone when given (the lm_head is the largest weight a step reads)."""

        def attend(i, attn, q, k, v):
            k, v = cache.layers[i].write(slots, k, v)
            return attn.attend(q, k, v, mask)

        h = self.run_layers(hidden, input_ids, position_ids, attend)
        return h, self.logits(h if draft_rows is None else h[:, draft_rows])

    def visible(self, q_anchor, q_depth, k_anchor, k_depth):
        """Training's attention rule (`batch.visible`) within one document, with this head's sliding window: the
        runtime lays out its rows by it."""
        return visible(q_anchor, q_depth, 0, k_anchor, k_depth, 0, self.config.sliding_window)
