"""What a head costs and earns in llama.cpp on this machine: one table of plain decoding, n-gram
drafting and heads at K=1..4, per target GGUF and head type.

    python scripts/bench/llamacpp.py --head main_job=runs/eagle3_smollm2/final \
        --targets f32 q4_1 --outtypes f32 q8_0 --ks 1 2 3 4 --num-prompts 2 --max-new-tokens 64

Targets: `f32` is the embedded SmolLM2 written by llama.cpp's own converter (once, into the cache),
`q4_1` the GGUF the package ships; any other value is a .gguf path. Every run decodes the first turn
of the first --num-prompts prompts of each bench greedily. Per row it prints tokens per target forward
and speedup over plain decoding per bench, decode tok/s pooled over the benches, and where a round's
time goes, from llama.cpp's own counters: a round is K draft steps plus one verification of K+1
tokens, `verify` is the target's time in it (its perf counters less the prompt's forward, timed by plain
decoding of the same prompt) and
`draft` the rest of the round per drafted token (the head's forward, sampling and llama.cpp's
bookkeeping). A round pays off when it yields more tokens than plain decoding makes in the same
time: `break-even` = round ms / plain ms per token, the tokens per forward the row needs to beat plain.
Each row's prompts are decoded plainly again beside it, one right after the other (`paired_runs`), and its
speedups and break-even are against those plain runs.
The JSON (--out) keeps every run.
"""

import argparse
import json
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from eagle_train.checkpoint import load_draft_head
from eagle_train.export.gguf import export_gguf
from eagle_train.target import SMOLLM2, cache_dir, load_tokenizer, resolve_target, target_gguf
from engines import llamacpp_build, llamacpp_run
from inference.evaluate import BENCHES, chat_text, load_bench
from inference.timing import rotation


def target_file(name: str) -> Path:
    if name == "f32":
        return llamacpp_build.convert_target(
            resolve_target(SMOLLM2), cache_dir() / "llamacpp" / "smollm2-135m-f32.gguf"
        )
    if name == "q4_1":
        return target_gguf(SMOLLM2)
    return Path(name)


def first_turns(tokenizer, num_prompts: int) -> dict[str, list[str]]:
    return {
        bench: [
            chat_text(tokenizer, [{"role": "user", "content": p["turns"][0]}]) for p in load_bench(bench, num_prompts)
        ]
        for bench in BENCHES
    }


def paired_runs(decode, target, prompts: dict[str, list[str]], n: int, threads) -> tuple[dict, dict]:
    """Per bench, each prompt decoded by `decode` and plainly, one right after the other in an order that
    alternates prompt by prompt (eagle-eval's loop, `inference.timing`): the runs, and the plain runs timed
    beside them, so a load that comes and goes lands on both."""
    runs, plain, i = {b: [] for b in prompts}, {b: [] for b in prompts}, 0
    for bench, texts in prompts.items():
        for text in texts:
            for which in rotation(("plain", "run"), i):
                if which == "plain":
                    plain[bench].append(llamacpp_run.run_plain(target, text, n, threads))
                else:
                    runs[bench].append(decode(text))
            i += 1
    return runs, plain


def pooled(runs: list, plain: list) -> dict:
    """Figures over `runs`; `plain` (the same prompts decoded plainly) gives each prompt's own forward time,
    which llama.cpp's perf counters lump with the verifications."""
    tokens, forwards = sum(r.tokens for r in runs), sum(r.forwards for r in runs)
    decoded, seconds = sum(r.decoded for r in runs), sum(r.seconds for r in runs)
    prompt = sum(p.target_seconds - p.seconds for p in plain)
    target, drafted = sum(r.target_seconds for r in runs) - prompt, sum(r.drafted for r in runs)
    return {
        "tokens_per_forward": tokens / forwards,
        "tokens_per_s": decoded / seconds,
        "round_ms": 1000 * seconds / forwards,  # plain: one forward per token
        "verify_ms": 1000 * target / forwards,
        "draft_ms": 1000 * (seconds - target) / drafted if drafted else 0.0,
    }


def row(label: str, k, runs: dict[str, list], plain: dict[str, list]) -> dict:
    every, plain_every = ([r for bench in BENCHES for r in x[bench]] for x in (runs, plain))
    plain_all = pooled(plain_every, plain_every)
    out = {"drafter": label, "k": k, **pooled(every, plain_every), "per_bench": {}}
    for bench in BENCHES:
        p, base = pooled(runs[bench], plain[bench]), pooled(plain[bench], plain[bench])
        out["per_bench"][bench] = {
            "tokens_per_forward": p["tokens_per_forward"],
            "speedup": p["tokens_per_s"] / base["tokens_per_s"],
        }
    out["speedup"] = out["tokens_per_s"] / plain_all["tokens_per_s"]
    out["break_even"] = out["round_ms"] / plain_all["round_ms"]
    return out


def format_table(target: str, rows: list[dict]) -> str:
    head = (
        f"{'drafter':<16}{'K':>3}  {'tokens/forward mt/he/gs':>24}  {'speedup mt/he/gs':>18}  {'tok/s':>6}"
        f"  {'round ms':>8}  {'verify ms':>9}  {'draft ms':>8}  {'break-even':>10}  same"
    )
    lines = [f"== target {target}", head]
    for r in rows:
        tpf = "/".join(f"{r['per_bench'][b]['tokens_per_forward']:.2f}" for b in BENCHES)
        speed = "/".join(f"{r['per_bench'][b]['speedup']:.2f}" for b in BENCHES)
        k = "-" if r["k"] is None else str(r["k"])
        draft = f"{r['draft_ms']:.2f}" if r["k"] else "-"
        even = f"{r['break_even']:.2f}" if r["k"] else "-"
        lines.append(
            f"{r['drafter']:<16}{k:>3}  {tpf:>24}  {speed:>18}  {r['tokens_per_s']:>6.1f}  {r['round_ms']:>8.2f}"
            f"  {r['verify_ms']:>9.2f}  {draft:>8}  {even:>10}  {r['same']}"
        )
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head", action="append", default=[], metavar="NAME=PATH", help="a checkpoint or export dir")
    p.add_argument("--targets", nargs="+", default=["f32", "q4_1"], help="f32 | q4_1 | TARGET.gguf")
    p.add_argument("--outtypes", nargs="+", default=["f32", "q8_0"], help="head GGUF types")
    p.add_argument("--ks", nargs="+", type=int, default=[1, 2, 3, 4])
    p.add_argument("--num-prompts", type=int, default=2, help="first turns per bench")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=None, help="llama.cpp threads (default: its choice)")
    p.add_argument("--out", default="runs/bench/llamacpp.json")
    args = p.parse_args(argv)
    heads = dict(h.split("=", 1) for h in args.head)
    prompts = first_turns(load_tokenizer(SMOLLM2), args.num_prompts)
    n, t = args.max_new_tokens, args.threads
    record = {"settings": vars(args), "bin": str(llamacpp_build.require_tools()), "targets": {}}
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for target_name in args.targets:
            target = target_file(target_name)
            files = {
                f"{name} {outtype}": export_gguf(
                    load_draft_head(path), Path(tmp) / f"{name}-{outtype}.gguf", target, outtype=outtype
                )
                for name, path in heads.items()
                for outtype in args.outtypes
            }
            plain = {b: [llamacpp_run.run_plain(target, text, n, t) for text in prompts[b]] for b in BENCHES}
            rows, runs_json = [{**row("plain", None, plain, plain), "same": "-"}], {"plain": plain}
            for k in args.ks:
                for label, file in {"n-gram": None, **files}.items():

                    def decode(text, file=file, k=k, target=target):
                        if file is None:
                            return llamacpp_run.run_ngram(target, text, n, k, t)
                        return llamacpp_run.run_head(target, file, text, n, k, t)

                    runs, beside = paired_runs(decode, target, prompts, n, t)
                    same = sum(
                        llamacpp_run.same_text(base, run) for b in BENCHES for base, run in zip(plain[b], runs[b])
                    )
                    rows.append({**row(label, k, runs, beside), "same": f"{same}/{len(BENCHES) * args.num_prompts}"})
                    runs_json[f"{label} K={k}"] = runs
            print(format_table(f"{target_name} ({target})", rows), flush=True)
            record["targets"][target_name] = {
                "gguf": str(target),
                "rows": rows,
                "runs": {key: {b: [asdict(r) for r in v[b]] for b in BENCHES} for key, v in runs_json.items()},
            }
    record["wall_seconds"] = time.time() - t0
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    print(f"{record['wall_seconds']:.0f} s; results: {out}")


if __name__ == "__main__":
    main()
