"""Speculative sampling is lossless: emitted tokens follow the target's (warped) distribution.

Chi-square goodness-of-fit at significance 1e-3. Sample sizes are chosen to detect a 2% deviation
(0.02 of probability mass moved between two cells) with high power: the noncentrality is
N * 0.02**2 * (1/p_a + 1/p_b), about 400 for the sampler-level test and about 55 for the runtime
test, against critical values of about 50 and 67. Each test also shows that it rejects a subtly
wrong scheme, so it can fail.
"""

import math

import torch
from conftest import tiny_pair

from inference.drafting import TreeShape
from inference.generate import Runtime
from inference.sampling import Sampler, accept_sampling


def chi_square_rejects(counts: torch.Tensor, expected_probs: torch.Tensor, alpha_z=3.09) -> bool:
    """True when counts do not fit expected_probs (Wilson-Hilferty chi-square quantile; z=3.09: 1e-3)."""
    counts, expected_probs = counts.double().flatten(), expected_probs.double().flatten()
    impossible = expected_probs <= 1e-12
    if counts[impossible].sum() > 0:
        return True
    n = counts.sum()
    e = expected_probs[~impossible] * n
    stat = ((counts[~impossible] - e) ** 2 / e).sum().item()
    df = int((~impossible).sum()) - 1
    critical = df * (1 - 2 / (9 * df) + alpha_z * math.sqrt(2 / (9 * df))) ** 3
    return stat > critical


def gumbel_order(q, k, gen):
    """k draws without replacement from q (Gumbel top-k), in draw order."""
    keys = q.log() - torch.log(-torch.log(torch.rand(q.shape, generator=gen)))
    return torch.topk(keys, k).indices.tolist()


def run_tree_rounds(p1, p2, q1, q2, rounds, gen, wrong_q=False):
    """Depth-2 trees over vocab V: 3 root children drawn from q1, 2 grandchildren each from q2[child].
    Returns counts [V, V] of the first two emitted tokens (the second drawn from p2 when the
    round emitted only one, as the next round would)."""
    v = p1.shape[0]
    counts = torch.zeros(v, v)
    for _ in range(rounds):
        # node lists: token, children, the draft distribution its children came from, the target's p there
        tokens, children, dists, p = [-1], [[]], [q1], [p1]
        for a in gumbel_order(q1, 3, gen):
            tokens.append(a), children.append([]), dists.append(q2[a]), p.append(p2[a])
            node = len(tokens) - 1
            children[0].append(node)
            for b in gumbel_order(q2[a], 2, gen):  # leaves: their p is never read for the first two tokens
                tokens.append(b), children.append([]), dists.append(None), p.append(p1)
                children[node].append(len(tokens) - 1)
        p = torch.stack(p)
        q = (lambda node: torch.full((v,), 1.0 / v)) if wrong_q else (lambda node: dists[node])  # noqa: B023 (used within this iteration)
        path, bonus = accept_sampling(tokens, children, p, q, generator=gen)
        emitted = [tokens[i] for i in path] + [bonus]
        second = emitted[1] if len(emitted) > 1 else torch.multinomial(p2[emitted[0]], 1, generator=gen).item()
        counts[emitted[0], second] += 1
    return counts


def test_recursive_rejection_sampling_on_trees_emits_the_target_distribution():
    gen = torch.Generator().manual_seed(0)
    v = 5
    p1 = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.10])
    p2 = torch.softmax(torch.randn(v, v, generator=gen) * 1.5, -1)
    q1 = torch.tensor([0.05, 0.15, 0.40, 0.40, 0.0])  # the draft cannot propose token 4
    q2 = torch.softmax(torch.randn(v, v, generator=gen) * 1.5, -1)
    expected = p1[:, None] * p2
    assert not chi_square_rejects(run_tree_rounds(p1, p2, q1, q2, 20000, gen), expected)
    # the same test catches a scheme that divides by the wrong draft probabilities
    assert chi_square_rejects(run_tree_rounds(p1, p2, q1, q2, 20000, gen, wrong_q=True), expected)


@torch.no_grad()
def exact_first_two(model, prompt, sampler):
    """The target's own joint distribution of the next two tokens under `sampler`'s warping."""
    p1 = sampler.probs(model(torch.tensor([prompt])).logits[0, -1])
    p2 = torch.stack([sampler.probs(model(torch.tensor([prompt + [a]])).logits[0, -1]) for a in range(len(p1))])
    return p1[:, None] * p2


# 2 x 2000 generations of a tiny model: about 20 s on the 2-core CPU
def test_speculative_sampling_runtime_matches_target_distribution_chain_and_tree():
    model, head = tiny_pair(
        draft_vocab_size=5,
        draft_ids=[0, 1, 2, 4, 5],  # target id 3 is outside the draft vocabulary
        lm_head_scale=8,
        vocab_size=6,
        num_hidden_layers=3,
        max_position_embeddings=64,
        rope_theta=10000.0,
    )
    prompt = [1, 4, 2, 0, 5]
    sampler = Sampler(temperature=0.9, top_k=5, top_p=0.97)
    expected = exact_first_two(model, prompt, sampler)
    for shape in (TreeShape.chain(2), TreeShape(2, 2, 4)):
        runtime = Runtime(model, head, shape, sampler, seed=0)
        counts, accepted = torch.zeros_like(expected), 0
        for _ in range(2000):
            out = runtime.generate(prompt, 2)
            counts[out.output_ids[0], out.output_ids[1]] += 1
            accepted += sum(out.accepted)
        assert accepted > 200, shape  # the drafts matter: many second tokens were accepted drafts
        assert not chi_square_rejects(counts, expected), shape
    # the test has power: the target's distribution at temperature 1.2 is rejected
    assert chi_square_rejects(counts, exact_first_two(model, prompt, Sampler(temperature=1.2, top_k=5, top_p=0.97)))
