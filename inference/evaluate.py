"""Evaluation on the bench prompt sets, for every engine: the one multi-turn loop (`run_bench`), its one
record per turn, its summary and its tables.

An engine supplies only "decode these prompts" (`TurnEngine.decode`, giving `TurnResult`s): plainly (the
speedup's reference) and with each of its drafters, each a `Configuration` it could serve ("spec": the head;
"ngram" and the engine's other free types: n-gram lookup, the free drafting the head has to beat, same K;
"hybrid": n-gram lookup where it finds a draft, else the head, as llama.cpp combines them). Multi-turn
prompts (MT-Bench) ask turn 2 after plain decoding's answer to turn 1, so every drafter decodes the same
prompt tokens. Each turn is decoded by all of them in a row, in an order that rotates from turn to turn, and
the speedups are paired (`inference.timing`); the verdict (`verdict`) names the fastest configuration, or
says it cannot tell. AL follows docs/design.md section 3: tokens emitted by the counted forwards / those
forwards, pooled over every turn of every prompt; the built-in runtime and vLLM leave the prefill and its
token out, so their AL can be recounted from the JSON as sum(len(output_ids) - 1) / sum(forwards).
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
    span,
    tokens_per_s,
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
    ngram: bool = True  # also decode with n-gram lookup at the head's K, alone and before the head (hybrid)
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
    prefill_seconds: float = 0.0  # the part of `seconds` before the first token (0: the span leaves it out)
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


@dataclass(frozen=True)
class Configuration:
    """A drafter as the verdict can name it: its row in the tables, what it is ("head", "free": n-gram lookup
    without a head, "hybrid": the lookup where it finds a draft, else the head) and how an engine serves it."""

    label: str
    kind: str
    serve: str = ""


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
        timed = {"order": list(order), "seconds": {}, "prefill_seconds": {}, "tokens": {}, "forwards": {}}
        for name in order:
            (run,) = decoders[name]([ids], max_new_tokens)
            runs.setdefault(name, run)
            timed["seconds"][name], timed["tokens"][name] = run.seconds, run.timed_tokens
            timed["prefill_seconds"][name], timed["forwards"][name] = run.prefill_seconds, run.forwards
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
    """Pooled figures over every turn of every prompt, of one drafter. The speedup is the paired one
    (`inference.timing`), tokens/s are pooled over the same rounds (those no load slowed). AL is None where no
    forward was counted (every turn ended at its first token). Per-position acceptance and the histogram need
    the engine's per-forward counts."""
    turns = [t for r in results for t in r["turns"]]
    runs = [t[drafter] for t in turns]
    forwards = sum(r["forwards"] for r in runs)
    emitted = sum(r["emitted"] for r in runs)
    speedup = paired(turns, drafter, "plain")
    summary = {
        "acceptance_length": emitted / forwards if forwards else None,
        "verify_forwards": forwards,
        "tokens_from_verify_forwards": emitted,
        "accepted_drafts": sum(r["accepted_total"] for r in runs),
        "acceptance_per_position": None,
        "acceptance_per_position_conditional": None,
        "tokens_per_forward_histogram": None,
        "spec_tokens_per_s": tokens_per_s(turns, drafter),
        "plain_tokens_per_s": tokens_per_s(turns, "plain", drafter),
        "speedup": speedup["ratio"],  # from one paired figure per turn (`inference.timing`); None: no pair ...
        "speedup_interval": speedup["interval"],  # ... its interval (None: too few turns to bound it)
        "timed_pairs": speedup["pairs"],  # turns
        "timed_rounds": speedup["rounds"],
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


def figure(value, spec: str, none: str = "-") -> str:
    """`value` formatted, or `none` where the run measured no such figure."""
    return none if value is None else format(value, spec)


def drafter_rows(summary: dict) -> list[tuple[str, dict]]:
    """(label, summary) of the head (or the one drafter of a head-less run) and every other drafter."""
    return [(summary["label"], summary)] + [(row["label"], row) for row in summary.get("drafters", {}).values()]


def format_table(summary: dict, title: str) -> str:
    s = summary
    lines = [
        title,
        f"  acceptance length (AL)      {figure(s['acceptance_length'], '.3f')}   "
        f"({s['tokens_from_verify_forwards']} tokens / {s['verify_forwards']} verification forwards)"
        + ("" if s["verify_forwards"] else ": every turn ended at its first token, so no AL"),
        "  acceptance per position     " + shares(s["acceptance_per_position"]),
        "  ... conditional             " + shares(s["acceptance_per_position_conditional"]),
        f"  tokens/s speculative        {figure(s['spec_tokens_per_s'], '.1f')}",
        f"  tokens/s plain              {figure(s['plain_tokens_per_s'], '.1f')}",
        "  speedup                     "
        + (speed_text(s) if s["speedup"] is None else f"{s['speedup']:.2f}x ({speed_text(s)})"),
        f"  turns identical to plain    {s['turns_identical_to_plain']}/{s['turns']}" + identical_note(s),
    ]
    rows = drafter_rows(s)
    if len(rows) > 1:
        width = max(len(label) for label, _ in rows) + 2
        lines.append(f"  {'drafter':<{width}}{'AL':>7}{'tokens/s':>10}{'speedup':>9}{'90% interval':>14}   identical")
        for label, row in rows:
            lines.append(
                f"  {label:<{width}}{figure(row['acceptance_length'], '.3f'):>7}"
                f"{figure(row['spec_tokens_per_s'], '.1f'):>10}{figure(row['speedup'], '.2f'):>8}x"
                f"{span(row['speedup_interval']):>14}   {row['turns_identical_to_plain']}/{row['turns']}"
                + identical_note(row)
            )
    if "ngram" in s:
        lines.append("  " + head_vs_ngram(s))
    if "verdict" in s:
        lines.append("  verdict: " + s["verdict"]["text"])
    lines += ["  " + note for note in s.get("notes", [])]
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


def summarise_drafters(results: list[dict], depth: int, configurations: dict[str, Configuration]) -> dict:
    """`summarise` of "spec" (the head, or the one drafter of a head-less run) with every other drafter's beside
    it ("drafters"); "ngram", the fastest of the free rows in pairs, named, and the head against it in pairs
    (`head_vs_ngram`); the verdict (`verdict`) over every row; and the busy-machine line when a load slowed
    some rounds."""
    summary = {**summarise(results, depth), **asdict(configurations["spec"])}
    turns = [t for r in results for t in r["turns"]]
    others = {
        name: {**summarise(results, depth, name), **asdict(c)} for name, c in configurations.items() if name != "spec"
    }
    if others:
        summary["drafters"] = others
    free = [name for name, row in others.items() if row["kind"] == "free"]
    if free and summary["kind"] != "free":
        best = fastest(free, others)
        summary["ngram"] = {**others[best], "setting": others[best]["label"]}
        summary["head_vs_ngram"] = paired(turns, "spec", best)
        summary["head_beats_ngram"] = above_one(summary["head_vs_ngram"])
    summary["verdict"] = verdict(turns, {"spec": summary, **others})
    summary["load"] = load(turns)
    summary["busy"] = busy_note(summary["load"])
    return summary


def fastest(names: list[str], rows: dict) -> str:
    """Of `names`, the one with the highest paired speedup (AL breaks ties and stands in where none was timed)."""
    return max(names, key=lambda n: (rows[n]["speedup"] or 0.0, rows[n]["acceptance_length"] or 0.0))


def verdict(turns: list[dict], rows: dict[str, dict]) -> dict:
    """What to deploy: the drafter with the highest paired speedup where its interval lies above 1.0 (faster than
    plain decoding) and, against every drafter of another kind (head, free, hybrid) in pairs, above 1.0 too (or
    that drafter is slower than plain); drafters of its own kind it cannot tell from it (two free types) are
    named beside it. Plain decoding where every drafter is slower than plain; else that this run cannot tell,
    naming between which. {"deploy": a drafter, "plain" or None, "text": the line the tables print}."""
    timed = {n: row for n, row in rows.items() if row["speedup"] is not None}
    if not timed:
        return {"deploy": None, "text": "no verdict: no timed pair (every round was left out or made no token)"}
    best = fastest(list(timed), timed)
    top = timed[best]
    said = f"{top['label']} ({top['speedup']:.2f}x plain, {interval_text(speedup_figure(top))})"
    if all(above_one(speedup_figure(row)) is False for row in timed.values()):
        return {"deploy": "plain", "text": f"deploy plain decoding: every drafter is slower here, the fastest {said}"}
    if above_one(speedup_figure(top)) is not True:
        return {"deploy": None, "text": f"cannot tell whether {said} beats plain decoding; {CANNOT_TELL}"}
    unsettled = []
    for name, row in timed.items():
        versus = paired(turns, best, name)
        if name != best and above_one(versus) is not True and above_one(speedup_figure(row)) is not False:
            unsettled.append((name, versus))
    other_kinds = [(n, versus) for n, versus in unsettled if timed[n]["kind"] != top["kind"]]
    if other_kinds:
        name, versus = other_kinds[0]
        row = timed[name]
        return {
            "deploy": None,
            "text": f"cannot tell {top['label']} from {row['label']} ({top['label']} / {row['label']} "
            f"{figure(versus['ratio'], '.2f')}x, {interval_text(versus)}); {CANNOT_TELL}",
        }
    al = figure(top["acceptance_length"], ".2f")
    serve = f" ({top['serve']})" if top["serve"] else ""
    speed = f"{top['speedup']:.2f}x plain ({interval_text(speedup_figure(top))})"
    alike = f"; as fast within noise: {', '.join(timed[n]['label'] for n, _ in unsettled)}" if unsettled else ""
    return {
        "deploy": best,
        "serve": top["serve"],
        "text": f"deploy {top['label']}{serve}: {al} tokens/forward, {speed}, faster in pairs than every other "
        f"kind of drafter{alike}",
    }


def head_vs_ngram(summary: dict) -> str:
    """The one line that says whether training paid: the head against plain decoding and against the fastest free
    drafting on the same prompts, or that this run cannot tell."""
    head, ngram, versus = summary, summary["ngram"], summary["head_vs_ngram"]
    name = head["label"]  # "head", or "draft model"
    line = (
        f"{name} vs n-gram (free): {name} AL {figure(head['acceptance_length'], '.2f')} vs "
        f"{figure(ngram['acceptance_length'], '.2f')}, speed {figure(head['speedup'], '.2f')}x vs "
        f"{figure(ngram['speedup'], '.2f')}x, {name} / n-gram {figure(versus['ratio'], '.2f')}x "
        f"({interval_text(versus)}): "
    )
    beats = summary["head_beats_ngram"]
    faster = above_one(speedup_figure(head))
    if beats is False:
        more = (head["acceptance_length"] or 0) > (ngram["acceptance_length"] or 0)
        return (
            line
            + f"the {name} does not beat free drafting"
            + (" (more tokens per forward, but drafting costs more)" if more else "")
        )
    if faster is False:
        return line + f"the {name} does not pay (slower than plain decoding)"
    if beats and faster:
        return line + f"the {name} pays"
    return line + CANNOT_TELL


def format_engines(summaries: dict[str, dict], title: str) -> str:
    """One row per engine and drafter: the same prompts, each engine against its own plain decoding (the
    speedup's interval beside it), then each engine's verdicts."""
    lines = [
        title,
        f"  {'engine':<9}{'drafter':<34}{'AL':>7}  {'acceptance per position':<25}{'tok/s plain':>12}"
        f"{'tok/s spec':>11}{'speedup':>9}{'90% interval':>14}   identical",
    ]
    for engine, s in summaries.items():
        for label, row in drafter_rows(s):
            lines.append(
                f"  {engine:<9}{label:<34}{figure(row['acceptance_length'], '.3f'):>7}  "
                f"{shares(row['acceptance_per_position']):<25}{figure(row['plain_tokens_per_s'], '.1f'):>12}"
                f"{figure(row['spec_tokens_per_s'], '.1f'):>11}{figure(row['speedup'], '.2f'):>8}x"
                f"{span(row['speedup_interval']):>14}   {row['turns_identical_to_plain']}/{row['turns']}"
            )
    for engine, s in summaries.items():
        if "ngram" in s:
            lines.append(f"  [{engine}] " + head_vs_ngram(s))
        if "verdict" in s:
            lines.append(f"  [{engine}] verdict: " + s["verdict"]["text"])
        for note in s.get("notes", []):
            lines.append(f"  [{engine}] {note}")
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
        label = f"{engine}: AL {figure(s['acceptance_length'], '.2f')}, {figure(s['speedup'], '.2f')}x"
        ax.bar(xs, acc, width, label=label)
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
        title=f"AL = {figure(summary['acceptance_length'], '.2f')}",
    )
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
