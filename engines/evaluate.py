"""eagle-eval's run: the bench through one engine, or through every engine that decodes here on the same
prompts, one table and one JSON for them all.

    record = evaluate(EvalOptions("smollm2-135m", "runs/eagle3/final", chain=3), "builtin", "results.json")
"""

from dataclasses import replace
from pathlib import Path

from eagle_train.files import write_json
from engines import ENGINES
from inference.evaluate import EvalOptions, format_engines, format_table, plot_engines

LIVE_ENGINES = tuple(name for name, e in ENGINES.items() if e.decodes_live)


def run_engine(name: str, options: EvalOptions, answers=None) -> dict:
    """One engine's record: `answers` (per prompt, per turn) are what later turns follow, else its plain answers."""
    if name == "builtin":
        from inference.runtime_eval import evaluate as builtin

        return builtin(options)
    return ENGINES[name].evaluate(options, answers)


def evaluate(options: EvalOptions, engine: str, out) -> dict:
    """`engine`: "builtin", one of LIVE_ENGINES, or "all": the built-in runtime first, then every engine that
    runs here and takes the options (the others are named, with why), each following the built-in plain
    answers so all see the same prompts. Prints the table, writes the JSON (one engine's record, or
    {engine: record}) and the plot beside it; returns what it wrote."""
    if engine == "all":
        if options.draft == "ngram":
            raise ValueError("--engine all compares a head in every engine: give --draft HEAD")
        threadless = replace(options, threads=None)  # --threads is llama.cpp's alone
        records = {"builtin": run_engine("builtin", threadless)}
        answers = [[t["answer"] for t in p["turns"]] for p in records["builtin"]["prompts"]]
        for name in LIVE_ENGINES:
            try:
                reason = ENGINES[name].missing()
                if not reason:
                    records[name] = run_engine(name, options if name == "llamacpp" else threadless, answers)
            except ValueError as e:  # it cannot take these options (a target without a GGUF for llama.cpp, ...)
                reason = str(e)
            if reason:
                print(f"{ENGINES[name].title} skipped: {reason}")
    else:
        records = {engine: run_engine(engine, options)}
    summaries = {name: r["summary"] for name, r in records.items()}
    if len(records) > 1:
        depth = records["builtin"]["drafting"]["depth"]  # what the built-in runtime drafted (a block head: its block)
        title = f"{options.bench}: {len(records['builtin']['prompts'])} prompts, greedy, K={depth}"
        print(format_engines(summaries, title))
        written = records
    else:
        (written,) = records.values()
        title = written["title"]
        print(format_table(written["summary"], title))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, written, indent=1)
    plot_path = out.with_suffix(".png")
    drawn = plot_engines(summaries, plot_path, title)
    print(f"results: {out}" + (f"   plot: {plot_path}" if drawn else ""))
    return written
