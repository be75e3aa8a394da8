"""The EAGLE-3 draft head: defined once, used by the trainer, the exporter and the runtime.

Parameter names match the released EAGLE-3 checkpoints (docs/design.md section 4): `fc`, `midlayer.*`,
`norm`, `lm_head`, buffers `d2t`/`t2d`. The token embedding is the target's, frozen, and is
left out of saved checkpoints.

Two ways to run the layer share every weight and every op:
- `ttt_step`: one unrolled step of training-time test over whole sequences (step 0 causal,
  later steps add one diagonal key per earlier step);
- `step`: the runtime's draft step over an explicit KV cache and visibility mask.
"""

import torch

from eagle_train.draft_config import DraftConfig
from eagle_train.head import DraftHead, KVCache
from eagle_train.layers import Attention


def ttt_attention(attn: Attention, q, past: list[tuple[torch.Tensor, torch.Tensor]], where, window=None):
    """Attention of step i = len(past) - 1 during training-time test, at the positions `where` only.

    past[0] holds step 0's keys/values (visible causally, within the last `window` positions when given);
    past[j>0] holds step j's, each visible only at the same position (a diagonal). Equivalent to the runtime's
    per-step cache.
    q [B, h, T, d]; where: the (batch, position) indices whose output is used. Returns o_proj's
    output there [N, H].
    """
    k0, v0 = (attn.expand_kv(x) for x in past[0])
    t = q.shape[2]
    scale = q.shape[-1] ** -0.5
    scores = torch.matmul(q, k0.transpose(-1, -2)) * scale
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    if window:
        causal = causal.triu(1 - window)
    scores = scores.masked_fill(~causal, float("-inf"))
    diag = [(q * attn.expand_kv(k)).sum(-1, keepdim=True) * scale for k, _ in past[1:]]
    scores = torch.cat([scores, *diag], dim=-1)
    probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(q.dtype)
    out = torch.matmul(probs[..., :t], v0)
    for j, (_, v) in enumerate(past[1:]):
        out = out + probs[..., t + j : t + j + 1] * attn.expand_kv(v)
    return attn.o_proj(out.transpose(1, 2)[where].flatten(1))


def scattered(shape, where, at_rows):
    """A [B, h, T, d] tensor from its values at the positions `where` of a [B, T] `shape` (at_rows
    [1, h, N, d]), zero elsewhere."""
    values = at_rows[0].transpose(0, 1)  # [N, h, d]
    return values.new_zeros(*shape, *values.shape[1:]).index_put(where, values).transpose(1, 2)


class Eagle3Head(DraftHead):
    @classmethod
    def from_target(cls, target_model, **config_kwargs) -> "Eagle3Head":
        """A head for `target_model` (any Llama-family HF causal LM) sharing its frozen embedding."""
        cfg = DraftConfig.from_target_config(target_model.config, **config_kwargs)
        head = cls(cfg)
        head.use_target_weights(target_model)
        return head

    def ttt_step(self, hidden, input_ids, position_ids, past: list, rows=None):
        """One training-time-test step over whole sequences.

        hidden: fc(aux) [B, T, H] at step 0, else the previous step's pre-norm output;
        input_ids: the tokens this step reads (shifted one further per step); past: the list of
        earlier steps' (k, v), appended to. rows bool [B, T]: the positions whose output is used
        (by a loss or a later step; None: all). Only these pay for the layer, but for step 0's q/k/v
        projections (its keys and values are what every later position attends to). Returns the
        handed-on output h [B, T, H] (`DraftHead.layer_output`), zero outside `rows`.
        """
        layer, attn = self.midlayer, self.midlayer.self_attn
        if rows is None:
            rows = torch.ones(input_ids.shape, dtype=torch.bool, device=input_ids.device)
        where = rows.nonzero(as_tuple=True)
        if not past:
            cos, sin = self.rotary(position_ids)
            q, k, v = attn.qkv(layer.attention_input(hidden, self.embed_tokens(input_ids)), cos, sin)
        else:
            cos, sin = self.rotary(position_ids.expand(rows.shape)[where][None])
            x = layer.attention_input(hidden[where], self.embed_tokens(input_ids[where]))
            q, k, v = (scattered(rows.shape, where, y) for y in attn.qkv(x[None], cos, sin))
        past.append((k, v))
        out = self.layer_output(
            layer.finish(hidden[where], ttt_attention(attn, q, past, where, self.config.sliding_window))
        )
        return out.new_zeros(*rows.shape, out.shape[-1]).index_put(where, out)

    def step(self, hidden, input_ids, position_ids, cache: KVCache | None = None, slots=None, mask=None):
        """The runtime's draft step: new tokens [B, n] at `position_ids`, written into `cache` at
        `slots`, attending to the cache entries that `mask` [B or 1, 1, n, S] shows.
        `hidden` is fc(aux) for tokens following target-verified ones, else a draft's pre-norm
        output. Returns (handed-on h [B, n, H], draft logits [B, n, Vd])."""
        h = self.layer(hidden, input_ids, position_ids, cache, slots, mask)
        return h, self.logits(h)

    def layer(self, hidden, input_ids, position_ids, cache: KVCache | None = None, slots=None, mask=None):
        """`step` without the lm_head: the handed-on h [B, n, H]."""
        cos, sin = self.rotary(position_ids)
        return self.layer_output(self.midlayer(hidden, self.embed_tokens(input_ids), cos, sin, cache, slots, mask))

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
