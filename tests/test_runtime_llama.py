"""The runtime's target forward equals Hugging Face's: full prompts, tree verification, compaction."""

import pytest
import torch
from conftest import TARGET_FAMILIES, tiny_target

from eagle_train.hidden_states import TargetLogits, target_hidden_states
from inference.llama import TargetModel

TARGET = dict(
    noise=0.05,  # non-trivial norms and biases
    vocab_size=96,
    hidden_size=48,
    intermediate_size=96,
    num_hidden_layers=6,
    head_dim=12,
    max_position_embeddings=256,
    rope_theta=1000.0,
    tie_word_embeddings=False,
)
BIAS = {"llama": {"attention_bias": True}}  # q/k/v biases: Qwen2's own; Qwen3 has q/k norms instead


def causal(n):
    return torch.ones(n, n, dtype=torch.bool).tril()[None, None]


@pytest.mark.parametrize("family", list(TARGET_FAMILIES))
def test_prompt_forward_equals_hf(family):
    model = tiny_target(family, **TARGET, **BIAS.get(family, {}))
    runtime = TargetModel(model)
    runtime.setup_cache(64)
    ids = torch.randint(0, 96, (1, 17))
    pos = torch.arange(17)
    with torch.no_grad():
        hf = model(ids, output_hidden_states=True)
        final, aux = runtime(ids, pos[None], pos, causal(17))
        ref_aux, ref_final = target_hidden_states(model, ids)
    assert runtime.aux_layer_ids == (1, 3, 5)  # 6 layers: distinct, not the engines' (2, 3, 3)
    assert (runtime.logits(final) - hf.logits).abs().max() < 1e-5
    expected = torch.cat([hf.hidden_states[i] for i in (1, 3, 5)], dim=-1)
    assert (aux - expected).abs().max() < 1e-5
    assert (aux - ref_aux).abs().max() < 1e-5 and (final - ref_final).abs().max() < 1e-5


def test_tree_verification_and_compaction_equal_hf_on_each_path():
    model = tiny_target("qwen3", seed=1, **TARGET)
    runtime = TargetModel(model)
    runtime.setup_cache(64)
    prefix = torch.randint(0, 96, (1, 9))
    n = prefix.shape[1]
    with torch.no_grad():
        runtime(prefix, torch.arange(n)[None], torch.arange(n), causal(n))
        # tree: root r=0; children 1, 2; 3 under 1; 4 under 2; 5 under 4
        parents = [0, 0, 0, 1, 2, 4]
        depths = [0, 1, 1, 2, 2, 3]
        tokens = torch.randint(0, 96, (1, 6))
        anc = torch.eye(6, dtype=torch.bool)
        for _ in range(3):
            anc = torch.eye(6, dtype=torch.bool) | anc[parents]
        mask = torch.zeros(6, n + 6, dtype=torch.bool)
        mask[:, :n] = True
        mask[:, n:] = anc
        final, aux = runtime(tokens, (n + torch.tensor(depths))[None], n + torch.arange(6), mask[None, None])
        logits = runtime.logits(final)[0]
        for node in range(6):
            path = [i for i in range(6) if anc[node, i]]
            seq = torch.cat([prefix, tokens[:, path]], dim=1)
            hf = model(seq, output_hidden_states=True)
            assert (logits[node] - hf.logits[0, -1]).abs().max() < 1e-5, node
            low = hf.hidden_states[runtime.aux_layer_ids[0]]
            assert (aux[0, node, :48] - low[0, -1]).abs().max() < 1e-5, node
        # accept root -> 2 -> 4 -> 5, compact to consecutive slots, then decode one more token
        path = [2, 4, 5]
        runtime.compact(n + torch.tensor(path), n + 1 + torch.arange(3))
        nxt = torch.randint(0, 96, (1, 1))
        length = n + 4
        final, _ = runtime(
            nxt, torch.tensor([[length]]), torch.tensor([length]), torch.ones(1, 1, 1, length + 1, dtype=torch.bool)
        )
        seq = torch.cat([prefix, tokens[:, [0] + path], nxt], dim=1)
        assert (runtime.logits(final)[0, -1] - model(seq).logits[0, -1]).abs().max() < 1e-5


def test_smollm2_forward_equals_hf_and_target_hidden_states(smollm2):
    model, tokenizer = smollm2
    runtime = TargetModel(model)
    runtime.setup_cache(32)
    ids = tokenizer("The quick brown fox jumps over", return_tensors="pt").input_ids
    n = ids.shape[1]
    with torch.no_grad():
        hf = model(ids, output_hidden_states=True)
        final, aux = runtime(ids, torch.arange(n)[None], torch.arange(n), causal(n))
        ref_aux, ref_final = target_hidden_states(model, ids)
    assert runtime.aux_layer_ids == (2, 15, 27)
    logits = runtime.logits(final)
    assert (logits - hf.logits).abs().max() < 1e-3
    assert (logits - TargetLogits.of(model)(ref_final)).abs().max() < 1e-3
    expected = torch.cat([hf.hidden_states[i] for i in (2, 15, 27)], dim=-1)
    assert (aux - expected).abs().max() / expected.abs().max() < 1e-5
    assert (aux - ref_aux).abs().max() / expected.abs().max() < 1e-5


def test_a_target_the_llama_forward_does_not_compute_is_refused_and_served_by_the_models_own():
    from transformers import GPT2Config, GPT2LMHeadModel

    from inference.hf_target import HFTarget, target_view

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(
        ValueError, match="Llama forward does not compute this target: model_type 'gpt2' is none of llama"
    ):
        TargetModel(gpt2)
    windowed = tiny_target("mistral", sliding_window=16)  # a window shorter than the context
    with pytest.raises(ValueError, match="a sliding window of 16 tokens"):
        TargetModel(windowed)
    assert isinstance(target_view(windowed), HFTarget) and isinstance(target_view(tiny_target()), TargetModel)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 40])
def test_few_row_linear_equals_linear(rows):
    from inference.llama import FewRowLinear

    torch.manual_seed(rows)
    linear = torch.nn.Linear(48, 80)  # with a bias, like Qwen2's q/k/v
    x = torch.randn(1, rows, 48)
    column_major = torch.randn(48, rows).T[None]  # what the MLP's down_proj reads
    with torch.no_grad():
        for inputs in (x, column_major):
            torch.testing.assert_close(FewRowLinear(linear)(inputs), linear(inputs), rtol=1e-5, atol=1e-6)


def test_few_row_linears_keep_the_head_and_its_state_dict():
    from eagle_train.draft_config import DraftConfig
    from eagle_train.methods.eagle3.head import Eagle3Head
    from inference.llama import FewRowLinear, use_few_row_linears

    model = tiny_target(**TARGET, **BIAS["llama"])
    head = Eagle3Head(DraftConfig.from_target_config(model.config, draft_vocab_size=32)).eval()
    hidden, ids = torch.randn(1, 3, 48), torch.randint(0, 96, (1, 3))
    pos = torch.arange(3)[None]
    with torch.no_grad():
        before = head.step(head.fc(hidden.repeat(1, 1, 3)), ids, pos)
        keys = list(head.state_dict())
        use_few_row_linears(head)
        after = head.step(head.fc(hidden.repeat(1, 1, 3)), ids, pos)
    assert list(head.state_dict()) == keys
    assert isinstance(head.lm_head, FewRowLinear) and isinstance(head.midlayer.mlp.down_proj, FewRowLinear)
    for a, b in zip(before, after):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
