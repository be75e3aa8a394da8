"""The target's forward for speculative decoding on any architecture, through the model's own modules.

`inference.llama.TargetModel` re-implements the Llama family for speed; this view runs the Hugging Face
model itself (its attention, experts, norms, sliding windows, sinks, soft caps) and gives it what
verification needs: keys and values written at explicit cache slots (`SlotCache`), and the runtime's
visibility mask (a chain or a tree of drafts in one pass) handed over as the model's own precomputed 4D
mask, one per layer type, where sliding-window layers also hide keys a window or more behind the query.
Every number is the model's; `target_view` picks the faster view where it is exact.
"""

import torch
from transformers.cache_utils import Cache

from eagle_train.architectures import check_supported, text_config
from eagle_train.hidden_states import TargetLogits, aux_layer_ids_for, cache_argument, layer_inputs
from inference.llama import TargetModel, TargetView, llama_forward_problem


class SlotCache(Cache):
    """Per layer a static [B, h_kv, S, d] key/value buffer (allocated at the first write, in the shapes the
    layer writes) that the model's attention writes at `slots` and reads up to `width`, the mask's width.
    transformers' own static cache writes after its last position, which a tree round cannot use."""

    def __init__(self, num_layers: int, max_len: int):  # Cache's __init__ builds layers this class does not use
        self.layers = []
        self.max_len = max_len
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.slots: torch.Tensor | None = None
        self.width = 0

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if self.keys[layer_idx] is None:
            b, h = key_states.shape[:2]
            self.keys[layer_idx] = key_states.new_zeros(b, h, self.max_len, key_states.shape[-1])
            self.values[layer_idx] = value_states.new_zeros(
                b, value_states.shape[1], self.max_len, value_states.shape[-1]
            )
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys.index_copy_(2, self.slots, key_states)
        values.index_copy_(2, self.slots, value_states)
        return keys[:, :, : self.width], values[:, :, : self.width]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.width

    def compact(self, src_slots: torch.Tensor, dst_slots: torch.Tensor):
        for cache in (*self.keys, *self.values):
            if cache is not None:
                cache.index_copy_(2, dst_slots, cache.index_select(2, src_slots))


class HFTarget(TargetView):
    """The same calls as `inference.llama.TargetModel`: forward(input_ids [1,n], position_ids [1,n], slots [n],
    mask [1,1,n,W] bool) -> (final [1,n,H], aux [1,n,3H]), logits, setup_cache, compact."""

    graphable = False  # the model's Python (expert routing, mask dicts) is not captured in a CUDA graph

    def __init__(self, hf_model, aux_layer_ids=None):
        super().__init__()
        cfg = text_config(hf_model.config)
        check_supported(cfg, "runtime")
        attention = getattr(cfg, "_attn_implementation", None) or "eager"
        if attention not in ("eager", "sdpa"):
            raise ValueError(
                f"the runtime verifies drafts under its own attention mask, which {attention!r} attention ignores: "
                "load the target with attn_implementation='sdpa' or 'eager'"
            )
        self.config = cfg
        self.model = hf_model
        self.aux_layer_ids = aux_layer_ids_for(cfg.num_hidden_layers, aux_layer_ids)
        self.target_logits = TargetLogits.of(hf_model)
        self.layer_types = set(getattr(cfg, "layer_types", None) or ())
        self.sliding_window = getattr(cfg, "sliding_window", None)
        self.cache: SlotCache | None = None
        self.max_len = 0
        self.check_exact()

    @torch.no_grad()
    def check_exact(self, prompt: int = 8, chunk: int = 4):
        """Refuse, in one line, a model whose logits through the slot cache and masks are not its plain forward's
        (a layer that keeps other state, or reads positions its own way): a prefill then a chunk, against one
        forward of the same tokens. Verification that is not exact would be silently lossy."""
        n = prompt + chunk
        ids = torch.arange(1, n + 1, device=self.device)[None] % self.config.vocab_size
        keys = torch.arange(n, device=self.device)
        try:
            want = self.model(input_ids=ids).logits[0].float()
            self.setup_cache(n)
            got = []
            for start, end in ((0, prompt), (prompt, n)):
                visible = (keys[None, :end] <= keys[start:end, None])[None, None]
                final, _ = self.forward(ids[:, start:end], keys[None, start:end], keys[start:end], visible)
                got.append(self.logits(final)[0].float())
            difference = (torch.cat(got) - want).abs().max().item()
        except Exception as err:  # any failure means the same: this model does not run under the runtime's cache
            raise ValueError(
                f"the built-in runtime cannot verify drafts for target model_type {self.config.model_type!r}: its "
                f"forward fails on the runtime's slot cache ({type(err).__name__}: {str(err).splitlines()[0]}); "
                "evaluate the head in an engine that serves this target (eagle-eval --engine vllm)"
            ) from err
        finally:
            self.cache, self.max_len = None, 0
        scale = want.abs().max().item()
        if difference > max(1e-3, 8 * torch.finfo(self.dtype).eps) * max(scale, 1.0):
            raise ValueError(
                f"the built-in runtime cannot verify drafts for target model_type {self.config.model_type!r} exactly: "
                f"its logits through the runtime's cache differ from a plain forward by {difference:.3g} (logits up "
                f"to {scale:.3g}); evaluate the head in an engine that serves this target (eagle-eval --engine vllm)"
            )

    def allocate(self, max_len: int):
        """A slot cache for every layer, and the position each slot holds (for sliding windows)."""
        self.cache = SlotCache(self.config.num_hidden_layers, max_len)
        self.slot_positions = torch.arange(max_len, device=self.device)

    def attention_masks(self, position_ids, visible):
        """The model's 4D additive masks from the runtime's boolean one: per layer type (a dict) for models
        that declare layer types, else one, with the sliding window where the model applies one."""

        def additive(seen):
            return torch.zeros(seen.shape, dtype=self.dtype, device=seen.device).masked_fill(
                ~seen, torch.finfo(self.dtype).min
            )

        sliding = visible
        if self.sliding_window:
            keys = self.slot_positions[: visible.shape[-1]]
            sliding = visible & (position_ids[0][:, None] - keys[None, :] < self.sliding_window)
        if self.layer_types:
            return {kind: additive(sliding if kind == "sliding_attention" else visible) for kind in self.layer_types}
        return additive(sliding)

    def forward(self, input_ids, position_ids, slots, mask):
        self.cache.slots, self.cache.width = slots, mask.shape[-1]
        self.slot_positions[slots] = position_ids[0]
        masks = self.attention_masks(position_ids, mask)
        with layer_inputs(self.model, self.aux_layer_ids) as captured:
            out = self.model.model(
                input_ids=input_ids,
                position_ids=position_ids,
                attention_mask=masks,
                use_cache=True,
                **cache_argument(self.model.model, self.cache),
            )
        return out.last_hidden_state, torch.cat([captured[i][0] for i in self.aux_layer_ids], dim=-1)

    def compact(self, src_slots: torch.Tensor, dst_slots: torch.Tensor):
        """Move the cache entries of an accepted tree path (src) to consecutive slots (dst)."""
        self.cache.compact(src_slots, dst_slots)
        self.slot_positions[dst_slots] = self.slot_positions[src_slots]


def target_view(hf_model, aux_layer_ids=None) -> TargetView:
    """The runtime's Llama forward where it is exact for this target (faster on the CPU), else `HFTarget`."""
    if llama_forward_problem(text_config(hf_model.config)) is None:
        return TargetModel(hf_model, aux_layer_ids)
    return HFTarget(hf_model, aux_layer_ids)
