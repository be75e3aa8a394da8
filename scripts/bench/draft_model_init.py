"""A draft model started from the target's layers against the same shape started at random: one store, one config,
the same steps (one shape and one batch schedule: the same training minutes), then MT-Bench in the built-in runtime.

    python scripts/bench/draft_model_init.py [--steps 240 --k 1 --num-prompts 5 --max-new-tokens 64]

Each arm is `eagle-train --config draft_model_smollm2` with draft_init=target or random, into runs/draft_model_smollm2
(what DRAFTER=draft_model bash scripts/quickstart.sh trains) and runs/draft_model_random_smollm2, resumed where
there. Prints per arm the minutes its steps took (metrics.jsonl: each step's tokens over its rate), the held-out loss
and chain AL before and after training, and eagle-eval's AL, tokens/s and speedup at chain K (greedy, no n-gram).
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

ARMS = {"target": "runs/draft_model_smollm2", "random": "runs/draft_model_random_smollm2"}


def train(init: str, output_dir: str, steps: int, store: str) -> None:
    cmd = [sys.executable, "-m", "eagle_cli.train", "--config", "draft_model_smollm2", f"draft_init={init}"]
    cmd += [f"data_path={store}", f"output_dir={output_dir}", f"max_steps={steps}", "save_every=40", "resume=auto"]
    subprocess.run(cmd, check=True)


def curve(output_dir: str) -> dict:
    """Training minutes and the first and last held-out metrics, from the run's metrics.jsonl."""
    lines = [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if m["split"] == "train"]
    evals = [m for m in lines if m["split"] == "eval"]
    return {
        "steps": len(steps),
        "minutes": sum(m["tokens"] / m["tokens_per_s"] for m in steps) / 60,
        "before": evals[0],
        "after": evals[-1],
    }


def evaluate(output_dir: str, args) -> dict:
    out = Path(output_dir) / f"eval_init_k{args.k}.json"
    cmd = ["eagle-eval", "--target", "smollm2-135m", "--draft", f"{output_dir}/final", "--bench", "mt_bench"]
    cmd += [
        "--chain",
        str(args.k),
        "--num-prompts",
        str(args.num_prompts),
        "--max-new-tokens",
        str(args.max_new_tokens),
    ]
    subprocess.run([*cmd, "--no-ngram", "--out", str(out)], check=True)
    return json.loads(out.read_text())["summary"]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=240)
    p.add_argument("--store", default="runs/smollm2_sharegpt/store", help="the main job's store (eagle-prep run)")
    p.add_argument("--k", type=int, default=1, help="chain drafts a round in the eval")
    p.add_argument("--num-prompts", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=64)
    args = p.parse_args()
    rows = {}
    for init, output_dir in ARMS.items():
        train(init, output_dir, args.steps, args.store)
        rows[init] = {**curve(output_dir), **evaluate(output_dir, args)}
    shape = f"draft model of SmolLM2's shape (its first 3 layers), {args.steps} steps"
    print(f"\n{shape}; MT-Bench {args.num_prompts} prompts, {args.max_new_tokens} new tokens, chain K={args.k}")
    print(f"{'init':8} {'minutes':>8} {'eval loss':>18} {'eval chain AL':>18} {'AL':>7} {'speedup':>8}")
    for init, r in rows.items():
        loss = f"{r['before']['loss']:.3f} -> {r['after']['loss']:.3f}"
        chain = f"{r['before']['chain_al']:.3f} -> {r['after']['chain_al']:.3f}"
        print(f"{init:8} {r['minutes']:8.1f} {loss:>18} {chain:>18} {r['acceptance_length']:7.3f} {r['speedup']:7.2f}x")


if __name__ == "__main__":
    main()
