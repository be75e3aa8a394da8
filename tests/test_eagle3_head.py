"""The EAGLE-3 head: training-time-test attention equals the runtime's cached step, names match docs/design.md."""

import pytest
import torch
from conftest import NH, NKV, VD, D, H, V, tiny_draft_config, tiny_head

from eagle_train.checkpoint import load_draft_head


def ttt_unroll(head, aux, ids, steps):
    """Pre-norm outputs of each TTT step, shifting tokens and positions one further per step."""
    t = ids.shape[1]
    hidden, past, outs = head.fc(aux), [], []
    for i in range(steps):
        step_ids = torch.nn.functional.pad(ids[:, 1 + i :], (0, 1 + i))
        pos = torch.arange(t)[None] + i
        hidden = head.ttt_step(hidden, step_ids, pos, past)
        outs.append(hidden)
    return outs


def reference_with_cache(head, aux, ids, steps):
    """Step by step through the runtime's KV cache: step i's keys sit in slots [i*T, (i+1)*T);
    the query at (step i, position t) sees step-0 slots <= t and slot j*T+t of each step j <= i."""
    b, t = ids.shape
    cache = head.new_cache(b, steps * t)
    hidden, outs = head.fc(aux), []
    for i in range(steps):
        mask = torch.zeros(t, steps * t, dtype=torch.bool)
        mask[:, :t] = torch.ones(t, t, dtype=torch.bool).tril()
        for j in range(1, i + 1):
            mask[torch.arange(t), j * t + torch.arange(t)] = True
        step_ids = torch.nn.functional.pad(ids[:, 1 + i :], (0, 1 + i))
        pos = (torch.arange(t)[None] + i).expand(b, t)
        hidden, _ = head.step(hidden, step_ids, pos, cache, torch.arange(i * t, (i + 1) * t), mask[None, None])
        outs.append(hidden)
    return outs


def test_ttt_equals_step_by_step_cached_reference():
    head = tiny_head(draft_ids=None).double()
    aux = torch.randn(2, 11, 3 * H, dtype=torch.double)
    ids = torch.randint(0, V, (2, 11))
    with torch.no_grad():
        ttt = ttt_unroll(head, aux, ids, 4)
        ref = reference_with_cache(head, aux, ids, 4)
    for i, (a, b) in enumerate(zip(ttt, ref)):
        assert (a - b).abs().max() < 1e-5, f"step {i}"
    assert (ttt[1] - ttt[0]).abs().max() > 1e-2  # the steps really differ


def test_ttt_step0_equals_plain_forward():
    head = tiny_head(seed=1, draft_ids=None).double()
    aux = torch.randn(1, 9, 3 * H, dtype=torch.double)
    ids = torch.randint(0, V, (1, 9))
    with torch.no_grad():
        h0 = head.ttt_step(head.fc(aux), ids, torch.arange(9)[None], [])
        plain, logits = head.step(
            head.fc(aux), ids, torch.arange(9)[None], mask=torch.ones(9, 9, dtype=torch.bool).tril()[None, None]
        )
    assert (h0 - plain).abs().max() < 1e-10
    assert torch.allclose(head.logits(h0), logits)


def test_saved_tensors_have_design_names_and_shapes(tmp_path):
    head = tiny_head(draft_ids=None)
    head.save_pretrained(tmp_path)
    from safetensors.torch import load_file

    shapes = {k: tuple(v.shape) for k, v in load_file(tmp_path / "model.safetensors").items()}
    assert shapes == {
        "fc.weight": (H, 3 * H),
        "midlayer.input_layernorm.weight": (H,),
        "midlayer.hidden_norm.weight": (H,),
        "midlayer.self_attn.q_proj.weight": (NH * D, 2 * H),
        "midlayer.self_attn.k_proj.weight": (NKV * D, 2 * H),
        "midlayer.self_attn.v_proj.weight": (NKV * D, 2 * H),
        "midlayer.self_attn.o_proj.weight": (H, NH * D),
        "midlayer.post_attention_layernorm.weight": (H,),
        "midlayer.mlp.gate_proj.weight": (64, H),
        "midlayer.mlp.up_proj.weight": (64, H),
        "midlayer.mlp.down_proj.weight": (H, 64),
        "norm.weight": (H,),
        "lm_head.weight": (VD, H),
        "d2t": (VD,),
        "t2d": (V,),
    }
    again = load_draft_head(tmp_path)
    for k, v in head.saved_state_dict().items():
        assert torch.equal(v, again.state_dict()[k]), k


def test_draft_vocab_larger_than_target_is_refused():
    with pytest.raises(ValueError, match="larger than the target vocabulary"):
        tiny_draft_config(draft_vocab_size=V + 1)


def test_a_head_built_for_another_target_is_refused_in_one_line_naming_each_mismatch():
    from types import SimpleNamespace

    cfg = tiny_head().config
    fits = SimpleNamespace(vocab_size=V, hidden_size=H, num_hidden_layers=8)
    cfg.check_fits(fits)
    cfg.check_fits(SimpleNamespace(text_config=fits))  # a multimodal target's text decoder
    other = SimpleNamespace(vocab_size=V + 1, hidden_size=2 * H, num_hidden_layers=4)
    with pytest.raises(ValueError, match="does not fit this target") as err:
        cfg.check_fits(other)
    message = str(err.value)
    assert "\n" not in message
    assert f"vocabulary {V} != target's {V + 1}" in message and f"hidden size {H} != target's {2 * H}" in message
    assert "aux layer ids [2, 4, 5] do not exist in a 4-layer target" in message
    assert cfg.fit_problems(SimpleNamespace(vocab_size=V, hidden_size=H, num_hidden_layers=9)) == [
        "trained on a 8-layer target, this one has 9"
    ]
