"""Run the target and return the hidden states a draft head reads.

The one function shared by offline capture, online training and the runtime's checks, so the
three cannot drift apart. Only the base model runs (no lm_head: the vocab matmul is the most
expensive single op for small targets and the draft does not need logits at every position),
and only the requested layers are kept (forward pre-hooks), instead of all N+1 states that
`output_hidden_states=True` holds on to. `TargetLogits` turns the final hidden state into the
target's own logits, whatever the architecture does after its lm_head.
"""

import inspect
from contextlib import contextmanager

import torch
from torch import nn

from eagle_train.architectures import text_config


def engine_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """What vLLM, SGLang and TensorRT-LLM capture when a draft config names no aux layers:
    (2, N//2, N-3), which repeats a layer below 7 layers."""
    return (2, num_layers // 2, num_layers - 3)


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """Low / mid / high as HF `output_hidden_states` indices (0 = embedding output), always distinct.

    From 7 layers the engines' own default (2, N//2, N-3), so exports need not name them; below, where
    that repeats a layer and vLLM fails on the fc shape, (1, N//2, N-1) ((0, 1, 2) at 3 layers), which
    exports then write out (`eagle_train.export.layouts.non_default_aux_ids`).
    """
    if num_layers < 3:
        raise ValueError(
            f"a {num_layers}-layer target has no three distinct layers for the head's low/mid/high inputs: "
            "an EAGLE-3 head needs a target of at least 3 layers"
        )
    if num_layers >= 7:
        return engine_aux_layer_ids(num_layers)
    return (0 if num_layers == 3 else 1, num_layers // 2, num_layers - 1)


def aux_layer_ids_for(num_layers: int, aux_layer_ids=None) -> tuple[int, ...]:
    """`aux_layer_ids` (default: `default_aux_layer_ids`), refused unless each is a layer of the target."""
    ids = tuple(aux_layer_ids) if aux_layer_ids is not None else default_aux_layer_ids(num_layers)
    if any(not 0 <= i < num_layers for i in ids):
        raise ValueError(f"aux layer ids {ids} must lie in [0, {num_layers - 1}] for a {num_layers}-layer target")
    return ids


def cache_argument(base_model, cache) -> dict:
    """`cache` as the keyword the base model's forward takes: `cache` (transformers 5.24 on) or `past_key_values`."""
    return (
        {"cache": cache} if "cache" in inspect.signature(base_model.forward).parameters else {"past_key_values": cache}
    )


@contextmanager
def layer_inputs(model, layer_ids):
    """Inside the block, every forward appends the input of decoder layer i (i in `layer_ids`) to `captured[i]`;
    yields `captured`. Pre-hooks keep just these layers, not every hidden state."""
    captured = {i: [] for i in set(layer_ids)}

    def keep(index):
        def hook(module, args, kwargs):
            captured[index].append(args[0] if args else kwargs["hidden_states"])

        return hook

    layers = model.model.layers
    handles = [layers[i].register_forward_pre_hook(keep(i), with_kwargs=True) for i in captured]
    try:
        yield captured
    finally:
        for h in handles:
            h.remove()


def target_hidden_states(model, input_ids, attention_mask=None, aux_layer_ids=None):
    """Return `(aux [B,T,3H], final [B,T,H])` in the model's dtype.

    `aux` concatenates the aux states in the order given (default low, mid, high); index i is
    the input of decoder layer i. `final` is the last hidden state after the final norm (what
    the lm_head reads). Uses `no_grad`, not `inference_mode`: the trainer feeds the outputs to
    autograd. Right padding with `attention_mask` is fine; padded positions hold garbage.
    """
    base = model.model
    ids = aux_layer_ids_for(model.config.num_hidden_layers, aux_layer_ids)
    with layer_inputs(model, ids) as captured, torch.no_grad():
        out = base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    aux = torch.cat([captured[i][0] for i in ids], dim=-1)
    return aux, out.last_hidden_state


def frozen_linear(linear: nn.Linear, convert) -> nn.Linear:
    """A frozen nn.Linear holding `convert` of `linear`'s weight and bias (detached)."""
    weight = convert(linear.weight.detach())
    bias = None if linear.bias is None else convert(linear.bias.detach())
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    out.requires_grad_(False)
    out.weight.data = weight
    if bias is not None:
        out.bias.data = bias
    return out


class TargetLogits(nn.Module):
    """The target's logits from its final (post-norm) hidden state, computed as the target computes them:
    its lm_head, then the architecture's scale (Cohere's `logit_scale`, Granite's 1 / `logits_scaling`)
    and soft cap (Gemma 2's `final_logit_softcapping`). The trainer's target distribution and the
    runtime's verification both read it, so neither can drift from the target's own softmax."""

    def __init__(self, lm_head: nn.Module, scale: float = 1.0, softcap: float | None = None):
        super().__init__()
        self.lm_head, self.scale, self.softcap = lm_head, scale, softcap

    @classmethod
    def of(cls, model, device=None, dtype=None) -> "TargetLogits":
        """`model`'s own rule, on its lm_head (shared), or on a frozen copy in `dtype` on `device`."""
        cfg = text_config(model.config)
        lm_head = model.get_output_embeddings()
        if device is not None or dtype is not None:
            lm_head = frozen_linear(lm_head, lambda x: x.to(device, dtype))
        scale = float(getattr(cfg, "logit_scale", None) or 1.0) / float(getattr(cfg, "logits_scaling", None) or 1.0)
        return cls(lm_head, scale, getattr(cfg, "final_logit_softcapping", None) or None)

    def restricted(self, ids: torch.Tensor) -> "TargetLogits":
        """The logits of the target ids `ids` (a bool mask [V] or indices) alone: the same rule on those lm_head
        rows (scale and soft cap act per logit), a frozen copy."""
        return TargetLogits(frozen_linear(self.lm_head, lambda x: x[ids].clone()), self.scale, self.softcap)

    def forward(self, final_hidden):
        logits = self.lm_head(final_hidden)
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


@torch.no_grad()
def check_target_logits(model, num_tokens: int = 8) -> None:
    """Refuse, in one line, a target whose logits are not `TargetLogits` of its final hidden state (an
    architecture that transforms them in a way this module does not know): a head trained toward the wrong
    distribution would load and accept little. One forward of a few tokens."""
    device = model.get_output_embeddings().weight.device
    ids = torch.arange(num_tokens, device=device)[None] % model.get_output_embeddings().weight.shape[0]
    want = model(input_ids=ids, use_cache=False).logits.float()
    got = TargetLogits.of(model)(model.model(input_ids=ids, use_cache=False).last_hidden_state).float()
    scale = want.abs().max().clamp(min=1.0)
    tolerance = max(1e-3, 4 * torch.finfo(model.get_output_embeddings().weight.dtype).eps) * scale
    if got.shape != want.shape or (got - want).abs().max() > tolerance:
        difference = f"{(got - want).abs().max().item():.3g}" if got.shape == want.shape else "of shape"
        raise ValueError(
            f"target model_type {model.config.model_type!r} computes its logits from its last hidden state in a "
            f"way eagle_train.hidden_states.TargetLogits does not know (greatest difference {difference} against "
            f"logits up to {scale:.3g}): teach TargetLogits that architecture's rule"
        )
