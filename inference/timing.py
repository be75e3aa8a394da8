"""Speed measured in pairs, so a verdict holds on a busy machine.

Every turn is decoded plainly and by each drafter one right after another, in an order that rotates from
round to round (`rotation`), so a load that comes and goes during a run hits all of them alike instead of
whichever drafter happened to be running. Each round gives a paired ratio (a drafter's tokens/s over plain
decoding's, or over another drafter's). A speedup is the Hodges-Lehmann estimate of those ratios (the
median of the pairwise means of their logs: robust to a round a load hit on one side, nearly as tight as a
mean) with its Wilcoxon signed-rank interval, which assumes only that the rounds' log ratios are
independent and spread symmetrically about their centre. Where that interval does not settle a question
(it holds 1.0, or there are too few rounds to bound it) the verdict says it cannot tell rather than guess.
A round in which a load slowed one of the decodings (`slowness`) is left out, and the table says so.
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


def slowness(rounds: list[dict]) -> list[float]:
    """Per round, how many times its slowest decoding's seconds per counted forward exceed that decoding's
    median over the run: a load slows forwards, while what a drafter drafts changes only how many tokens a
    forward makes, so a drafter whose acceptance varies from turn to turn is not mistaken for a busy machine.
    1.0 where a round does not count its forwards."""
    typical = {}
    for name in {n for r in rounds for n in r.get("forwards", {})}:
        times = [r["seconds"][name] / r["forwards"][name] for r in rounds if r.get("forwards", {}).get(name)]
        typical[name] = median(times)
    return [
        max(
            [r["seconds"][n] / f / typical[n] for n, f in r.get("forwards", {}).items() if f and typical[n] > 0],
            default=1.0,
        )
        for r in rounds
    ]


def paired_ratios(turns: list[dict], a: str, b: str) -> list[float]:
    """Per timed round in which both ran, `a`'s tokens/s over `b`'s, leaving out the rounds a load slowed
    (`slowness` above `BUSY`)."""
    rounds = rounds_of(turns)
    ratios = []
    for r, slow in zip(rounds, slowness(rounds)):
        seconds, tokens = r["seconds"], r["tokens"]
        if slow <= BUSY and seconds.get(a, 0) > 0 and seconds.get(b, 0) > 0 and tokens[b] > 0:
            ratios.append((tokens[a] / seconds[a]) / (tokens[b] / seconds[b]))
    return ratios


def paired(turns: list[dict], a: str, b: str) -> dict:
    """`a`'s speed over `b`'s from their paired rounds (`centre_and_interval`), and how many pairs."""
    ratios = paired_ratios(turns, a, b)
    if not ratios:
        return {"ratio": 0.0, "interval": None, "pairs": 0}
    ratio, interval = centre_and_interval(ratios)
    return {"ratio": ratio, "interval": list(interval) if interval else None, "pairs": len(ratios)}


def above_one(figure: dict) -> bool | None:
    """True or False where the interval lies wholly above or below 1.0; None where it cannot tell."""
    interval = figure["interval"]
    if interval is None or interval[0] <= 1.0 <= interval[1]:
        return None
    return interval[0] > 1.0


def load(turns: list[dict]) -> dict:
    """What the run says of the machine's load: the rounds a load slowed (left out of every speedup), the
    largest slowdown, and plain decoding's slowest and fastest tokens/s."""
    rounds = rounds_of(turns)
    slow = slowness(rounds)
    plain = [r["tokens"]["plain"] / r["seconds"]["plain"] for r in rounds if r["seconds"].get("plain", 0) > 0]
    return {
        "rounds": len(rounds),
        "rounds_left_out": sum(s > BUSY for s in slow),
        "largest_slowdown": max(slow, default=1.0),
        "plain_tokens_per_s_range": [min(plain), max(plain)] if plain else [0.0, 0.0],
    }


def span(interval) -> str:
    """'1.05-1.20x', or '-' where there is no interval."""
    return "-" if interval is None else "{:.2f}-{:.2f}x".format(*interval)


def interval_text(figure: dict) -> str:
    """'90% interval 1.05-1.20x, 10 pairs', or why there is none."""
    if figure["interval"] is None:
        return f"{figure['pairs']} timed pairs: too few to bound its noise (5 at least)"
    return f"{LEVEL:.0%} interval {span(figure['interval'])}, {figure['pairs']} pairs"


def busy_note(machine: dict) -> str:
    """A line when a load slowed some rounds (`load`); '' otherwise."""
    if not machine["rounds_left_out"]:
        return ""
    return (
        f"the machine was busy: in {machine['rounds_left_out']} of {machine['rounds']} timed rounds a decoding took up "
        f"to {machine['largest_slowdown']:.1f}x its usual time per forward; they are left out of the speedups"
    )


CANNOT_TELL = "cannot tell at this noise: rerun with more prompts (--num-prompts), --repeats N, or on a quiet machine"
