"""Prompt-lookup drafting: the lookup rule, lossless greedy decoding, the exact sampling rule for a
one-hot draft, and the n-gram row of eagle-eval."""

import json
import random

import pytest
import torch
from conftest import EagerStep, tiny_target

from eagle_cli.evaluate import main
from inference.evaluate import chat_ids, load_bench
from inference.generate import Runtime
from inference.prompt_lookup import PromptLookup, chain_tree, propose
from inference.sampling import Sampler

# ------------------------------------------------------------------------------------ the rule


def reference_propose(history, k):
    """The rule as stated: n from 4 down to 2, the newest earlier occurrence of the suffix n-gram."""
    for n in range(4, 1, -1):
        for start in range(len(history) - n - 1, -1, -1):
            if history[start : start + n] == history[len(history) - n :]:
                return history[start + n : start + n + k]
    return []


def test_longest_ngram_wins_over_a_newer_shorter_one():
    # [6, 7] last occurred at 5 (-> 9), but [5, 6, 7] occurred at 0 (-> 8)
    assert propose([5, 6, 7, 8, 1, 6, 7, 9, 2, 5, 6, 7], 3) == [8, 1, 6]


def test_ngrams_longer_than_four_count_as_four_grams():
    # the 5-gram 1 2 3 4 5 occurred at 0 (-> 10); its 4-gram suffix 2 3 4 5 occurred since (-> 11)
    assert propose([1, 2, 3, 4, 5, 10, 9, 2, 3, 4, 5, 11, 1, 2, 3, 4, 5], 2) == [11, 1]


def test_most_recent_occurrence():
    assert propose([1, 2, 20, 1, 2, 30, 1, 2], 1) == [30]


@pytest.mark.parametrize(
    "history", [[], [1], [1, 2, 3, 4], [1, 5, 2, 1]], ids=["empty", "one", "distinct", "unigram-only"]
)
def test_no_match_no_proposal(history):
    assert propose(history, 3) == []


def test_proposal_is_truncated_to_k_and_to_the_history():
    history = [1, 2, 3, 4, 5, 6, 1, 2]
    assert propose(history, 3) == [3, 4, 5]
    assert propose(history, 10) == [3, 4, 5, 6, 1, 2]  # the continuation ends where the history does
    assert propose([7, 7, 7], 4) == [7]  # an occurrence overlapping the suffix


def test_rule_matches_its_statement_on_random_histories():
    rng = random.Random(0)
    for _ in range(2000):
        history = [rng.randrange(3) for _ in range(rng.randrange(12))]
        k = rng.randrange(1, 5)
        assert propose(history, k) == reference_propose(history, k), history


# ------------------------------------------------------------------------------------ the runtime


# a tiny random Llama over 16 tokens: its greedy output soon repeats, so lookups get accepted
TARGET = dict(vocab_size=16, num_hidden_layers=4, max_position_embeddings=256, rope_theta=10000.0)


def counted_per_round(result):
    """Each verification forward emitted its accepted drafts and one more token; the last one may
    stop short (eos, max_new_tokens)."""
    rounds = list(zip(result.emitted, result.accepted))
    return (
        len(rounds) == result.forwards
        and all(e == a + 1 for e, a in rounds[:-1])
        and rounds[-1][0] <= rounds[-1][1] + 1
    )


@pytest.mark.parametrize("graph_shapes", [False, True], ids=["eager", "graph-shapes"])
def test_tiny_greedy_lookup_equals_plain(graph_shapes):
    """Also with the shapes CUDA graphs replay (full-cache widths, caches rounded up), run eagerly."""
    runtime = Runtime(tiny_target(**TARGET))
    if graph_shapes:
        runtime.use_graphs = True
        runtime.target_step = EagerStep(runtime.target_step)
    accepted = 0
    for i in range(4):
        prompt = torch.randint(0, 16, (5 + 4 * i,)).tolist()
        drafter = PromptLookup(prompt, 3)
        lookup = runtime.generate(prompt, 40, drafter)
        assert lookup.output_ids == runtime.generate_plain(prompt, 40).output_ids
        # the lookup saw every committed token (the last round ends before its catch-up)
        assert drafter.history == prompt + lookup.output_ids[: 40 - lookup.emitted[-1]]
        assert sum(lookup.emitted) == 39 and counted_per_round(lookup)
        assert all(0 <= a <= 3 for a in lookup.accepted)
        accepted += sum(lookup.accepted)
    assert accepted > 20


def test_one_hot_draft_sampling_emits_the_target_distribution():
    """`Runtime.accept` on a lookup's chain at temperature 1: the first emitted token is drawn from
    the root's p whether the draft is accepted or not (rejection samples p without the draft), and
    after an accepted draft the bonus token from the draft's p."""
    torch.manual_seed(0)
    runtime = Runtime(tiny_target(**TARGET), sampler=Sampler(temperature=1.0))
    logits = torch.randn(2, 16)
    logits[0, 5] = logits[0].logsumexp(-1)  # p(5) = 1/2 at the root: half the drafts are rejected
    p = logits.softmax(-1)
    tree = chain_tree(torch.tensor([3, 5]))
    first, bonus_after_accept, n = torch.zeros(16), torch.zeros(16), 20000
    for _ in range(n):
        path, bonus, tokens = runtime.accept(tree, logits)
        emitted = [tokens[i] for i in path] + [bonus]
        first[emitted[0]] += 1
        if path:
            bonus_after_accept[emitted[1]] += 1
    assert (first / n - p[0]).abs().max() < 0.015
    assert (bonus_after_accept / bonus_after_accept.sum() - p[1]).abs().max() < 0.025
    # and end to end, sampling through the same rounds
    out = runtime.generate_lookup(torch.randint(0, 16, (12,)).tolist(), 30, 3)
    assert len(out.output_ids) == 30 and sum(out.emitted) == 29 and out.forwards == len(out.emitted)


@pytest.fixture(scope="module")
def smollm2_runtime(smollm2):
    model, tokenizer = smollm2
    return Runtime(model, eos_token_ids=[tokenizer.eos_token_id]), tokenizer


def test_smollm2_greedy_lookup_equals_plain_and_al_recounts(smollm2_runtime):
    runtime, tokenizer = smollm2_runtime
    prompts = [
        chat_ids(tokenizer, [{"role": "user", "content": p["turns"][0]}])
        for b in ("humaneval", "gsm8k")
        for p in load_bench(b, 1)
    ]
    forwards = tokens = 0
    for ids in prompts:
        lookup = runtime.generate_lookup(ids, 32, 3)
        assert lookup.output_ids == runtime.generate_plain(ids, 32).output_ids
        assert counted_per_round(lookup) and len(lookup.accepted) == lookup.forwards
        forwards, tokens = forwards + lookup.forwards, tokens + len(lookup.output_ids) - 1
        assert lookup.acceptance_length == (len(lookup.output_ids) - 1) / lookup.forwards
    assert tokens / forwards > 1.1  # code and arithmetic repeat the prompt's names and numbers


def test_smollm2_repetition_is_drafted_for_free(smollm2_runtime):
    runtime, tokenizer = smollm2_runtime
    text = "Repeat this list exactly, one item per line: apple, banana, cherry, date, elderberry, fig, grape."
    ids = chat_ids(tokenizer, [{"role": "user", "content": text}])
    lookup = runtime.generate_lookup(ids, 32, 3)
    assert lookup.output_ids == runtime.generate_plain(ids, 32).output_ids
    assert "banana, cherry" in tokenizer.decode(lookup.output_ids)
    assert lookup.acceptance_length > 2.0


# ------------------------------------------------------------------------------------ eagle-eval


def eval_args(target, draft, out, *extra):
    return [
        "--target",
        str(target),
        "--draft",
        str(draft),
        "--bench",
        "mt_bench",
        "--num-prompts",
        "2",
        "--max-new-tokens",
        "12",
        "--out",
        str(out),
        *extra,
    ]


def recount(record, drafter):
    turns = [t for p in record["prompts"] for t in p["turns"]]
    return sum(len(t[drafter]["output_ids"]) - 1 for t in turns) / sum(t[drafter]["forwards"] for t in turns)


def test_eval_prints_and_saves_the_ngram_row(tiny_llama_dir, tiny_head_dir, tmp_path, capsys):
    out = tmp_path / "r.json"
    main(eval_args(tiny_llama_dir, tiny_head_dir, out, "--chain", "3"))
    printed = capsys.readouterr().out
    saved = json.loads(out.read_text())
    summary, ngram = saved["summary"], saved["summary"]["ngram"]
    assert saved["drafting"]["ngram"] == 3
    assert ngram["acceptance_length"] == pytest.approx(recount(saved, "ngram"), abs=1e-12)
    assert ngram["acceptance_length"] > 1.2  # a random tiny model repeats itself: lookups are accepted
    assert summary["acceptance_length"] == pytest.approx(recount(saved, "spec"), abs=1e-12)  # the head's, as before
    assert ngram["turns"] == 4 and ngram["turns_identical_to_plain"] == 4
    assert all(t["ngram"]["identical"] for p in saved["prompts"] for t in p["turns"])
    assert len(ngram["acceptance_per_position"]) == 3
    # head + n-gram beside them, lossless, drafting at least as many tokens a forward as the lookup alone
    hybrid = summary["drafters"]["hybrid"]
    assert hybrid["turns_identical_to_plain"] == 4 and hybrid["acceptance_length"] == pytest.approx(
        recount(saved, "hybrid"), abs=1e-12
    )
    assert hybrid["acceptance_length"] >= ngram["acceptance_length"]
    # 4 turns, each timed once with plain, the head, n-gram and both in a row: too few pairs to tell which is faster
    rounds = [r for p in saved["prompts"] for t in p["turns"] for r in t["timing"]]
    assert len(rounds) == 4 and all(sorted(r["seconds"]) == ["hybrid", "ngram", "plain", "spec"] for r in rounds)
    assert summary["timed_pairs"] == 4 and summary["head_beats_ngram"] is None
    assert summary["verdict"]["deploy"] is None and "cannot tell" in summary["verdict"]["text"]
    assert any(line.strip().startswith("head + n-gram") for line in printed.splitlines())
    row = next(line for line in printed.splitlines() if line.strip().startswith("n-gram (free"))
    assert f"{ngram['acceptance_length']:.3f}" in row and f"{ngram['speedup']:.2f}x" in row and "4/4" in row
    verdict = next(line for line in printed.splitlines() if "head vs n-gram (free):" in line)
    assert f"head AL {summary['acceptance_length']:.2f} vs {ngram['acceptance_length']:.2f}" in verdict
    assert verdict.endswith("or on a quiet machine") and "the head pays" not in verdict


def test_eval_tree_uses_its_depth_and_no_ngram_skips(tiny_llama_dir, tiny_head_dir, tmp_path, capsys):
    out = tmp_path / "r.json"
    main(eval_args(tiny_llama_dir, tiny_head_dir, out, "--tree", "2,2,3"))
    saved = json.loads(out.read_text())
    assert (
        saved["drafting"]["ngram"] == 2
        and max(a for p in saved["prompts"] for t in p["turns"] for a in t["ngram"]["accepted"]) <= 2
    )
    capsys.readouterr()
    main(eval_args(tiny_llama_dir, tiny_head_dir, out, "--chain", "2", "--no-ngram"))
    saved = json.loads(out.read_text())
    assert "ngram" not in saved["summary"] and saved["drafting"]["ngram"] is None
    assert "ngram" not in saved["prompts"][0]["turns"][0]
    assert "n-gram" not in capsys.readouterr().out


def test_eval_draft_ngram_evaluates_prompt_lookup_alone(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "r.json"
    main(eval_args(tiny_llama_dir, "ngram", out, "--chain", "2"))
    saved = json.loads(out.read_text())
    assert saved["summary"]["acceptance_length"] == pytest.approx(recount(saved, "spec"), abs=1e-12)
    assert saved["summary"]["acceptance_length"] > 1.2 and saved["summary"]["turns_identical_to_plain"] == 4
    assert "ngram" not in saved["summary"]
    assert "prompt lookup (no head) K=2" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--draft ngram evaluates prompt lookup alone"):
        main(eval_args(tiny_llama_dir, "ngram", out, "--tree", "2,2,3"))
