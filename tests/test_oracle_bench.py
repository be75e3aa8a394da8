"""The oracle drafter of scripts/bench/oracle.py, as a chain and as a tree: its acceptance is the one set by
construction, and decoding with it stays equal to plain decoding (in a tree, also when the accepted path leaves
the first branch and the cache is compacted)."""

import math
import random

import pytest
import torch
from conftest import EagerStep, load_script, tiny_target

from inference.generate import Runtime

oracle = load_script("bench/oracle.py")

TARGET = dict(vocab_size=16, num_hidden_layers=4, max_position_embeddings=256, rope_theta=10000.0)
NEW = 30


@pytest.fixture(scope="module")
def decoded():
    runtime = Runtime(tiny_target(**TARGET))
    torch.manual_seed(1)
    prompts = [torch.randint(0, 16, (5 + 4 * i,)).tolist() for i in range(3)]
    return runtime, prompts, [runtime.generate_plain(q, NEW) for q in prompts]


@pytest.mark.parametrize("width", [1, 3], ids=["chain", "tree"])
@pytest.mark.parametrize("k", [1, 3, 7])
def test_every_draft_right_accepts_every_draft(decoded, k, width, monkeypatch):
    runtime, prompts, plains = decoded
    compactions = []
    compact = runtime.target.compact
    monkeypatch.setattr(runtime.target, "compact", lambda *a: compactions.append(1) or compact(*a))
    for r, plain in zip(oracle.oracle_runs(runtime, prompts, plains, k, 0.0, width=width), plains):
        assert r.output_ids == plain.output_ids
        counted = NEW - 1  # the prefill's token is not counted
        assert r.forwards == math.ceil(counted / (k + 1))
        assert r.acceptance_length == counted / r.forwards
        assert r.accepted[:-1] == [k] * (r.forwards - 1)
    assert bool(compactions) == (width > 1)  # a tree's accepted path leaves the first branch


@pytest.mark.parametrize("width", [1, 3], ids=["chain", "tree"])
@pytest.mark.parametrize("k", [1, 4])
def test_every_draft_wrong_accepts_nothing(decoded, k, width):
    runtime, prompts, plains = decoded
    for r, plain in zip(oracle.oracle_runs(runtime, prompts, plains, k, 1.0, width=width), plains):
        assert r.output_ids == plain.output_ids
        assert r.accepted == [0] * (NEW - 1) and r.acceptance_length == 1.0


@pytest.mark.parametrize("width", [1, 3], ids=["chain", "tree"])
def test_partly_wrong_drafts_stay_lossless_and_between(decoded, width):
    runtime, prompts, plains = decoded
    results = oracle.oracle_runs(runtime, prompts, plains, 5, 0.5, seed=3, width=width)
    assert all(r.output_ids == plain.output_ids for r, plain in zip(results, plains))
    al = sum(sum(r.emitted) for r in results) / sum(r.forwards for r in results)
    assert 1.0 < al < 6.0


def test_tree_at_the_shapes_cuda_graphs_replay_is_lossless(decoded):
    """Full-cache attention widths and a rounded-up cache, run eagerly."""
    _, prompts, plains = decoded
    runtime = Runtime(tiny_target(**TARGET))
    runtime.use_graphs = True
    runtime.target_step = EagerStep(runtime.target_step)
    results = oracle.oracle_runs(runtime, prompts, plains, 4, 0.3, seed=1, width=3)
    assert [r.output_ids for r in results] == [plain.output_ids for plain in plains]


def test_tree_candidates_are_distinct_and_hold_the_token_unless_wrong():
    drafter = oracle.OracleDrafter(4, list(range(40)), k=3, p=0.5, vocab_size=16, rng=random.Random(0), width=4)
    rows = [drafter.candidates(7) for _ in range(400)]
    assert all(len(set(r)) == 4 and all(0 <= t < 16 for t in r) for r in rows)
    held = sum(7 in r for r in rows) / len(rows)
    assert 0.4 < held < 0.6
    assert {r.index(7) for r in rows if 7 in r} == {0, 1, 2, 3}  # off the first branch too


@pytest.mark.parametrize("method", ["eagle3", "peagle", "dflash", "dspark"])
def test_at_a_heads_cost_the_head_drafts_every_round_and_the_oracle_decides(decoded, method):
    """A random head of each method's shipped config: its drafter runs each round (the cost measured), yet what
    is accepted is the oracle's: every draft at p = 0, none at p = 1, and the tokens are plain decoding's."""
    _, prompts, plains = decoded
    model = tiny_target(**TARGET)
    head = oracle.random_head(method, model, "tiny", draft_vocab_size=12)
    k = 3
    runtime = Runtime(model, head, oracle.TreeShape.chain(k))
    drafts = []
    draft = runtime.drafter.draft
    runtime.drafter.draft = lambda *a: drafts.append(1) or draft(*a)
    for p, accepted in ((0.0, k), (1.0, 0)):
        drafts.clear()
        results = oracle.oracle_runs(runtime, prompts, plains, k, p)
        assert [r.output_ids for r in results] == [plain.output_ids for plain in plains]
        assert all(r.accepted[:-1] == [accepted] * (r.forwards - 1) for r in results)
        assert len(drafts) == sum(r.forwards for r in results)
    with pytest.raises(ValueError, match="not a chain of K=2"):
        oracle.oracle_runs(runtime, prompts, plains, 2, 0.0)
