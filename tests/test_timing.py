"""The paired speed verdict: intervals against hand-computed order statistics, and the bench loop on a fake
engine whose machine turns busy for a stretch of (simulated) wall time in the middle of the run."""

import random
from itertools import combinations_with_replacement
from math import exp, log
from statistics import median
from types import SimpleNamespace

import pytest

from inference.evaluate import TurnEngine, TurnResult, add_drafter, format_table, run_bench, summarise_drafters
from inference.timing import CANNOT_TELL, centre_and_interval, paired_ratios, rotation, signed_rank_k


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
    every token costs `slowdown` times as much (another job took the cores). `tokens_per_forward[name]`
    (call -> tokens) varies what a forward makes from turn to turn at the same speed per forward."""

    def __init__(self, seconds_per_token: dict, busy=(0.0, 0.0), slowdown=1.0, tokens=64, tokens_per_forward=None):
        self.cost, self.busy, self.slowdown, self.tokens = seconds_per_token, busy, slowdown, tokens
        self.per_forward = tokens_per_forward or {}
        self.drafters = tuple(n for n in seconds_per_token if n != "plain")
        self.clock, self.rng, self.calls = 0.0, random.Random(0), []

    def decode(self, drafter, prompts, max_new_tokens):
        results = []
        for _ in prompts:
            per_forward = self.per_forward.get(drafter, lambda call: 1)(len(self.calls))
            forwards = self.tokens // per_forward
            start, jitter = self.clock, self.rng.uniform(0.97, 1.03)
            for _ in range(forwards):
                load = self.slowdown if self.busy[0] <= self.clock < self.busy[1] else 1.0
                self.clock += self.cost[drafter] * jitter * load
            self.calls.append(drafter)
            ids = [7] * self.tokens
            results.append(TurnResult("x", ids, self.tokens, forwards, self.tokens, self.clock - start, self.tokens))
        return results


class Tokenizer:
    """No chat template: the loop joins the turns' text and tokenizes it."""

    chat_template = None

    def __call__(self, text):
        return SimpleNamespace(input_ids=[ord(c) % 50 for c in text])


PROMPTS = [{"question_id": i, "category": "", "turns": [f"question {i}", f"and then {i}"]} for i in range(5)]
TRUE = {"plain": 0.030, "spec": 0.030 / 1.10, "ngram": 0.030 / 1.20}  # the head 1.10x, n-gram 1.20x plain


def bench(engine, prompts=PROMPTS, repeats=1):
    results = run_bench(engine, Tokenizer(), prompts, 64, repeats=repeats)
    return results, summarise_drafters(results, 1, 1, "test lookup")


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
    assert "the machine was busy" in table and "left out of the speedups" in table
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
    # pooled over the same rounds (the figure before pairing), the load weighs on whichever it overlapped
    assert s["spec_tokens_per_s"] != pytest.approx(s["plain_tokens_per_s"] * 1.10, rel=0.05)


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
    assert [len(t["timing"]) for t in turns] == [3, 3, 3, 3] and s["timed_pairs"] == 12
    assert [r["order"] for r in turns[0]["timing"]] == [list(rotation(("plain", "spec", "ngram"), i)) for i in range(3)]
    assert engine.calls.count("spec") == 12  # AL from the first round, the timing from all three
    engine.cost["late"] = 0.015
    add_drafter(results, engine, "late", 64, repeats=2)
    assert len(paired_ratios(turns, "late", "plain")) == 8
    assert all(r["order"] in (["plain", "late"], ["late", "plain"]) for t in turns for r in t["timing"][3:])
