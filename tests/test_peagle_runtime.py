"""P-EAGLE in the speculative runtime: one forward yields K drafts equal to the trained head's
training-mode outputs, and greedy speculative decoding reproduces the target's own tokens."""

import pytest
import torch
from conftest import K, tiny_head, tiny_target
from test_peagle_head import training_logits

from eagle_train.hidden_states import target_hidden_states
from inference.drafting import TreeShape
from inference.generate import Runtime
from inference.parallel_drafting import ParallelDrafter

HEAD = dict(init_std=0.2, draft_ids=None, num_hidden_layers=2, mask_token_id=16, num_depths=K, draft_vocab_size=4096)
V = 16  # a confident tiny target's vocabulary: a random head's drafts are accepted now and then
CONFIDENT_HEAD = {**HEAD, "mask_token_id": V - 1, "draft_vocab_size": V}


def confident_target():
    """A tiny Llama over V tokens whose lm_head is scaled x 20: its argmax is clear, so random drafts match it
    often enough to accept single drafts and whole chains."""
    model = tiny_target(seed=1, vocab_size=V, num_hidden_layers=5, max_position_embeddings=256, rope_theta=10000.0)
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    return model


class Recorder(ParallelDrafter):
    """Keeps every round's (committed length, K draft logits) for the consistency check."""

    rounds: list

    def draft(self, root_token, h_root, logits_root, length):
        self.rounds.append((length, logits_root.clone()))
        return super().draft(root_token, h_root, logits_root, length)


def runtime_with(model, head, k, drafter_class):
    rt = Runtime(model, head, TreeShape.chain(k), cuda_graphs=False)
    assert type(rt.drafter) is ParallelDrafter  # the runtime drafts P-EAGLE heads in parallel by itself
    rt.drafter = drafter_class(head, TreeShape.chain(k), rt.sampler)
    return rt


def test_parallel_drafts_equal_training_outputs_and_greedy_is_exact():
    model = confident_target()
    head = tiny_head("peagle", seed=1, target_model=model, **CONFIDENT_HEAD).eval()
    prompt = torch.randint(0, V, (9,), generator=torch.Generator().manual_seed(0))
    rt = runtime_with(model, head, K, Recorder)
    rt.drafter.rounds = []
    spec = rt.generate(prompt.tolist(), 24)
    plain = rt.generate_plain(prompt.tolist(), 24)
    assert spec.output_ids == plain.output_ids  # lossless
    assert sum(spec.accepted) > 0 and spec.forwards < plain.forwards  # accepted drafts save target forwards
    assert sum(spec.emitted) == plain.forwards  # every token but the prefill's from a verification

    full = torch.cat([prompt, torch.tensor(spec.output_ids)])[None]
    aux, _ = target_hidden_states(model, full)
    assert len(rt.drafter.rounds) >= 3
    for length, logits in rt.drafter.rounds:
        # anchor length-1 reads x_length (the pending token) and g_{length-1}
        with torch.no_grad():
            expected = training_logits(head, aux, full, length - 1, K)
        assert logits.shape == expected.shape
        assert (logits - expected).abs().max() < 1e-4 * expected.abs().max(), length
        assert torch.equal(logits.argmax(-1), expected.argmax(-1))


def test_drafts_stay_consistent_when_whole_chains_are_accepted(tiny_llama):
    """Force every draft to be accepted (not lossless; it exercises the catch-up of K+1 rows plus
    the mask rows and padding): each round's drafts still equal the training-mode outputs."""
    model, _ = tiny_llama
    head = tiny_head("peagle", seed=1, target_model=model, **HEAD).eval()
    rt = runtime_with(model, head, K, Recorder)
    rt.drafter.rounds = []

    def accept_all(tree, logits):
        tokens = tree.tokens.tolist()
        return list(range(1, K + 1)), int(logits[K].argmax()), tokens

    rt.accept = accept_all
    prompt = list(range(40, 47))
    out = rt.generate(prompt, 3 * (K + 1) + 1)
    full = torch.tensor([prompt + out.output_ids])
    aux, _ = target_hidden_states(model, full)
    lengths = [length for length, _ in rt.drafter.rounds]
    assert lengths == [7 + i * (K + 1) for i in range(len(lengths))] and len(lengths) == 3
    for length, logits in rt.drafter.rounds:
        with torch.no_grad():
            expected = training_logits(head, aux, full, length - 1, K)
        assert (logits - expected).abs().max() < 1e-4 * expected.abs().max(), length


def test_more_parallel_drafts_than_trained_is_refused(tiny_llama):
    model, _ = tiny_llama
    head = tiny_head("peagle", target_model=model, **{**HEAD, "num_depths": 3})
    with pytest.raises(ValueError, match="num_depths"):
        ParallelDrafter(head, TreeShape.chain(5), None)
