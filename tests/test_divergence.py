"""Where greedy decodes part from plain decoding: a clear preference of the target is reported as a bug,
a tie of its two best tokens as rounding."""

import pytest
import torch
from conftest import tiny_pair

from inference.divergence import TIE_STEPS, first_divergence, is_tie
from inference.drafting import TreeShape
from inference.evaluate import divergence_counts, identical_note
from inference.generate import Runtime

V = 50  # tiny_target's vocabulary


@pytest.fixture
def decoded():
    """A runtime over the tiny pair, a prompt, its plain greedy tokens and the target."""
    model, head = tiny_pair(draft_vocab_size=32, lm_head_scale=4.0)
    runtime = Runtime(model, head, TreeShape.chain(3))
    prompt = torch.randint(0, V, (7,), generator=torch.Generator().manual_seed(0)).tolist()
    return runtime, prompt, runtime.generate_plain(prompt, 16).output_ids, model


def test_next_token_logits_are_the_ones_plain_decoding_took_its_argmax_of(decoded):
    runtime, prompt, plain, _ = decoded
    for p in (0, 5, 15):
        logits = runtime.next_token_logits(prompt, plain[:p], 16)
        assert logits.shape == (V,) and int(logits.argmax()) == plain[p]


def test_identical_decodes_have_no_divergence(decoded):
    runtime, prompt, plain, _ = decoded
    spec = runtime.generate(prompt, 16).output_ids
    assert spec == plain  # fp32 on the CPU: token for token
    assert first_divergence(runtime, prompt, plain, spec, 16) is None


def test_a_token_the_target_did_not_choose_is_not_a_tie(decoded):
    runtime, prompt, plain, _ = decoded
    logits = runtime.next_token_logits(prompt, plain[:4], 16)
    wrong = plain[:4] + [int(logits.argmin())] + plain[5:]
    d = first_divergence(runtime, prompt, plain, wrong, 16)
    assert (d["position"], d["plain_token"], d["other_token"]) == (4, plain[4], wrong[4])
    assert d["logit_gap"] == pytest.approx(float(logits.max() - logits.min()), rel=1e-5)
    assert d["rounding_steps"] > 1e6 and not is_tie(d)  # fp32: millions of steps


def test_two_tied_tokens_are_a_tie(decoded):
    runtime, prompt, plain, model = decoded
    # the target's lm_head row of another token made equal to plain's token's row: a tie at every position
    twin = (plain[4] + 1) % V
    with torch.no_grad():
        model.lm_head.weight[twin] = model.lm_head.weight[plain[4]]
    d = first_divergence(runtime, prompt, plain, plain[:4] + [twin] + plain[5:], 16)
    assert d["position"] == 4 and d["logit_gap"] == 0.0 and is_tie(d)


def test_the_summary_tells_ties_from_bugs():
    tie = {"divergence": {"rounding_steps": -TIE_STEPS}}
    bug = {"divergence": {"rounding_steps": 40.0}}
    same = {"divergence": None}
    assert divergence_counts([same, tie]) == {
        "turns_parting_at_ties": 1,
        "turns_parting_unexplained": 0,
        "largest_gap_rounding_steps": TIE_STEPS,
    }
    assert "near ties" in identical_note(divergence_counts([same, tie]))
    counts = divergence_counts([tie, bug, same])
    assert counts["turns_parting_unexplained"] == 1 and counts["largest_gap_rounding_steps"] == 40.0
    assert "a decoding bug" in identical_note(counts)
    assert divergence_counts([{"output_ids": [1]}]) == {}  # engines that record none (vLLM, llama.cpp)
    assert identical_note(divergence_counts([same])) == ""
