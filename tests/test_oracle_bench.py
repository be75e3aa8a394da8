"""The oracle drafter of scripts/bench/oracle.py: its acceptance is the one set by construction, and decoding
with it stays equal to plain decoding."""

import math

import pytest
import torch
from conftest import load_script, tiny_target

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


@pytest.mark.parametrize("k", [1, 3, 7])
def test_every_draft_right_accepts_every_draft(decoded, k):
    runtime, prompts, plains = decoded
    for r, plain in zip(oracle.oracle_runs(runtime, prompts, plains, k, 0.0), plains):
        assert r.output_ids == plain.output_ids
        counted = NEW - 1  # the prefill's token is not counted
        assert r.forwards == math.ceil(counted / (k + 1))
        assert r.acceptance_length == counted / r.forwards
        assert r.accepted[:-1] == [k] * (r.forwards - 1)


@pytest.mark.parametrize("k", [1, 4])
def test_every_draft_wrong_accepts_nothing(decoded, k):
    runtime, prompts, plains = decoded
    for r, plain in zip(oracle.oracle_runs(runtime, prompts, plains, k, 1.0), plains):
        assert r.output_ids == plain.output_ids
        assert r.accepted == [0] * (NEW - 1) and r.acceptance_length == 1.0


def test_partly_wrong_drafts_stay_lossless_and_between(decoded):
    runtime, prompts, plains = decoded
    results = oracle.oracle_runs(runtime, prompts, plains, 5, 0.5, seed=3)
    assert all(r.output_ids == plain.output_ids for r, plain in zip(results, plains))
    al = sum(sum(r.emitted) for r in results) / sum(r.forwards for r in results)
    assert 1.0 < al < 6.0
