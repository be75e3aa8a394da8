"""Head + n-gram drafting in the built-in runtime: llama.cpp's rule (the lookup's chain where it finds one, else
the head's draft), lossless greedy decoding for every drafting family, and sampling that still emits the target's
distribution."""

import pytest
import torch
from conftest import TINY_BLOCK, TINY_PEAGLE, EagerStep, load_script, tiny_head, tiny_target
from test_block_runtime import assert_emits_the_target_distribution

from inference.drafting import TreeShape
from inference.generate import Runtime
from inference.hybrid_drafting import HybridDrafter
from inference.prompt_lookup import PromptLookup, propose
from inference.sampling import Sampler

OPTIONS = {"eagle3": {}, "peagle": TINY_PEAGLE, "dflash": TINY_BLOCK["dflash"], "dspark": TINY_BLOCK["dspark"]}


def confident_pair(method, seed=0):
    """A tiny target made confident (its drafts then get accepted above chance) and a random head of `method` on it."""
    model = tiny_target(seed=seed, max_position_embeddings=256)
    with torch.no_grad():
        model.lm_head.weight.mul_(4)
    options = {k: v for k, v in OPTIONS[method].items() if k != "num_hidden_layers"} | {"draft_vocab_size": 40}
    return model, tiny_head(method, seed=seed, target_model=model, **options).eval()


class Counted:
    """The head's drafter, counting its drafts."""

    def __init__(self, drafter):
        self.drafter, self.drafts = drafter, 0

    def __getattr__(self, name):
        return getattr(self.drafter, name)

    def draft(self, *args):
        self.drafts += 1
        return self.drafter.draft(*args)


class Recording(HybridDrafter):
    """Records, per round, what the lookup proposed, the drafts verified and whether the head drafted them."""

    def __init__(self, lookup, head):
        super().__init__(lookup, Counted(head))
        self.rounds = []

    def draft(self, root_token, h_root, logits_root, length):
        proposal, before = propose(self.lookup.history, self.lookup.shape.depth), self.head.drafts
        tree = super().draft(root_token, h_root, logits_root, length)
        self.rounds.append((proposal, tree.tokens[1:].tolist(), self.head.drafts > before))
        return tree


@pytest.mark.parametrize("method", ["eagle3", "peagle", "dflash", "dspark"])
@pytest.mark.parametrize("graph_shapes", [False, True], ids=["eager", "graph-shapes"])
def test_greedy_head_and_ngram_equals_plain_and_follows_the_rule(method, graph_shapes):
    """Also with the shapes CUDA graphs replay (full-cache widths, padded catch-ups), run eagerly."""
    model, head = confident_pair(method)
    runtime = Runtime(model, head, TreeShape.chain(3), cuda_graphs=False)
    if graph_shapes:
        runtime.use_graphs = True
        runtime.target_step = EagerStep(runtime.target_step)
        runtime.drafter.step_fn = EagerStep(runtime.drafter.step_fn)
    looked_up = by_head = accepted = 0
    for i in range(4):
        prompt = torch.randint(0, 50, (6 + 5 * i,)).tolist()
        drafter = Recording(PromptLookup(prompt, 3), runtime.drafter)
        out = runtime.generate(prompt, 40, drafter)
        assert out.output_ids == runtime.generate_plain(prompt, 40).output_ids
        for proposal, drafts, by_the_head in drafter.rounds:
            assert by_the_head != bool(proposal)  # the head drafts exactly where the lookup finds nothing
            if proposal:
                assert drafts == proposal
        looked_up += sum(bool(p) for p, _, _ in drafter.rounds)
        by_head += sum(not p for p, _, _ in drafter.rounds)
        accepted += sum(out.accepted)
    assert looked_up > 5 and by_head > 5 and accepted > 10  # both drafted, and drafts were accepted


def test_head_and_ngram_without_a_head_is_refused():
    runtime = Runtime(tiny_target(max_position_embeddings=256))
    with pytest.raises(ValueError, match="needs a head"):
        runtime.generate_hybrid([1, 2, 3], 4, 3)


def test_sampled_head_and_ngram_emits_the_target_distribution():
    """A prompt whose last token recurs makes the lookup draft the first round, the head the rounds where it finds
    nothing: the tokens emitted follow the target's own distribution either way."""
    model = tiny_target(seed=0, vocab_size=6, num_hidden_layers=3, max_position_embeddings=64, rope_theta=1e4)
    with torch.no_grad():
        model.lm_head.weight.mul_(8)
    head = tiny_head("eagle3", seed=0, target_model=model, draft_vocab_size=5, draft_ids=[0, 1, 2, 4, 5]).eval()
    prompt = [1, 4, 2, 0, 1, 4]  # [1, 4] occurred before: the lookup drafts [2, 0] first
    sampler = Sampler(temperature=0.9, top_k=5, top_p=0.97)
    runtime = Runtime(model, head, TreeShape.chain(2), sampler, seed=0)
    assert_emits_the_target_distribution(lambda: runtime.generate_hybrid(prompt, 3, 2), model, prompt, sampler)


def test_the_lookup_weighting_experiment_leaves_out_exactly_the_tokens_lookup_drafts_first():
    """scripts/bench/lookup_weighting.py's rule: an answer token is left out where the runtime's lookup over the tokens
    before it proposes it first; prompts are never supervised, a wrong or absent proposal keeps the token."""
    looked_up = load_script("bench/lookup_weighting.py").looked_up
    ids = [5, 6, 7, 8, 5, 6, 7, 9, 5, 6, 7]
    answer = [False] * 4 + [True] * 7
    # at 6 and 10, [5, 6] -> 7 as before; at 7, [5, 6, 7] -> 8, not 9; at 8 and 9, no earlier [7, 9] or [9, 5]
    hits = looked_up(ids, answer)
    assert [q for q, h in enumerate(hits) if h] == [6, 10]
    assert hits == [propose(ids[:q], 1) == [ids[q]] and a for q, a in enumerate(answer)]
    assert not any(looked_up(ids, [False] * 6 + [True] * 5)[:6])
