"""Time to quality: a recipe's acceptance length against minutes of compute, as a curve.

    python scripts/bench/quality.py --budget 15 --out runs/quality/main_job \\
        --prep configs/smollm2_sharegpt.yaml \\
        --train configs/eagle3_smollm2.yaml max_steps=140

A recipe is a prep YAML and a train YAML, each followed by key=value overrides, exactly as
`eagle-prep run --config FILE key=value ...` and `eagle-train --config FILE key=value ...`
take them. The harness sets the paths itself (prep out_dir, train data_path and output_dir) and the
checkpoint interval (save_every, from --save-every). --recipe names an objective (`RECIPES`: sft, tv,
onpolicy, tv+onpolicy) whose overrides go right after the train YAML.

One run:
1. data: `eagle-prep run` into <out>/data (or --data DIR), timed. A DIR that already holds the
   data of the same prep command is reused and charged the minutes recorded when it was made.
2. training: `python -m eagle_cli.train` (any method) in a child process writing <out>/train/checkpoint-<step>.
   Every --eval-every minutes of compute, the harness stops the trainer (SIGSTOP), evaluates the
   newest checkpoint not yet evaluated, and lets the trainer go on (SIGCONT). A point's x is the
   compute when that checkpoint was written: data minutes + the minutes the trainer had run, its
   start-up and its own held-out eval included, evaluation pauses excluded.
3. the end: training finishes, or compute reaches --budget and the trainer is killed; the newest
   checkpoint is the last point. Minutes trained after it are reported as wasted by the cut.

Evaluation runs the built-in runtime (inference/, what `eagle-eval` runs) greedily on the first
--num-prompts prompts of each bench: plain decoding once per prompt turn (the speedup's reference,
timed at every point, so a busy machine slows both sides alike), then each drafting (--chain,
--tree). MT-Bench's second turn follows the plain answer, which greedy speculative decoding
reproduces token for token. AL and speedup are eagle-eval's (`inference.evaluate.run_bench`, `summarise`), as it
prints them. Once per run, on the first point's plain outputs, one target forward per turn gives
the target's mean top-1 probability on its own greedy tokens: how predictable the text a head must
guess is, to compare runs on other targets or prompts.

Five prompts of 64 tokens cannot tell heads 0.03 AL apart. So each point also walks the chain (K = --chain)
over the target's greedy answers to the first turns of the first --walk-prompts prompts of each bench (made
once, batched, --walk-new-tokens long, with their hidden states): `ttt.chain_walk` (a block head:
`methods.block.loss.block_walk`) over the head's top-1
agreement on that text runs the rounds greedy chain decoding runs there, without decoding
(tests/test_runtime_generate.py checks it against the runtime), at ~20x the tokens in seconds.

Outputs in --out: quality.json (settings, commands, data minutes, per point: minutes of data,
training and evaluation, step, training tokens seen, AL and speedup per bench per drafting, the walk's AL),
quality.png (AL and speedup against minutes of compute; written after every point), data/ and
train/ (with train.log).

The learning-rate schedule is the recipe's (max_steps or num_epochs): a budget that ends before it
shows a run cut mid-schedule. quality.json's training.steps_per_minute sizes max_steps for the next
run. The trainer and the evaluation take turns on the CPU, never run together; set OMP_NUM_THREADS.
"""

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from data_prep.distil import generate_and_capture
from eagle_train.checkpoint import load_draft_head
from eagle_train.hidden_states import TargetLogits
from eagle_train.methods import row
from eagle_train.methods.block.loss import block_walk
from eagle_train.methods.eagle3.ttt import chain_walk
from eagle_train.target import end_of_turn_ids, load_target
from eagle_train.train_checkpoint import finished_at, newest_checkpoint
from eagle_train.train_config import load_train_config
from inference.drafting import TreeShape
from inference.evaluate import BENCHES, chat_ids, load_bench, run_bench, summarise
from inference.generate import Runtime
from inference.runtime_eval import RuntimeEngine

# --recipe: the training objective, as train overrides placed after the YAML file (later --train overrides win)
RECIPES = {
    "sft": ["tv_weight=0", "rejection_weight=0"],  # soft cross-entropy toward the target's distribution
    "tv": ["tv_weight=0.5", "rejection_weight=0"],  # half total variation: sampled decoding's acceptance objective
    "onpolicy": ["tv_weight=0", "rejection_weight=2"],  # drafts the head's own chain walk gets rejected at weigh 3
    "tv+onpolicy": ["tv_weight=0.5", "rejection_weight=2"],
}
POLL_SECONDS = 2.0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--budget",
        type=float,
        required=True,
        metavar="MIN",
        help="minutes of compute (data + training) the recipe may spend; evaluation is extra",
    )
    p.add_argument("--out", required=True, help="run directory (new); quality.json and quality.png go here")
    p.add_argument(
        "--prep",
        nargs="+",
        required=True,
        metavar="ARG",
        help="prep YAML then its key=value overrides (eagle-prep run), e.g. "
        "configs/smollm2_sharegpt.yaml prep.num_conversations=200",
    )
    p.add_argument(
        "--train",
        nargs="+",
        required=True,
        metavar="ARG",
        help="train YAML then its key=value overrides (eagle-train), e.g. "
        "configs/eagle3_smollm2.yaml max_steps=300 ttt_length=4",
    )
    p.add_argument(
        "--recipe",
        choices=list(RECIPES),
        default=None,
        help="the objective: " + "; ".join(f"{k}: {' '.join(v)}" for k, v in RECIPES.items()),
    )
    p.add_argument(
        "--data",
        default=None,
        metavar="DIR",
        help="data directory (default <out>/data); one made earlier by the same --prep is reused and "
        "charged its recorded minutes, so several training recipes can share one prep",
    )
    p.add_argument(
        "--eval-every",
        type=float,
        default=None,
        metavar="MIN",
        help="evaluate at every multiple of this many minutes of compute (default: budget / 4)",
    )
    p.add_argument(
        "--save-every",
        type=int,
        default=5,
        metavar="STEPS",
        help="checkpoint interval of the trainer (overrides the recipe's save_every): the checkpoint a "
        "point evaluates is the newest one when its minute comes (default 5)",
    )
    p.add_argument(
        "--prep-python",
        default=sys.executable,
        metavar="PYTHON",
        help="the Python that runs eagle-prep run: another environment's, e.g. one with vLLM for "
        "prep.distil.engine=vllm (default: this one; training always runs in this one)",
    )
    p.add_argument("--bench", nargs="+", default=list(BENCHES), help=f"bench sets (default: {' '.join(BENCHES)})")
    p.add_argument("--num-prompts", type=int, default=20, help="prompts per bench (default 20)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per turn (default 128)")
    p.add_argument("--chain", type=int, default=3, metavar="K", help="chain drafting with K drafts (default 3)")
    p.add_argument(
        "--walk-prompts",
        type=int,
        default=20,
        metavar="N",
        help="first turns per bench whose greedy answers the chain walks at every point (default 20; 0: none)",
    )
    p.add_argument("--walk-new-tokens", type=int, default=128, help="their answers' length (default 128)")
    p.add_argument(
        "--tree",
        default=None,
        metavar="DEPTH,TOPK,TOTAL",
        help="EAGLE-2 tree verified alongside the chain (default 3,2,4: 4 drafts per round; none for the block "
        "drafters, which draft chains only); none: skip",
    )
    p.add_argument("--device", default=None, help="evaluation device (default: cuda when available, else cpu)")
    p.add_argument("--name", default=None, help="label of the curve (default: the --out directory's name)")
    args = p.parse_args(argv)
    if args.recipe:
        args.train[1:1] = RECIPES[args.recipe]
    return args


# ------------------------------------------------------------------------------------ data


def prepare_data(prep: list[str], data_dir: Path, python: str = sys.executable) -> float:
    """Minutes the data of `prep` cost: run `eagle-prep run` into `data_dir`, or read what a finished
    earlier run of the same command recorded there."""
    record = data_dir / "prep.json"
    if record.is_file():
        done = json.loads(record.read_text())
        if done["prep"] != prep:
            raise SystemExit(
                f"{data_dir} holds the data of --prep {' '.join(done['prep'])}, not of this --prep: "
                "choose another --data"
            )
        print(f"[quality] data: reusing {data_dir} ({done['minutes']:.2f} min when it was made)")
        return done["minutes"]
    if data_dir.exists() and any(data_dir.iterdir()):
        raise SystemExit(
            f"{data_dir} holds files but no prep.json (an unfinished prep?): delete it or choose another --data"
        )
    data_dir.mkdir(parents=True, exist_ok=True)
    command = [python, "-m", "data_prep.cli", "run", "--config", *prep, f"out_dir={data_dir}"]
    print(f"[quality] data: {' '.join(command[1:])}")
    start = time.time()
    with open(data_dir / "prep.log", "w") as log:
        rc = subprocess.call(command, stdout=log, stderr=subprocess.STDOUT)
    minutes = (time.time() - start) / 60
    if rc != 0:
        raise SystemExit(
            f"eagle-prep run failed (exit {rc}); the end of {data_dir / 'prep.log'}:\n"
            + "".join((data_dir / "prep.log").read_text().splitlines(True)[-15:])
        )
    record.write_text(json.dumps({"prep": prep, "minutes": minutes}, indent=1))
    print(f"[quality] data: {minutes:.2f} min")
    return minutes


# ------------------------------------------------------------------------------------ training


class TrainerProcess:
    """The training script in its own process group, stopped while the harness evaluates. Its
    clock counts the seconds it ran, at any wall time."""

    def __init__(self, command: list[str], log_path: Path):
        self.start = time.time()
        with open(log_path, "w") as log:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.pauses = []  # (stopped, continued) wall times; the open one ends at inf

    def running_seconds(self, at: float | None = None) -> float:
        at = time.time() if at is None else at
        return at - self.start - sum(min(end, at) - start for start, end in self.pauses if start < at)

    def pause(self):
        os.killpg(self.proc.pid, signal.SIGSTOP)
        self.pauses.append((time.time(), math.inf))

    def resume(self):
        self.pauses[-1] = (self.pauses[-1][0], time.time())
        os.killpg(self.proc.pid, signal.SIGCONT)

    def kill(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # also ends a stopped process
            self.proc.wait()


# ------------------------------------------------------------------------------------ evaluation


class Evaluator:
    """The target, the bench prompts and the draftings, loaded once; `__call__` evaluates one head."""

    def __init__(
        self,
        target: str,
        device,
        benches,
        num_prompts: int,
        shapes: dict,
        max_new_tokens: int,
        walk_prompts: int = 0,
        walk_new_tokens: int = 128,
    ):
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model, self.tokenizer = load_target(target, device=self.device)
        self.eos = end_of_turn_ids(self.model, self.tokenizer)
        self.prompts = {bench: load_bench(bench, num_prompts) for bench in benches}
        self.shapes, self.max_new_tokens = shapes, max_new_tokens
        self.walk_prompts = {bench: load_bench(bench, walk_prompts) for bench in benches} if walk_prompts else {}
        self.walk_new_tokens, self.walk_texts = walk_new_tokens, {}  # per aux layer set

    def __call__(self, head_dir) -> tuple[dict, dict]:
        """({drafting: {bench: summary}}, {bench: [(prompt ids, plain output ids) per turn]})."""
        head = load_draft_head(head_dir, self.model).to(device=self.device, dtype=self.model.dtype).eval()
        runtimes = {
            name: Runtime(self.model, head, shape, eos_token_ids=self.eos, seed=0)
            for name, shape in self.shapes.items()
        }
        if self.device.type == "cuda":  # graph capture stays out of the timings
            for runtime in runtimes.values():
                runtime.generate(chat_ids(self.tokenizer, [{"role": "user", "content": "Hi"}]), 8)
        engine = RuntimeEngine(
            next(iter(runtimes.values())), {name: rt.generate for name, rt in runtimes.items()}, self.tokenizer
        )
        summaries, sequences = {name: {} for name in runtimes}, {}
        for bench, prompts in self.prompts.items():
            results = run_bench(engine, self.tokenizer, prompts, self.max_new_tokens)
            sequences[bench] = [(t["prompt_ids"], t["plain"]["output_ids"]) for r in results for t in r["turns"]]
            for name, shape in self.shapes.items():
                summaries[name][bench] = summarise(results, shape.depth, name)
        return summaries, sequences

    @torch.no_grad()
    def walk(self, head_dir, k: int) -> dict:
        """Per bench, {acceptance_length, rounds}: greedy chain K = k over the walk texts (`ttt.chain_walk`, the
        trainer's chain_al). The texts are the target's greedy answers to the walk prompts' first turns with the
        states of the head's aux layers, made once per layer set."""
        head = load_draft_head(head_dir, self.model).to(device=self.device, dtype=self.model.dtype).eval()
        aux = tuple(head.config.aux_layer_ids)
        if aux not in self.walk_texts:
            self.walk_texts[aux] = {
                bench: generate_and_capture(
                    self.model,
                    [chat_ids(self.tokenizer, [{"role": "user", "content": p["turns"][0]}]) for p in prompts],
                    self.walk_new_tokens,
                    aux,
                    self.eos,
                    self.tokenizer.pad_token_id,  # load_target sets one
                )
                for bench, prompts in self.walk_prompts.items()
            }
        # the target's distribution in fp32 and the head in the target's dtype, as the trainer has them
        target_logits = TargetLogits.of(self.model, self.device, torch.float32)
        out = {}
        for bench, texts in self.walk_texts[aux].items():
            walk = block_walk if row(head.config.method).family == "block" else chain_walk
            tokens, rounds = walk(head, texts, target_logits, k)
            out[bench] = {"acceptance_length": tokens / max(rounds, 1), "rounds": rounds}
        return out

    @torch.inference_mode()
    def target_top1_probability(self, sequences: dict) -> dict:
        """The target's mean top-1 probability over its own greedy tokens, per bench and pooled."""
        out, total, count = {}, 0.0, 0
        for bench, turns in sequences.items():
            s, n = 0.0, 0
            for ids, output in turns:
                x = torch.tensor([ids + output], device=self.device)
                logits = self.model(x).logits[0, len(ids) - 1 : len(ids) + len(output) - 1].float()
                s += float(logits.softmax(-1).max(-1).values.sum())
                n += len(output)
            out[bench] = s / n
            total, count = total + s, count + n
        out["all"] = total / count
        return out


# ------------------------------------------------------------------------------------ report


def plot_curve(record: dict, path: Path) -> bool:
    """AL (top row) and speedup (bottom row) against minutes of compute, one column per drafting."""
    try:
        import matplotlib
    except ImportError:
        print(f"[quality] plot skipped: matplotlib is not installed (pip install 'eagle-train[plot]' to get {path})")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points, names, benches = record["points"], list(record["eval"]["drafting"]), record["eval"]["benches"]
    fig, axes = plt.subplots(2, len(names), figsize=(5.5 * len(names), 7), squeeze=False, sharex=True, sharey="row")
    x = [p["compute_minutes"] for p in points]
    for col, name in enumerate(names):
        al, speed = axes[0][col], axes[1][col]
        for bench in benches:
            al.plot(x, [p["results"][name][bench]["acceptance_length"] for p in points], "o-", lw=1, label=bench)
            speed.plot(x, [p["results"][name][bench]["speedup"] for p in points], "o-", lw=1, label=bench)
        al.plot(x, [p["mean_acceptance_length"][name] for p in points], "ks-", lw=2.5, label="mean")
        for ax in (al, speed):
            ax.axvline(record["data_minutes"], color="grey", ls="--", lw=1)
            ax.grid(alpha=0.3)
        speed.axhline(1.0, color="grey", lw=0.8)
        al.set(title=f"{name} (dashed: data ready)", ylabel="acceptance length", ylim=(1.0, None))
        speed.set(
            xlabel="minutes of compute (data + training)",
            ylabel="speedup over plain decoding",
            xlim=(0, max([record["budget_minutes"], *x]) * 1.02),
        )
    axes[0][0].legend(fontsize=8)
    top1 = record.get("target_top1_probability", {}).get("all")
    fig.suptitle(
        f"{record['name']}: budget {record['budget_minutes']:g} min, data {record['data_minutes']:.1f} min, "
        f"evaluation {record['eval_minutes']:.1f} min (not on the x-axis)"
        + (f", target top-1 p {top1:.3f}" if top1 is not None else "")
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def save(record: dict, out: Path) -> None:
    (out / "quality.json").write_text(json.dumps(record, indent=1))
    if record["points"]:
        plot_curve(record, out / "quality.png")


# ------------------------------------------------------------------------------------ the run


def main(argv=None):
    args = parse_args(argv)
    out = Path(args.out)
    data_dir = Path(args.data) if args.data else out / "data"
    train_dir = out / "train"
    if (out / "quality.json").exists() or train_dir.exists():
        raise SystemExit(f"{out} holds an earlier run: choose a new --out (--data can share its data)")
    train_file, *train_overrides = args.train
    cfg = load_train_config(train_file, train_overrides)  # a bad key fails before any compute
    block = row(cfg.method).family == "block"
    tree = (args.tree or ("none" if block else "3,2,4")).lower()
    if block and tree != "none":
        raise SystemExit(f"--tree {args.tree}: a {row(cfg.method).title} head drafts a chain only; drop --tree")
    shapes = {f"chain K={args.chain}": TreeShape.chain(args.chain)}
    if tree != "none":
        shape = TreeShape.parse(tree)
        shapes[f"tree {shape.depth},{shape.topk},{shape.total}"] = shape
    for bench in args.bench:
        load_bench(bench, args.num_prompts)  # a bad bench fails before any compute
    eval_every = args.eval_every or args.budget / 4
    data_path = data_dir / ("tokenized" if cfg.mode == "online" else "store")
    train_command = [
        sys.executable,
        "-m",
        "eagle_cli.train",
        "--config",
        *args.train,
        f"data_path={data_path}",
        f"output_dir={train_dir}",
        f"save_every={args.save_every}",
    ]
    out.mkdir(parents=True, exist_ok=True)

    record = {
        "name": args.name or out.name,
        "budget_minutes": args.budget,
        "eval_every_minutes": eval_every,
        "prep": args.prep,
        "prep_python": args.prep_python,
        "recipe": args.recipe,
        "train": args.train,
        "train_command": train_command[1:],
        "eval": {
            "benches": args.bench,
            "num_prompts": args.num_prompts,
            "max_new_tokens": args.max_new_tokens,
            "drafting": {name: asdict(shape) for name, shape in shapes.items()},
            "temperature": 0.0,
            "walk": {"prompts": args.walk_prompts, "max_new_tokens": args.walk_new_tokens, "chain": args.chain},
        },
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "points": [],
        "eval_minutes": 0.0,
    }
    wall = time.time()
    record["data_minutes"] = data_minutes = prepare_data(args.prep, data_dir, args.prep_python)
    save(record, out)
    if data_minutes >= args.budget:
        raise SystemExit(f"the data took {data_minutes:.1f} min, the whole --budget {args.budget:g} min: no training")

    evaluator = None
    train_dir.mkdir(parents=True)
    print(f"[quality] training: {' '.join(train_command[1:])}")
    trainer = TrainerProcess(train_command, train_dir / "train.log")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a killed harness still kills its trainer (finally)

    def compute_minutes(at=None):
        return data_minutes + trainer.running_seconds(at) / 60

    def evaluate(checkpoint: Path, state: dict):
        nonlocal evaluator
        start = time.time()
        written = finished_at(checkpoint)
        if evaluator is None:
            evaluator = Evaluator(
                cfg.target,
                args.device,
                args.bench,
                args.num_prompts,
                shapes,
                args.max_new_tokens,
                args.walk_prompts,
                args.walk_new_tokens,
            )
        summaries, sequences = evaluator(checkpoint)
        walk = evaluator.walk(checkpoint, args.chain) if args.walk_prompts else {}
        if "target_top1_probability" not in record:
            record["target_top1_probability"] = evaluator.target_top1_probability(sequences)
        point = {
            "checkpoint": checkpoint.name,
            "step": state["step"],
            "total_steps": state["total_steps"],
            "tokens_seen": state["tokens_consumed"],
            "samples_seen": state["samples_consumed"],
            "data_minutes": data_minutes,
            "train_minutes": trainer.running_seconds(written) / 60,
            "compute_minutes": compute_minutes(written),
            "eval_minutes": (time.time() - start) / 60,
            "mean_acceptance_length": {
                name: sum(s["acceptance_length"] for s in per.values()) / len(per) for name, per in summaries.items()
            },
            "results": {
                name: {
                    bench: {k: v for k, v in s.items() if k != "tokens_per_forward_histogram"}
                    for bench, s in per.items()
                }
                for name, per in summaries.items()
            },
            "walk": walk,
        }
        record["points"].append(point)
        record["eval_minutes"] += point["eval_minutes"]
        save(record, out)
        speedups = {name: [s["speedup"] for s in per.values()] for name, per in summaries.items()}
        als = "; ".join(
            f"{name} "
            + " ".join(f"{b} {s['acceptance_length']:.3f}" for b, s in per.items())
            + f" ({min(speedups[name]):.2f}-{max(speedups[name]):.2f}x)"
            for name, per in summaries.items()
        )
        walked = " ".join(f"{b} {w['acceptance_length']:.3f}" for b, w in walk.items())
        walked = f"; chain K={args.chain} walk over {args.walk_prompts} prompts {walked}" if walk else ""
        print(
            f"[quality] step {state['step']}, {point['compute_minutes']:.2f} min compute, "
            f"{state['tokens_consumed']} tokens: {als}{walked} [eval {point['eval_minutes']:.2f} min]"
        )

    evaluated, next_point = 0, eval_every
    try:
        while True:
            if trainer.proc.poll() is not None:
                ended = "finished" if trainer.proc.returncode == 0 else f"trainer exited {trainer.proc.returncode}"
                break
            if compute_minutes() >= args.budget:
                trainer.pause()
                ended = "budget"
                break
            if compute_minutes() >= next_point:
                found = newest_checkpoint(train_dir, evaluated)
                if found:
                    trainer.pause()
                    found = newest_checkpoint(train_dir, evaluated)  # the newest once stopped
                    evaluate(*found)
                    evaluated = found[1]["step"]
                    while next_point <= compute_minutes():
                        next_point += eval_every
                    trainer.resume()
            time.sleep(POLL_SECONDS)
        train_seconds = trainer.running_seconds()
        found = newest_checkpoint(train_dir, evaluated)
        if found:
            evaluate(*found)
    finally:
        trainer.kill()

    last = record["points"][-1] if record["points"] else None
    record["training"] = {
        "ended": ended,
        "minutes": train_seconds / 60,
        "minutes_after_last_point": train_seconds / 60 - last["train_minutes"] if last else None,
        "steps_per_minute": last["step"] / last["train_minutes"] if last else None,
        "tokens_per_second": last["tokens_seen"] / (60 * last["train_minutes"]) if last else None,
    }
    record["wall_minutes"] = (time.time() - wall) / 60
    save(record, out)
    if ended.startswith("trainer exited"):
        print("".join((train_dir / "train.log").read_text().splitlines(True)[-15:]))
    print(
        f"[quality] training {ended} after {train_seconds / 60:.2f} min; {len(record['points'])} points; "
        f"wall {record['wall_minutes']:.2f} min (evaluation {record['eval_minutes']:.2f}) -> {out / 'quality.json'}"
    )


if __name__ == "__main__":
    main()
