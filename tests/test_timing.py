"""The paired speed verdict: intervals against hand-computed order statistics, and the bench loop on a fake
engine whose machine turns busy for a stretch of (simulated) wall time in the middle of the run, whose prompts
take a prefill as long as they are, whose turns repeat, and whose rounds may make no forward; the verdict's
choice of what to deploy among the head, free drafting and head + n-gram."""

import random
from itertools import combinations_with_replacement
from math import exp, log
from statistics import median
from types import SimpleNamespace

import pytest

from inference.evaluate import (
    Configuration,
    TurnEngine,
    TurnResult,
    add_drafter,
    format_table,
    run_bench,
    summarise_drafters,
)
from inference.timing import CANNOT_TELL, centre_and_interval, paired, rotation, signed_rank_k


def test_the_interval_uses_the_signed_rank_tables_critical_values():
    """k - 1 is the one-sided 5% critical value of Wilcoxon's signed-rank statistic in the published tables
    (n = 5: 0, 8: 5, 10: 10, 20: 60, 30: 151); the normal approximation past 80 rounds stays within one of
    the exact count there."""
    assert [signed_rank_k(n) for n in (4, 5, 8, 10, 20, 30)] == [0, 1, 6, 11, 61, 152]
    assert abs(signed_rank_k(81) - exact_k(81)) <= 1


def exact_k(n):
    """signed_rank_k's exact count at any n, by enumerating the rank sums' distribution with integers."""
    counts = [1]
    for r in range(1, n + 1):
        counts = [
            (counts[s] if s < len(counts) else 0) + (counts[s - r] if s >= r else 0) for s in range(len(counts) + r)
        ]
    k, tail = 0, 0
    while 20 * (tail + counts[k]) <= 2**n:
        tail += counts[k]
        k += 1
    return k


def test_centre_and_interval_are_the_walsh_averages_median_and_order_statistics():
    ratios = [exp(x) for x in (0.0, 0.1, 0.2, 0.3, 1.5)]  # one round a load hit
    walsh = sorted((a + b) / 2 for a, b in combinations_with_replacement([0.0, 0.1, 0.2, 0.3, 1.5], 2))
    centre, interval = centre_and_interval(ratios)
    assert centre == pytest.approx(exp(median(walsh)), rel=1e-12) and centre < exp(0.3)  # the outlier moves it little
    assert interval == pytest.approx((exp(walsh[0]), exp(walsh[-1])), rel=1e-12)  # n = 5: k = 1
    assert centre_and_interval(ratios[:4])[1] is None


def test_rotation_puts_every_decoding_in_every_place():
    names = ("plain", "spec", "ngram")
    orders = [rotation(names, i) for i in range(3)]
    assert orders == [("plain", "spec", "ngram"), ("spec", "ngram", "plain"), ("ngram", "plain", "spec")]
    assert {o[0] for o in orders} == set(names) and rotation(names, 4) == orders[1]


class BusyMachine(TurnEngine):
    """Decodes every prompt into `tokens` tokens at `seconds_per_token[name]` (each drafter's true speed, a
    3% seeded jitter per call), on a simulated clock; between `busy[0]` and `busy[1]` seconds of that clock
    every token costs `slowdown` times as much (another job took the cores), and call i in `slow_calls` costs
    `slow_calls[i]` times as much. `tokens_per_forward[name]` (call -> tokens) varies what a forward makes from
    turn to turn at the same speed per forward. With `prefill_per_token` the prompt's forward comes first, its
    token the first of the turn, and the forwards after it make the rest (`answer_tokens(prompt length)` of
    them, else `tokens`)."""

    def __init__(
        self,
        seconds_per_token: dict,
        busy=(0.0, 0.0),
        slowdown=1.0,
        tokens=64,
        tokens_per_forward=None,
        slow_calls=None,
        prefill_per_token=0.0,
        answer_tokens=None,
    ):
        self.cost, self.busy, self.slowdown, self.tokens = dict(seconds_per_token), busy, slowdown, tokens
        self.per_forward = tokens_per_forward or {}
        self.slow_calls, self.prefill_per_token = slow_calls or {}, prefill_per_token
        self.answer_tokens = answer_tokens or (lambda n: tokens)
        self.drafters = tuple(n for n in seconds_per_token if n != "plain")
        self.clock, self.rng, self.calls = 0.0, random.Random(0), []

    def decode(self, drafter, prompts, max_new_tokens):
        results = []
        for prompt in prompts:
            tokens = self.answer_tokens(len(prompt))
            start, jitter = self.clock, self.rng.uniform(0.97, 1.03)
            load = self.slow_calls.get(len(self.calls), 1.0)
            self.clock += self.prefill_per_token * len(prompt) * jitter * load
            prefill = self.clock - start
            made_by_forwards = tokens - 1 if self.prefill_per_token else tokens
            forwards = -(-made_by_forwards // self.per_forward.get(drafter, lambda call: 1)(len(self.calls)))
            for _ in range(forwards):
                busy = self.slowdown if self.busy[0] <= self.clock < self.busy[1] else 1.0
                self.clock += self.cost[drafter] * jitter * busy * load
            self.calls.append(drafter)
            results.append(
                TurnResult("x", [7] * tokens, tokens, forwards, made_by_forwards, self.clock - start, tokens, prefill)
            )
        return results


class Tokenizer:
    """No chat template: the loop joins the turns' text and tokenizes it."""

    chat_template = None

    def __call__(self, text):
        return SimpleNamespace(input_ids=[ord(c) % 50 for c in text])


PROMPTS = [{"question_id": i, "category": "", "turns": [f"question {i}", f"and then {i}"]} for i in range(5)]
TRUE = {"plain": 0.030, "spec": 0.030 / 1.10, "ngram": 0.030 / 1.20}  # the head 1.10x, n-gram 1.20x plain
CONFIGURATIONS = {
    "spec": Configuration("head", "head", "serve --head"),
    "ngram": Configuration("n-gram (free, test lookup)", "free", "serve --ngram"),
    "hybrid": Configuration("head + n-gram", "hybrid", "serve --ngram,head"),
    "late": Configuration("late", "free", "serve --late"),
}


def bench(engine, prompts=PROMPTS, repeats=1):
    results = run_bench(engine, Tokenizer(), prompts, 64, repeats=repeats)
    return results, summarise_drafters(results, 1, {n: CONFIGURATIONS[n] for n in ("plain", *engine.drafters)[1:]})


def test_a_load_in_the_middle_of_the_run_moves_neither_speedup_nor_the_verdict():
    """An 8x slowdown from 10 s to 40 s of a ~60 s run: one drafter after another (the loop before) would put it
    on whichever ran then; in pairs the speedups stay within 5% of the true ones, the verdict is that the head
    does not beat free drafting (never that it pays), and the table says the machine was busy."""
    engine = BusyMachine(TRUE, busy=(10.0, 40.0), slowdown=8.0)
    results, s = bench(engine)
    assert engine.clock > 40.0  # the load came and went within the run
    assert s["speedup"] == pytest.approx(1.10, rel=0.05) and s["ngram"]["speedup"] == pytest.approx(1.20, rel=0.05)
    assert s["speedup_interval"][0] < 1.10 < s["speedup_interval"][1]
    assert s["head_beats_ngram"] is False
    table = format_table(s, "busy")
    assert "the head does not beat free drafting" in table and "the head pays" not in table
    assert "the machine was busy" in table and "left out of every figure" in table
    # by how much: the rounds the load slowed, their slowdown, and the pairs left
    left_out = s["load"]["rounds_left_out"]
    assert 1 <= left_out <= 3 and s["load"]["largest_slowdown"] > 4 and s["timed_pairs"] == 10 - left_out
    # the JSON keeps each round's order, seconds and tokens: the speedup recomputes from them
    turns = [t for r in results for t in r["turns"]]
    assert [t["timing"][0]["order"][0] for t in turns[:3]] == ["plain", "spec", "ngram"]
    logs = [
        log(r["tokens"]["spec"] / r["seconds"]["spec"]) - log(r["tokens"]["plain"] / r["seconds"]["plain"])
        for t in turns
        for r in t["timing"]
        if max(r["seconds"][n] / (TRUE[n] * 64) for n in TRUE) < 1.5  # the rounds the load did not slow
    ]
    assert len(logs) == s["timed_pairs"]
    assert s["speedup"] == pytest.approx(exp(median((a + b) / 2 for a, b in combinations_with_replacement(logs, 2))))
    # the JSON names each round left out, with why
    slowed = [max(t["timing"][0]["seconds"][n] / (TRUE[n] * 64) for n in TRUE) >= 1.5 for t in turns]
    assert [(d["turn"], d["round"]) for d in s["load"]["left_out"]] == [(t, 0) for t, hit in enumerate(slowed) if hit]
    assert all("a load" in d["why"] and d["slowdown"] > 2 for d in s["load"]["left_out"])


def test_the_same_load_on_one_drafter_after_another_decides_the_old_verdict():
    """What the pairs protect against: plain first for every turn, then the head, then n-gram (the loop before),
    with the load during the head's stretch, make the head look several times slower than it is."""
    engine = BusyMachine(TRUE, busy=(19.3, 150.0), slowdown=8.0)
    tokens = {name: 0.0 for name in TRUE}
    seconds = dict(tokens)
    for name in TRUE:
        for run in engine.decode(name, [[1]] * 10, 64):
            tokens[name] += run.timed_tokens
            seconds[name] += run.seconds
    pooled = {name: tokens[name] / seconds[name] for name in TRUE}
    assert pooled["spec"] / pooled["plain"] < 0.2 and pooled["ngram"] / pooled["plain"] > 1.1  # 1.10x, 1.20x in truth
    results, s = bench(BusyMachine(TRUE, busy=(19.3, 150.0), slowdown=8.0))
    assert s["speedup"] == pytest.approx(1.10, rel=0.05) and s["head_beats_ngram"] is False


def test_a_clear_win_pays_and_too_few_pairs_cannot_tell():
    wins = {"plain": 0.030, "spec": 0.020, "ngram": 0.029}
    _, s = bench(BusyMachine(wins))
    assert s["head_beats_ngram"] is True and "the head pays" in format_table(s, "")
    assert "busy" not in format_table(s, "")
    _, few = bench(BusyMachine(wins), PROMPTS[:2])  # 4 paired turns bound no 90% interval
    assert few["speedup_interval"] is None and few["head_beats_ngram"] is None
    table = format_table(few, "")
    assert CANNOT_TELL in table and "too few to bound" in table and "the head pays" not in table


def test_a_load_on_the_drafters_alone_is_found_and_left_out():
    """As a real CPU hog did: 45 s of every core taken while the head and n-gram decoded turns 4-5 (each
    forward then ~10x slower), plain decoding untouched: those rounds are found by their time per forward and
    left out, and the speedup is the idle one."""
    engine = BusyMachine(TRUE, busy=(18.0, 63.0), slowdown=10.0)
    _, s = bench(engine)
    assert s["load"]["rounds_left_out"] >= 1 and s["speedup"] == pytest.approx(1.10, rel=0.05)
    assert s["head_beats_ngram"] is False and "the machine was busy" in format_table(s, "")


def test_a_drafter_whose_acceptance_varies_is_not_a_busy_machine():
    """The head makes 1, 2 or 4 tokens a forward turn by turn (its speed varies 4x), at one time per forward:
    no round is left out and nothing says the machine was busy."""
    varying = {"spec": lambda call: (1, 2, 4)[call % 3]}
    _, s = bench(BusyMachine({"plain": 0.030, "spec": 0.036, "ngram": 0.029}, tokens_per_forward=varying))
    assert s["load"]["rounds_left_out"] == 0 and s["timed_pairs"] == 10 and not s["busy"]


def test_a_head_within_n_grams_noise_cannot_tell():
    close = {"plain": 0.030, "spec": 0.0250, "ngram": 0.0252}  # 0.8% apart, inside a 3% jitter
    _, s = bench(BusyMachine(close))
    assert s["head_beats_ngram"] is None and CANNOT_TELL in format_table(s, "")


def test_repeats_time_every_turn_again_in_rotating_orders_and_add_drafter_pairs_with_plain():
    engine = BusyMachine(TRUE)
    results, s = bench(engine, PROMPTS[:2], repeats=3)
    turns = [t for r in results for t in r["turns"]]
    assert [len(t["timing"]) for t in turns] == [3, 3, 3, 3] and s["timed_rounds"] == 12
    assert [r["order"] for r in turns[0]["timing"]] == [list(rotation(("plain", "spec", "ngram"), i)) for i in range(3)]
    assert engine.calls.count("spec") == 12  # AL from the first round, the timing from all three
    engine.cost["late"] = 0.015
    add_drafter(results, engine, "late", 64, repeats=2)
    assert paired(turns, "late", "plain")["rounds"] == 8 and paired(turns, "late", "plain")["pairs"] == 4
    assert all(r["order"] in (["plain", "late"], ["late", "plain"]) for t in turns for r in t["timing"][3:])


# ------------------------------------------------------------------ prefill, repeats, no forwards, one set of rounds

DOCUMENT = "x" * 3000  # a long document with a short answer, beside short questions
MIXED = [{"question_id": i, "category": "", "turns": [DOCUMENT if i % 4 == 1 else f"question {i}"]} for i in range(8)]


def test_a_long_prompt_with_a_short_answer_is_not_taken_for_a_load():
    """On an idle machine, a 3000-token prefill before a 4-token answer makes the turn slow per forward end to end
    (17x a short question's): no round is left out, and the speedup stays end to end, prefill included."""
    engine = BusyMachine(TRUE, prefill_per_token=0.0005, answer_tokens=lambda n: 4 if n > 1000 else 64)
    results, s = bench(engine, MIXED)
    turns = [t for r in results for t in r["turns"]]
    end_to_end = [r["seconds"]["plain"] / r["forwards"]["plain"] for t in turns for r in t["timing"]]
    assert max(end_to_end) / min(end_to_end) > 10  # what a per-forward rule with the prefill in it sees
    assert s["load"]["rounds_left_out"] == 0 and not s["busy"] and s["timed_pairs"] == 8
    logs = [
        log(r["tokens"]["spec"] / r["seconds"]["spec"]) - log(r["tokens"]["plain"] / r["seconds"]["plain"])
        for t in turns
        for r in t["timing"]
    ]
    assert s["speedup"] == pytest.approx(centre_and_interval([exp(x) for x in logs])[0], rel=1e-12)
    assert s["speedup"] < 1.10  # the long prompts' turns gain little: they count, prefill and all


def test_repeats_of_a_turn_count_once():
    """--repeats 3 on 5 turns: the interval comes from 5 paired figures, each the mean log ratio of a turn's rounds;
    4 turns repeated 3 times are 4 figures, too few to bound an interval, not 12."""
    engine = BusyMachine(TRUE)
    results, s = bench(engine, [{"question_id": i, "category": "", "turns": ["q"]} for i in range(5)], repeats=3)
    turns = [t for r in results for t in r["turns"]]
    figures = [
        sum(log(r["tokens"]["spec"] / r["seconds"]["spec"]) - log(r["tokens"]["plain"] / r["seconds"]["plain"])
            for r in t["timing"]) / 3
        for t in turns
    ]  # fmt: skip
    assert s["timed_pairs"] == 5 and s["timed_rounds"] == 15
    centre, interval = centre_and_interval([exp(x) for x in figures])
    assert s["speedup"] == pytest.approx(centre, rel=1e-12) and s["speedup_interval"] == pytest.approx(interval)
    _, four = bench(BusyMachine(TRUE), PROMPTS[:2], repeats=3)
    assert four["timed_pairs"] == 4 and four["speedup_interval"] is None and four["head_beats_ngram"] is None


def test_turns_that_make_no_forward_neither_crash_nor_make_up_an_al():
    """--max-new-tokens 1: every turn ends at the prefill's token, 0 counted forwards in every round. The speedup is
    still measured end to end; AL is not made up, and the table says why there is none."""
    engine = BusyMachine(TRUE, tokens=1, prefill_per_token=0.001)
    _, s = bench(engine)
    assert s["verify_forwards"] == 0 and s["acceptance_length"] is None and s["ngram"]["acceptance_length"] is None
    assert s["speedup"] == pytest.approx(1.0, rel=0.1) and s["load"]["rounds_left_out"] == 0
    table = format_table(s, "one token")
    assert "every turn ended at its first token, so no AL" in table and "0.000" not in table


def test_every_round_left_out_gives_no_figure_not_zero():
    """One turn, three rounds, a load on a different decoding in each (plain in round 0, the head in 1, n-gram in 2):
    every round is left out, so there is no speedup and no verdict, never '0.00x'."""
    engine = BusyMachine(TRUE, slow_calls={0: 5.0, 3: 5.0, 6: 5.0})
    _, s = bench(engine, [{"question_id": 0, "category": "", "turns": ["q"]}], repeats=3)
    table = format_table(s, "all busy")
    assert "0.00x" not in table and "no timed pair" in table and "no verdict" in table
    assert s["speedup"] is None and s["spec_tokens_per_s"] is None and s["verdict"]["deploy"] is None
    assert s["load"]["rounds_left_out"] == 3
    assert [d["decoding"] for d in s["load"]["left_out"]] == ["plain", "spec", "ngram"]


def test_tokens_per_s_read_the_rounds_the_speedups_read():
    """A load on the head's decodes of turns 4-5: those rounds are left out of the tokens/s columns as of the
    speedups, so the columns agree with the speedup instead of pooling the slowed rounds."""
    engine = BusyMachine(TRUE, busy=(18.0, 63.0), slowdown=10.0)
    results, s = bench(engine)
    turns = [t for r in results for t in r["turns"]]
    kept = [r for t in turns for r in t["timing"] if max(r["seconds"][n] / (TRUE[n] * 64) for n in TRUE) < 1.5]
    assert len(kept) < len(turns)
    for name, column in (("spec", "spec_tokens_per_s"), ("plain", "plain_tokens_per_s")):
        pooled = sum(r["tokens"][name] for r in kept) / sum(r["seconds"][name] for r in kept)
        assert s[column] == pytest.approx(pooled, rel=1e-12)
    assert s["spec_tokens_per_s"] / s["plain_tokens_per_s"] == pytest.approx(1.10, rel=0.05)


# ------------------------------------------------------------------ the verdict: what to deploy


def test_the_verdict_names_the_fastest_configuration_with_its_serve_flags():
    fast_hybrid = {"plain": 0.030, "spec": 0.030 / 1.10, "ngram": 0.030 / 1.20, "hybrid": 0.030 / 1.45}
    _, s = bench(BusyMachine(fast_hybrid))
    assert s["verdict"]["deploy"] == "hybrid" and s["verdict"]["serve"] == "serve --ngram,head"
    line = next(x for x in format_table(s, "").splitlines() if "verdict:" in x)
    assert line.strip().startswith("verdict: deploy head + n-gram (serve --ngram,head): 1.00 tokens/forward")
    assert "head + n-gram" in format_table(s, "") and f"{s['drafters']['hybrid']['speedup']:.2f}x" in line


def test_the_verdict_names_free_drafting_or_plain_decoding_where_they_are_best():
    _, s = bench(BusyMachine({**TRUE, "hybrid": 0.030 / 1.05}))
    assert s["verdict"]["deploy"] == "ngram" and "deploy n-gram (free, test lookup)" in s["verdict"]["text"]
    _, slow = bench(BusyMachine({"plain": 0.030, "spec": 0.040, "ngram": 0.035, "hybrid": 0.045}))
    assert slow["verdict"]["deploy"] == "plain" and "deploy plain decoding" in slow["verdict"]["text"]


def test_the_verdict_cannot_tell_between_two_configurations_within_noise():
    close = {"plain": 0.030, "spec": 0.030 / 1.10, "ngram": 0.030 / 1.30, "hybrid": 0.030 / 1.305}
    _, s = bench(BusyMachine(close))
    assert s["verdict"]["deploy"] is None and "serve" not in s["verdict"]
    text = s["verdict"]["text"]
    assert "cannot tell n-gram (free, test lookup) from head + n-gram" in text or (
        "cannot tell head + n-gram from n-gram (free, test lookup)" in text
    )


def test_two_free_types_within_noise_still_name_free_drafting():
    """llama.cpp's free types often tie: where the fastest beats the head and head + n-gram in pairs but not another
    free type, the verdict still says to deploy free drafting, naming the fastest and the one as fast."""
    engine = BusyMachine({**TRUE, "hybrid": 0.030 / 1.05, "late": 0.030 / 1.205})
    _, s = bench(engine)
    assert s["verdict"]["deploy"] == "late" and s["verdict"]["serve"] == "serve --late"
    assert "as fast within noise: n-gram (free, test lookup)" in s["verdict"]["text"]
