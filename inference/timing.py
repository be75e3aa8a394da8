"""Speed measured in pairs, so a verdict holds on a busy machine.

Every turn is decoded plainly and by each drafter one right after another, in an order that rotates from
round to round (`rotation`), so a load that comes and goes during a run hits all of them alike instead of
whichever drafter happened to be running. Each round gives a paired ratio (a drafter's tokens/s over plain
decoding's, or over another drafter's), end to end, prefill included. A turn's rounds are repeats of one
greedy decode, not independent draws, so each turn gives one paired figure: the mean of its rounds' log
ratios (`turn_log_ratios`). A speedup is the Hodges-Lehmann estimate of the turns' figures (the median of
the pairwise means of their logs: robust to a turn a load hit on one side, nearly as tight as a mean) with
its Wilcoxon signed-rank interval, which assumes only that the turns' figures are independent and spread
symmetrically about their centre. Where that interval does not settle a question (it holds 1.0, or there
are too few turns to bound it) the verdict says it cannot tell rather than guess.

A round in which a load slowed one of the decodings (`slowness`) is left out of every figure, the tokens/s
columns included, and the JSON names it with why (`left_out`). A load shows in the time per forward of the
decode after the prefill: a long prompt makes its prefill long, never its decode forwards much slower, so it
is never taken for a load.
"""

from math import exp, floor, log, sqrt
from statistics import NormalDist, median

LEVEL = 0.90  # the intervals' coverage, at least
BUSY = 2.0  # a decoding taking this many times its usual time per forward in a round: a load came (left out)
EXACT_UP_TO = 80  # rounds; beyond, the signed-rank statistic's normal approximation


def rotation(names: tuple[str, ...], i: int) -> tuple[str, ...]:
    """Round i's order: `names` rotated by i, so each takes each place equally often."""
    i %= len(names)
    return names[i:] + names[:i]


def walsh_averages(xs: list[float]) -> list[float]:
    """The means of every pair of `xs`, each with itself included, sorted."""
    return sorted((a + b) / 2 for i, a in enumerate(xs) for b in xs[i:])


def signed_rank_k(n: int, level: float = LEVEL) -> int:
    """k such that the k-th smallest to the k-th largest Walsh average of n draws holds their centre with
    probability >= level: one more than the largest signed-rank sum whose lower tail is <= (1 - level) / 2
    under the null (each of the 2^n sign patterns equally likely); 0 where no k does (n < 5 at 90%)."""
    alpha = (1 - level) / 2
    if n > EXACT_UP_TO:
        mean, sd = n * (n + 1) / 4, sqrt(n * (n + 1) * (2 * n + 1) / 24)
        return max(0, floor(mean + NormalDist().inv_cdf(alpha) * sd - 0.5) + 1)
    probs = [1.0]  # P(sum of the ranks with a + sign = s), built rank by rank
    for r in range(1, n + 1):
        probs = [
            ((probs[s] if s < len(probs) else 0.0) + (probs[s - r] if s >= r else 0.0)) / 2
            for s in range(len(probs) + r)
        ]
    k, tail = 0, 0.0
    while tail + probs[k] <= alpha:
        tail += probs[k]
        k += 1
    return k


def centre_and_interval(ratios: list[float], level: float = LEVEL) -> tuple[float, tuple[float, float] | None]:
    """The Hodges-Lehmann estimate of `ratios` and its signed-rank interval (None: too few to bound it)."""
    walsh = walsh_averages([log(r) for r in ratios])
    m, k = len(walsh), signed_rank_k(len(ratios), level)
    centre = exp((walsh[(m - 1) // 2] + walsh[m // 2]) / 2)
    return centre, ((exp(walsh[k - 1]), exp(walsh[m - k])) if k else None)


def rounds_of(turns: list[dict]) -> list[dict]:
    """Every timed round of `turns` (bench records with "timing"), in the order they ran."""
    return [r for t in turns for r in t.get("timing", [])]


def decode_seconds(timed: dict, name: str) -> float:
    """`name`'s seconds in a round after its prefill (the engine's "prefill_seconds", 0 where its timed span
    leaves the prefill out)."""
    return timed["seconds"][name] - timed.get("prefill_seconds", {}).get(name, 0.0)


def per_forward(timed: dict, name: str) -> float | None:
    """`name`'s decode seconds per counted forward in a round; None where it counted none."""
    forwards = timed.get("forwards", {}).get(name)
    return decode_seconds(timed, name) / forwards if forwards else None


def slowdowns(rounds: list[dict]) -> list[dict]:
    """Per round, per decoding that counted forwards, how many times its decode seconds per forward exceed that
    decoding's median over the run: a load slows forwards, while what a drafter drafts changes only how many
    tokens a forward makes, so a drafter whose acceptance varies from turn to turn is not mistaken for a busy
    machine."""
    times = {}
    for r in rounds:
        for name in r["seconds"]:
            t = per_forward(r, name)
            if t is not None:
                times.setdefault(name, []).append(t)
    typical = {name: median(ts) for name, ts in times.items()}
    return [
        {
            name: t / typical[name]
            for name in r["seconds"]
            if (t := per_forward(r, name)) is not None and typical[name] > 0
        }
        for r in rounds
    ]


def slowness(rounds: list[dict]) -> list[float]:
    """Per round, its slowest decoding's slowdown (`slowdowns`); 1.0 where none counted forwards."""
    return [max(s.values(), default=1.0) for s in slowdowns(rounds)]


def left_out(turns: list[dict]) -> list[dict]:
    """The rounds left out of every figure, each with where it ran ("turn": the run's turns in order) and why: a
    decoding in it took more than `BUSY` times its usual decode seconds per forward."""
    where = [(t, r) for t, turn in enumerate(turns) for r in range(len(turn.get("timing", [])))]
    out = []
    for (t, r), s in zip(where, slowdowns(rounds_of(turns))):
        slowest = max(s, key=s.get, default=None)
        if slowest is not None and s[slowest] > BUSY:
            why = f"{slowest} took {s[slowest]:.1f}x its usual decode seconds per forward (over {BUSY:g}x: a load)"
            out.append({"turn": t, "round": r, "decoding": slowest, "slowdown": s[slowest], "why": why})
    return out


def kept_rounds(turns: list[dict]) -> list[list[dict]]:
    """Per turn, its rounds that no load slowed (`left_out`)."""
    dropped = {(d["turn"], d["round"]) for d in left_out(turns)}
    return [[r for i, r in enumerate(turn.get("timing", [])) if (t, i) not in dropped] for t, turn in enumerate(turns)]


def ran(timed: dict, name: str) -> bool:
    return timed["seconds"].get(name, 0) > 0 and timed["tokens"].get(name, 0) > 0


def turn_log_ratios(kept: list[list[dict]], a: str, b: str) -> list[float]:
    """One paired figure per turn in which both ran in a kept round (`kept`: `kept_rounds`): the mean over those
    rounds of log(`a`'s tokens/s / `b`'s)."""
    figures = []
    for rounds in kept:
        logs = [
            log(r["tokens"][a] / r["seconds"][a]) - log(r["tokens"][b] / r["seconds"][b])
            for r in rounds
            if ran(r, a) and ran(r, b)
        ]
        if logs:
            figures.append(sum(logs) / len(logs))
    return figures


def paired(turns: list[dict], a: str, b: str) -> dict:
    """`a`'s speed over `b`'s from one paired figure per turn (`turn_log_ratios`, `centre_and_interval`): the
    ratio (None where no turn paired them), its interval, how many turns and how many rounds."""
    kept = kept_rounds(turns)
    figures = turn_log_ratios(kept, a, b)
    rounds = sum(ran(r, a) and ran(r, b) for rs in kept for r in rs)
    if not figures:
        return {"ratio": None, "interval": None, "pairs": 0, "rounds": 0}
    ratio, interval = centre_and_interval([exp(x) for x in figures])
    return {"ratio": ratio, "interval": list(interval) if interval else None, "pairs": len(figures), "rounds": rounds}


def tokens_per_s(turns: list[dict], name: str, beside: str = "plain") -> float | None:
    """`name`'s tokens/s pooled over the kept rounds in which it and `beside` both ran: the rounds its
    speedup reads (None where there are none)."""
    rounds = [r for rs in kept_rounds(turns) for r in rs if ran(r, name) and ran(r, beside)]
    seconds = sum(r["seconds"][name] for r in rounds)
    return sum(r["tokens"][name] for r in rounds) / seconds if seconds else None


def above_one(figure: dict) -> bool | None:
    """True or False where the interval lies wholly above or below 1.0; None where it cannot tell."""
    interval = figure["interval"]
    if interval is None or interval[0] <= 1.0 <= interval[1]:
        return None
    return interval[0] > 1.0


def load(turns: list[dict]) -> dict:
    """What the run says of the machine's load: the rounds a load slowed (left out of every figure, each named
    with why), the largest slowdown, and plain decoding's slowest and fastest tokens/s."""
    rounds = rounds_of(turns)
    plain = [r["tokens"]["plain"] / r["seconds"]["plain"] for r in rounds if ran(r, "plain")]
    dropped = left_out(turns)
    return {
        "rounds": len(rounds),
        "rounds_left_out": len(dropped),
        "left_out": dropped,
        "largest_slowdown": max(slowness(rounds), default=1.0),
        "plain_tokens_per_s_range": [min(plain), max(plain)] if plain else [0.0, 0.0],
    }


def span(interval) -> str:
    """'1.05-1.20x', or '-' where there is no interval."""
    return "-" if interval is None else "{:.2f}-{:.2f}x".format(*interval)


def interval_text(figure: dict) -> str:
    """'90% interval 1.05-1.20x, 10 turns', or why there is none."""
    if figure["ratio"] is None:
        return "no timed pair: every round was left out or made no token"
    if figure["interval"] is None:
        return f"{figure['pairs']} timed turns: too few to bound its noise (5 at least)"
    return f"{LEVEL:.0%} interval {span(figure['interval'])}, {figure['pairs']} turns"


def busy_note(machine: dict) -> str:
    """A line when a load slowed some rounds (`load`); '' otherwise."""
    if not machine["rounds_left_out"]:
        return ""
    return (
        f"the machine was busy: in {machine['rounds_left_out']} of {machine['rounds']} timed rounds a decoding took up "
        f"to {machine['largest_slowdown']:.1f}x its usual time per forward; they are left out of every figure "
        "(the JSON's summary.load.left_out names them)"
    )


CANNOT_TELL = "cannot tell at this noise: rerun with more prompts (--num-prompts), --repeats N, or on a quiet machine"
