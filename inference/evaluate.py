"""Evaluation on the bench prompt sets, for every engine: the one multi-turn loop (`run_bench`), its one
record per turn, its summary and its tables.

An engine supplies only "decode these prompts" (`TurnEngine.decode`, giving `TurnResult`s): plainly (the
speedup's reference) and with each of its drafters ("spec": the head; "ngram": prompt lookup, the free
baseline the head has to beat, same K). Multi-turn prompts (MT-Bench) ask turn 2 after plain decoding's
answer to turn 1, so every drafter decodes the same prompt tokens. Each turn is decoded by all of them in
a row, in an order that rotates from turn to turn, and the speedups are paired (`inference.timing`). AL
follows docs/design.md section 3:
tokens emitted by the counted forwards / those forwards, pooled over every turn of every prompt; the
built-in runtime and vLLM leave the prefill and its token out, so their AL can be recounted from the JSON
as sum(len(output_ids) - 1) / sum(forwards).
"""

import json
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field, fields
from importlib import resources
from pathlib import Path

from inference.divergence import TIE_STEPS, is_tie
from inference.timing import (
    CANNOT_TELL,
    above_one,
    busy_note,
    interval_text,
    load,
    paired,
    rotation,
    rounds_of,
    span,
)

BENCHES = ("mt_bench", "humaneval", "gsm8k")


def load_bench(name_or_file: str, num_prompts: int | None = None) -> list[dict]:
    """A packaged bench (mt_bench, humaneval, gsm8k) or a .jsonl file of {"turns": [...]} lines."""
    if name_or_file in BENCHES:
        text = resources.files("inference").joinpath(f"bench/{name_or_file}.jsonl").read_text()
        source = name_or_file
    else:
        path = Path(name_or_file)
        if not path.is_file():
            raise FileNotFoundError(
                f"bench {name_or_file!r} is neither one of {', '.join(BENCHES)} nor an existing .jsonl file"
            )
        text, source = path.read_text(), str(path)
    prompts = []
    for i, line in enumerate(text.splitlines()):
        if not line.strip():
            continue
        row = json.loads(line)
        turns = row.get("turns") or ([row["prompt"]] if "prompt" in row else None)
        if not turns or not all(isinstance(t, str) for t in turns):
            raise ValueError(f"{source} line {i + 1}: expected a 'turns' list of strings (or a 'prompt' string)")
        prompts.append({"question_id": row.get("question_id", i), "category": row.get("category", ""), "turns": turns})
    if num_prompts is not None:
        if num_prompts < 1:
            raise ValueError(f"--num-prompts must be >= 1, got {num_prompts}")
        prompts = prompts[:num_prompts]
    if not prompts:
        raise ValueError(f"{source} holds no prompts")
    return prompts


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The prompt tokens for `messages` through the target's own chat template."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        return list(ids)
    return tokenizer("\n\n".join(m["content"] for m in messages)).input_ids  # base models


def chat_text(tokenizer, messages: list[dict]) -> str:
    """The same prompt as text, byte for byte, for engines that tokenize it themselves (llama.cpp)."""
    return tokenizer.decode(chat_ids(tokenizer, messages), clean_up_tokenization_spaces=False)


@dataclass
class EvalOptions:
    """What eagle-eval asks of an engine (each engine refuses, in one line, what it cannot do)."""

    target: str
    draft: str  # a training checkpoint, head directory, export (llama.cpp: also a .gguf); "ngram": no head
    bench: str = "mt_bench"
    num_prompts: int | None = None
    max_new_tokens: int = 256
    chain: int | None = None  # K; the drafting when neither tree nor parallel is given (default 5)
    tree: str | None = None  # "depth,topk,total"
    parallel: int | None = None  # K drafts from one forward: a P-EAGLE or block (DFlash, DSpark) head's
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    ngram: bool = True  # also decode with prompt lookup at the head's K
    seed: int = 0
    device: str | None = None
    dtype: str | None = None
    cuda_graphs: bool = True
    threads: int | None = None  # llama.cpp's CPU threads
    repeats: int = 1  # timed rounds per turn (AL comes from the first; the speedups pool them all)

    def __post_init__(self):
        if self.repeats < 1:
            raise ValueError(f"--repeats must be >= 1 (timed rounds per turn), got {self.repeats}")

    @property
    def depth(self) -> int:
        """K of a chain or parallel drafting (5 unless given; the built-in runtime drafts a block head's whole
        block unless given)."""
        return next(k for k in (self.parallel, self.chain, 5) if k is not None)

    @property
    def greedy(self) -> bool:
        return (self.temperature, self.top_p, self.top_k) == (0.0, 1.0, 0)


@dataclass
class TurnResult:
    """One turn decoded by one drafter (or plainly), in the counts every engine gives. AL pools
    `emitted` over `forwards`; which forwards an engine counts its module says (the built-in runtime
    and vLLM leave the prefill out, llama.cpp counts the round that carries the prompt's last token)."""

    answer: str  # the new text, special tokens left out (a later turn may follow it)
    output_ids: list[int] | None  # the new token ids; None where the engine gives text only
    tokens: int  # new tokens
    forwards: int  # counted target forwards (plain decoding: its decode steps)
    emitted: int  # tokens those forwards emitted
    seconds: float  # the timed span ...
    timed_tokens: int  # ... and the tokens made inside it (tokens/s)
    accepted: list[int] | None = None  # drafts accepted per counted forward; None: only `accepted_total` is known
    accepted_total: int = 0
    per_forward: list[int] | None = None  # tokens each counted forward emitted, when known
    extra: dict = field(default_factory=dict)  # what else the engine measured (kept in the JSON)

    def record(self) -> dict:
        """What the JSON keeps: the fields that are known, the engine's extras beside them."""
        return {k: v for k, v in asdict(self).items() if v is not None and k != "extra"} | self.extra

    @classmethod
    def of_record(cls, record: dict) -> "TurnResult":
        names = {f.name for f in fields(cls)}
        given = {k: v for k, v in record.items() if k in names}
        return cls(**{"output_ids": None, **given}, extra={k: v for k, v in record.items() if k not in names})


class TurnEngine:
    """What an engine supplies to the bench loop: decode a list of prompts (token ids) plainly or with
    one of its `drafters`. `session` holds a decoder open for many calls (an engine that starts a process
    per drafter keeps it up); the defaults compare token ids and record no divergence."""

    drafters: tuple[str, ...] = ("spec",)
    finds_divergence = False  # `divergence` says where a greedy decode parts from plain decoding

    def decode(self, drafter: str, prompts: list[list[int]], max_new_tokens: int) -> list[TurnResult]:
        raise NotImplementedError

    @contextmanager
    def session(self, drafter: str):
        yield lambda prompts, max_new_tokens: self.decode(drafter, prompts, max_new_tokens)

    def same(self, plain: TurnResult, other: TurnResult) -> bool:
        """Whether `other` decoded plain decoding's text."""
        return other.output_ids == plain.output_ids

    def divergence(self, prompt_ids, plain: TurnResult, other: TurnResult, max_new_tokens: int) -> dict | None:
        """Where `other` parts from plain decoding and whether a near tie explains it (`inference.divergence`)."""
        raise NotImplementedError(f"{type(self).__name__} does not rerun the target")


def run_bench(
    engine: TurnEngine,
    tokenizer,
    prompts: list[dict],
    max_new_tokens: int,
    answers=None,
    progress: str = "",
    repeats: int = 1,
) -> list[dict]:
    """Every turn of every prompt, plainly and with each of the engine's drafters: one record per turn (its
    prompt ids, the answer a later turn follows, per decoding a `TurnResult.record`, and "timing", each round's
    order and seconds, tokens and counted forwards per decoding). Within a turn they decode one after another,
    `repeats` rounds, the order rotating from round to round (`inference.timing`), so a load that comes and goes
    hits all of them alike. A later turn follows plain decoding's answer (or `answers[p][t]`, another run's, so
    two engines see the same prompts), so every drafter decodes the same prompt tokens."""
    from tqdm import tqdm

    names = ("plain", *engine.drafters)
    results, rounds = [], 0
    with ExitStack() as stack:
        decoders = {name: stack.enter_context(engine.session(name)) for name in names}
        for p, prompt in enumerate(tqdm(prompts, desc=progress or "eval", unit="prompt", disable=not progress)):
            messages, turns = [], []
            for t, text in enumerate(prompt["turns"]):
                messages.append({"role": "user", "content": text})
                ids = chat_ids(tokenizer, messages)
                runs, timing = timed_rounds(decoders, names, ids, max_new_tokens, repeats, rounds)
                rounds += repeats
                plain = runs["plain"]
                answer = answers[p][t] if answers else plain.answer
                turn = {"prompt_tokens": len(ids), "prompt_ids": ids, "answer": answer, "plain": plain.record()}
                for name in engine.drafters:
                    turn[name] = compared(engine, turn, runs[name], max_new_tokens)
                turns.append({**turn, "timing": timing})
                messages.append({"role": "assistant", "content": answer})
            results.append({"question_id": prompt["question_id"], "category": prompt["category"], "turns": turns})
    return results


def timed_rounds(decoders: dict, names: tuple[str, ...], ids: list[int], max_new_tokens: int, repeats: int, first: int):
    """Each of `names` decodes `ids`, `repeats` rounds, round r in `rotation(names, first + r)`'s order: the first
    round's `TurnResult` per name, and every round's order, seconds and tokens (the pairs the speedups read)."""
    runs, timing = {}, []
    for r in range(repeats):
        order = rotation(names, first + r)
        timed = {"order": list(order), "seconds": {}, "tokens": {}, "forwards": {}}
        for name in order:
            (run,) = decoders[name]([ids], max_new_tokens)
            runs.setdefault(name, run)
            timed["seconds"][name], timed["tokens"][name] = run.seconds, run.timed_tokens
            timed["forwards"][name] = run.forwards
        timing.append(timed)
    return runs, timing


def compared(engine: TurnEngine, turn: dict, run: TurnResult, max_new_tokens: int) -> dict:
    """A drafter's record of `turn`: its run, whether it decoded plain decoding's text, and where not, why."""
    plain = TurnResult.of_record(turn["plain"])
    record = {**run.record(), "identical": engine.same(plain, run)}
    if engine.finds_divergence:
        record["divergence"] = engine.divergence(turn["prompt_ids"], plain, run, max_new_tokens)
    return record


def add_drafter(
    results: list[dict], engine: TurnEngine, drafter: str, max_new_tokens: int, progress: str = "", repeats: int = 1
) -> None:
    """`drafter`'s decodes of every turn of `results` (`run_bench`'s), beside plain decoding's in each record,
    each turn timed in pairs with plain decoding again (`timed_rounds`), so a drafter added later is not
    compared with a plain run timed at another time."""
    turns = [t for r in results for t in r["turns"]]
    if progress:
        print(f"{progress}: {drafter} on {len(turns)} turns ...", flush=True)
    names = ("plain", drafter)
    with ExitStack() as stack:
        decoders = {name: stack.enter_context(engine.session(name)) for name in names}
        for i, turn in enumerate(turns):
            runs, timing = timed_rounds(decoders, names, turn["prompt_ids"], max_new_tokens, repeats, i * repeats)
            turn[drafter] = compared(engine, turn, runs[drafter], max_new_tokens)
            turn["timing"] = turn.get("timing", []) + timing


def summarise(results: list[dict], depth: int, drafter: str = "spec") -> dict:
    """Pooled figures over every turn of every prompt, of one drafter ("spec": the head; "ngram":
    prompt lookup). The speedup is the paired one (`inference.timing`); tokens/s are pooled over the same
    rounds. Per-position acceptance and the histogram need the engine's per-forward counts."""
    turns = [t for r in results for t in r["turns"]]
    runs = [t[drafter] for t in turns]
    forwards = sum(r["forwards"] for r in runs)
    emitted = sum(r["emitted"] for r in runs)
    rounds = [r for r in rounds_of(turns) if drafter in r["seconds"] and "plain" in r["seconds"]]
    spec_s = sum(r["seconds"][drafter] for r in rounds)
    plain_s = sum(r["seconds"]["plain"] for r in rounds)
    speedup = paired(turns, drafter, "plain")
    summary = {
        "acceptance_length": emitted / forwards if forwards else 0.0,
        "verify_forwards": forwards,
        "tokens_from_verify_forwards": emitted,
        "accepted_drafts": sum(r["accepted_total"] for r in runs),
        "acceptance_per_position": None,
        "acceptance_per_position_conditional": None,
        "tokens_per_forward_histogram": None,
        "spec_tokens_per_s": sum(r["tokens"][drafter] for r in rounds) / spec_s if spec_s else 0.0,
        "plain_tokens_per_s": sum(r["tokens"]["plain"] for r in rounds) / plain_s if plain_s else 0.0,
        "speedup": speedup["ratio"],  # from the paired rounds' ratios (`inference.timing`) ...
        "speedup_interval": speedup["interval"],  # ... its interval (None: too few rounds to bound it)
        "timed_pairs": speedup["pairs"],
        "turns": len(turns),
        "turns_identical_to_plain": sum(r["identical"] for r in runs),
        **divergence_counts(runs),
        "new_tokens_spec": sum(r["tokens"] for r in runs),
        "new_tokens_plain": sum(t["plain"]["tokens"] for t in turns),
    }
    if all("accepted" in r for r in runs):
        accepted = [a for r in runs for a in r["accepted"]]
        reached = [sum(a >= i for a in accepted) for i in range(depth + 1)]  # reached[i]: rounds with >= i accepted
        # share of verification forwards whose draft position i (1-based) was accepted ...
        summary["acceptance_per_position"] = [
            reached[i] / len(accepted) if accepted else 0.0 for i in range(1, depth + 1)
        ]
        # ... and the same given that position i-1 was
        summary["acceptance_per_position_conditional"] = [
            reached[i] / reached[i - 1] if reached[i - 1] else 0.0 for i in range(1, depth + 1)
        ]
    if all("per_forward" in r for r in runs):
        per_forward = [e for r in runs for e in r["per_forward"]]
        summary["tokens_per_forward_histogram"] = {
            str(k): per_forward.count(k) for k in range(1, max(per_forward, default=0) + 1)
        }
    return summary


def divergence_counts(runs: list[dict]) -> dict:
    """Of the turns that part from plain decoding, how many at a near tie of the target's argmax and how
    many not (a decoding bug), with the largest gap; nothing when the engine records no divergence."""
    if not any("divergence" in r for r in runs):
        return {}
    parted = [r["divergence"] for r in runs if r.get("divergence")]
    return {
        "turns_parting_at_ties": sum(map(is_tie, parted)),
        "turns_parting_unexplained": sum(not is_tie(d) for d in parted),
        "largest_gap_rounding_steps": max((abs(d["rounding_steps"]) for d in parted), default=0.0),
    }


def identical_note(summary: dict) -> str:
    """What the turns that part from plain decoding are, for the tables: rounding ties or a bug."""
    if summary.get("turns_parting_unexplained"):
        return (
            f" ({summary['turns_parting_unexplained']} part where the target's choice was clear: "
            f"up to {summary['largest_gap_rounding_steps']:.0f} rounding steps; a decoding bug)"
        )
    if summary.get("turns_parting_at_ties"):
        return f" (the rest part at near ties of the target's argmax, <= {TIE_STEPS} rounding steps)"
    return ""


def shares(values: list[float] | None) -> str:
    """Per-position shares for the tables; "-" where the engine counts only totals."""
    return "-" if values is None else " ".join(f"{a:.2f}" for a in values)


def format_table(summary: dict, title: str) -> str:
    s = summary
    lines = [
        title,
        f"  acceptance length (AL)      {s['acceptance_length']:.3f}   "
        f"({s['tokens_from_verify_forwards']} tokens / {s['verify_forwards']} verification forwards)",
        "  acceptance per position     " + shares(s["acceptance_per_position"]),
        "  ... conditional             " + shares(s["acceptance_per_position_conditional"]),
        f"  tokens/s speculative        {s['spec_tokens_per_s']:.1f}",
        f"  tokens/s plain              {s['plain_tokens_per_s']:.1f}",
        f"  speedup                     {s['speedup']:.2f}x ({speed_text(s)})",
        f"  turns identical to plain    {s['turns_identical_to_plain']}/{s['turns']}" + identical_note(s),
    ]
    if "ngram" in s:
        rows = (("head", s), (f"n-gram (free, {s['ngram']['setting']})", s["ngram"]))
        width = max(len(label) for label, _ in rows) + 2
        lines.append(f"  {'drafter':<{width}}{'AL':>7}{'tokens/s':>10}{'speedup':>9}   identical to plain")
        for label, row in rows:
            lines.append(
                f"  {label:<{width}}{row['acceptance_length']:>7.3f}{row['spec_tokens_per_s']:>10.1f}"
                f"{row['speedup']:>8.2f}x   {row['turns_identical_to_plain']}/{row['turns']}" + identical_note(row)
            )
        lines.append("  " + head_vs_ngram(s))
    if s.get("busy"):
        lines.append("  " + s["busy"])
    return "\n".join(lines)


def speedup_figure(summary: dict) -> dict:
    """A summary's paired speedup over plain decoding, as `inference.timing.paired` gives it."""
    return {"ratio": summary["speedup"], "interval": summary["speedup_interval"], "pairs": summary["timed_pairs"]}


def speed_text(summary: dict) -> str:
    """The speedup's interval, and whether it settles faster or slower than plain decoding."""
    figure = speedup_figure(summary)
    text = interval_text(figure)
    faster = above_one(figure)
    if faster is None and figure["interval"] is not None:
        return text + ": cannot tell faster from slower than plain at this noise"
    return text


def summarise_drafters(results: list[dict], depth: int, ngram: int | None, ngram_setting: str = "") -> dict:
    """`summarise` of the head, with prompt lookup's beside it (`ngram_setting`: its engine's lookup, named in the
    table), the two timed against each other in pairs and the verdict, when it was run; and the busy-machine
    line when plain decoding's speed moved within the run."""
    summary = summarise(results, depth)
    turns = [t for r in results for t in r["turns"]]
    if ngram:
        summary["ngram"] = {**summarise(results, ngram, "ngram"), "setting": ngram_setting}
        summary["head_vs_ngram"] = paired(turns, "spec", "ngram")
        summary["head_beats_ngram"] = head_beats_ngram(summary)
    summary["load"] = load(turns)
    summary["busy"] = busy_note(summary["load"])
    return summary


def head_beats_ngram(summary: dict) -> bool | None:
    """Speed decides, not AL (a head's draft steps cost forwards that prompt lookup does not pay), measured in
    pairs: True or False where the head's speed over prompt lookup's is above or below 1.0 with its whole
    interval, None where the noise cannot tell."""
    return above_one(summary["head_vs_ngram"])


def head_vs_ngram(summary: dict) -> str:
    """The one line that says whether training paid: the head against plain decoding and against free drafting
    on the same prompts, or that this run cannot tell."""
    head, ngram, versus = summary, summary["ngram"], summary["head_vs_ngram"]
    line = (
        f"head vs n-gram (free): head AL {head['acceptance_length']:.2f} vs {ngram['acceptance_length']:.2f}, "
        f"speed {head['speedup']:.2f}x vs {ngram['speedup']:.2f}x, head / n-gram {versus['ratio']:.2f}x "
        f"({interval_text(versus)}): "
    )
    beats = summary["head_beats_ngram"]
    faster = above_one(speedup_figure(head))
    if beats is False:
        more = head["acceptance_length"] > ngram["acceptance_length"]
        return (
            line
            + "the head does not beat free drafting"
            + (" (more tokens per forward, but drafting costs more)" if more else "")
        )
    if faster is False:
        return line + "the head does not pay (slower than plain decoding)"
    if beats and faster:
        return line + "the head pays"
    return line + CANNOT_TELL


def format_engines(summaries: dict[str, dict], title: str) -> str:
    """One row per engine and drafter: the same prompts, each engine against its own plain decoding (the
    speedup's interval beside it), then each engine's verdict."""
    lines = [
        title,
        f"  {'engine':<9}{'drafter':<15}{'AL':>7}  {'acceptance per position':<25}{'tok/s plain':>12}"
        f"{'tok/s spec':>11}{'speedup':>9}{'90% interval':>14}   identical",
    ]
    for engine, s in summaries.items():
        for label, row in (("head", s), ("n-gram (free)", s.get("ngram"))):
            if row is None:
                continue
            positions = shares(row["acceptance_per_position"])
            interval = span(row["speedup_interval"])
            lines.append(
                f"  {engine:<9}{label:<15}{row['acceptance_length']:>7.3f}  {positions:<25}"
                f"{row['plain_tokens_per_s']:>12.1f}{row['spec_tokens_per_s']:>11.1f}{row['speedup']:>8.2f}x"
                f"{interval:>14}   {row['turns_identical_to_plain']}/{row['turns']}"
            )
    for engine, s in summaries.items():
        if "ngram" in s:
            lines.append(f"  [{engine}, n-gram: {s['ngram']['setting']}] " + head_vs_ngram(s))
        if s.get("busy"):
            lines.append(f"  [{engine}] " + s["busy"])
    return "\n".join(lines)


def plot_engines(summaries: dict[str, dict], path, title: str) -> bool:
    """Acceptance per draft position of the head in each engine that counts it, side by side (one: `plot`)."""
    summaries = {engine: s for engine, s in summaries.items() if s["tokens_per_forward_histogram"] is not None}
    if not summaries:
        return False  # the engines count totals only: the table has it all
    if len(summaries) == 1:
        return plot(next(iter(summaries.values())), path, title)
    try:
        import matplotlib
    except ImportError:
        print(f"plot skipped: matplotlib is not installed (pip install 'eagle-train[plot]' to get {path})")
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(summaries)
    for i, (engine, s) in enumerate(summaries.items()):
        acc = s["acceptance_per_position"]
        xs = [p + 1 + (i - (len(summaries) - 1) / 2) * width for p in range(len(acc))]
        ax.bar(xs, acc, width, label=f"{engine}: AL {s['acceptance_length']:.2f}, {s['speedup']:.2f}x")
    ax.set(xlabel="draft position", ylabel="accepted (share of forwards)", ylim=(0, 1.05), title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def plot(summary: dict, path, title: str) -> bool:
    """Acceptance per draft position and the distribution of tokens per verification forward.
    matplotlib is optional: without it the finished evaluation says how to get the plot and goes on."""
    try:
        import matplotlib
    except ImportError:
        print(f"plot skipped: matplotlib is not installed (pip install 'eagle-train[plot]' to get {path})")
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    acc = summary["acceptance_per_position"]
    positions = list(range(1, len(acc) + 1))
    left.bar(positions, acc, label="accepted (share of forwards)")
    left.plot(
        positions, summary["acceptance_per_position_conditional"], "o-", color="C1", label="given previous accepted"
    )
    left.set(
        xlabel="draft position", ylabel="acceptance", ylim=(0, 1.05), xticks=positions, title="acceptance per position"
    )
    left.legend()
    hist = summary["tokens_per_forward_histogram"]
    right.bar([int(k) for k in hist], list(hist.values()))
    right.set(
        xlabel="tokens per verification forward",
        ylabel="forwards",
        xticks=[int(k) for k in hist],
        title=f"AL = {summary['acceptance_length']:.2f}",
    )
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
