"""Run the target and return the hidden states a draft head reads.

The one function shared by offline capture, online training and the runtime's checks, so the
three cannot drift apart. Only the base model runs (no lm_head: the vocab matmul is the most
expensive single op for small targets and the draft does not need logits at every position),
and only the requested layers are kept (forward pre-hooks), instead of all N+1 states that
`output_hidden_states=True` holds on to.
"""

from contextlib import contextmanager

import torch


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
    num_layers = model.config.num_hidden_layers
    ids = tuple(aux_layer_ids) if aux_layer_ids is not None else default_aux_layer_ids(num_layers)
    if any(not 0 <= i < num_layers for i in ids):
        raise ValueError(f"aux layer ids {ids} must lie in [0, {num_layers - 1}] for a {num_layers}-layer target")
    with layer_inputs(model, ids) as captured, torch.no_grad():
        out = base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    aux = torch.cat([captured[i][0] for i in ids], dim=-1)
    return aux, out.last_hidden_state


def target_logits(model, final_hidden):
    """The target's lm_head on final hidden states: logits over the full vocabulary."""
    return model.get_output_embeddings()(final_hidden)
