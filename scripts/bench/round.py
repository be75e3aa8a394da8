"""Where a speculative round's time goes, at batch 1, against a plain decoding step.

    python scripts/bench/round.py --draft runs/eagle3/final --chain 3 [--bench gsm8k --num-prompts 5]
    python scripts/bench/round.py --draft dspark --oracle 0 --chain 3    # a random DSpark head, oracle drafts

Two tables. First, the target's verification forward by the number of rows it verifies (1 row is
a plain step): what K costs before any draft is accepted. Second, the per-round time of each part
of speculative decoding (verification forward, its logits, drafting, the head's catch-up, the
accept decision; the prompt's catch-up and logits count too) and of a plain step, from timers
around each call over whole generations. On CUDA every timer synchronizes, so that breakdown is
taken without CUDA graphs. Each prompt is decoded both ways one right after the other, the order
alternating (eagle-eval's loop), so a load that comes and goes lands on both. `--draft METHOD` builds a
random head of that method's shipped config shape and `--oracle P` drafts scripts/bench/oracle.py's known
continuation (each token wrong with probability P) at that head's cost: where the time of a round goes at an
acceptance set by construction.
"""

import argparse
import time
from collections import defaultdict

import torch
from oracle import oracle_runs, random_head  # beside this file: the oracle drafter

from eagle_train.checkpoint import load_draft_head
from eagle_train.methods import METHODS
from eagle_train.target import load_target
from inference.drafting import TreeShape
from inference.evaluate import chat_ids, load_bench, run_bench
from inference.generate import Runtime
from inference.llama import TargetModel
from inference.runtime_eval import RuntimeEngine


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def forward_ms(target: TargetModel, rows: int, context: int, reps: int) -> float:
    """One forward of `rows` tokens after `context` cached ones (a chain's causal mask)."""
    dev = target.device
    ids = torch.randint(0, target.config.vocab_size, (1, rows), device=dev)
    pos = context + torch.arange(rows, device=dev)
    mask = torch.ones(rows, context + rows, dtype=torch.bool, device=dev).tril(context)[None, None]
    with torch.inference_mode():
        for _ in range(3):
            target(ids, pos[None], pos, mask)
        sync(dev)
        t0 = time.perf_counter()
        for _ in range(reps):
            target(ids, pos[None], pos, mask)
        sync(dev)
    return (time.perf_counter() - t0) / reps * 1000


class Switch:
    """The timers' totals, switched to `parts[now]`: the decoding now running (the two alternate prompt by prompt)."""

    def __init__(self, parts: dict):
        self.parts, self.now = parts, "plain"

    def __getitem__(self, label):
        return self.parts[self.now][label]

    def __setitem__(self, label, value):
        self.parts[self.now][label] = value


def timed(obj, name: str, label: str, totals, device):
    """Replace obj.name by a wrapper that adds its wall time to totals[label]."""
    fn = getattr(obj, name)

    def wrapper(*args, **kwargs):
        sync(device)
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        sync(device)
        totals[label] += time.perf_counter() - t0
        return out

    setattr(obj, name, wrapper)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument(
        "--draft",
        required=True,
        help=f"head / checkpoint / export directory, or a method ({', '.join(METHODS)}) for a random head",
    )
    p.add_argument("--oracle", type=float, metavar="P", help="oracle drafts, each wrong with probability P")
    p.add_argument("--bench", default="gsm8k")
    p.add_argument("--num-prompts", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--chain", type=int, default=3)
    p.add_argument("--tree", default=None, metavar="DEPTH,TOPK,TOTAL")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model, tokenizer = load_target(args.target, dtype=dtype, device=device)
    if args.draft in METHODS:
        head = random_head(args.draft, model, args.target)
    else:
        head = load_draft_head(args.draft, model).to(device=device, dtype=dtype).eval()
    shape = TreeShape.parse(args.tree) if args.tree else TreeShape.chain(args.chain)
    first_turns = [{**q, "turns": q["turns"][:1]} for q in load_bench(args.bench, args.num_prompts)]
    prompts = [chat_ids(tokenizer, [{"role": "user", "content": q["turns"][0]}]) for q in first_turns]

    runtime = Runtime(model, head, shape, eos_token_ids=[tokenizer.eos_token_id], cuda_graphs=False)
    context = max(map(len, prompts)) + args.max_new_tokens // 2
    runtime.target.setup_cache(context + 64)
    print(f"target forward after {context} cached tokens, {device.type} {str(dtype).replace('torch.', '')}")
    counts = sorted({1, 2, 3, 4, 6, 8, shape.total + 1})
    times = {rows: forward_ms(runtime.target, rows, context, reps=20) for rows in counts}
    for rows, ms in times.items():
        print(f"  {rows:2d} rows: {ms:6.1f} ms  ({ms / times[1]:.2f}x a plain step)")

    by_decoding = {"speculative": defaultdict(float), "plain": defaultdict(float)}
    totals = Switch(by_decoding)
    timed(runtime, "target_step", "target forward", totals, device)
    timed(runtime.target, "logits", "target logits", totals, device)
    timed(runtime.drafter, "draft", "drafting", totals, device)
    timed(runtime.drafter, "catch_up", "head catch-up", totals, device)
    timed(runtime, "accept", "accept decision", totals, device)

    continuations = {tuple(q): runtime.generate_plain(q, args.max_new_tokens) for q in prompts}  # and a warm-up

    def speculative(q, max_new_tokens):
        totals.now = "speculative"
        if args.oracle is None:
            return runtime.generate(q, max_new_tokens)
        return oracle_runs(runtime, [q], [continuations[tuple(q)]], shape.depth, args.oracle)[0]

    generate_plain = runtime.generate_plain

    def plain(q, max_new_tokens):
        totals.now = "plain"
        return generate_plain(q, max_new_tokens)

    runtime.generate_plain = plain
    speculative(prompts[0], args.max_new_tokens)  # warm-up
    for part in by_decoding.values():
        part.clear()
    # each prompt decoded both ways, one right after the other in alternating order (eagle-eval's loop)
    engine = RuntimeEngine(runtime, {"speculative": speculative}, tokenizer)
    results = run_bench(engine, tokenizer, first_turns, args.max_new_tokens)
    turns = [t for r in results for t in r["turns"]]
    rounds = {}
    for name in ("speculative", "plain"):
        n = sum(t[name]["forwards"] for t in turns)
        seconds = sum(t[name]["seconds"] for t in turns)
        rounds[name] = (seconds / n * 1000, sum(t[name]["emitted"] for t in turns) / n, dict(by_decoding[name]), n)
    drafting = f"tree {shape.depth},{shape.topk},{shape.total}" if args.tree else f"chain K={shape.depth}"
    drafting += f" of a {head.config.method} head" + ("" if args.oracle is None else f", oracle p={args.oracle:g}")
    spec_ms, al, parts, n = rounds["speculative"]
    plain_ms, _, plain_parts, steps = rounds["plain"]
    print(
        f"\n{args.bench}: {len(prompts)} prompts x {args.max_new_tokens} new tokens, {drafting}: "
        f"{n} rounds, AL {al:.3f}; {steps} plain steps"
    )
    print(f"{'ms per round / step':24s} {'speculative':>12s} {'plain':>8s}")
    for label in ("target forward", "target logits", "drafting", "head catch-up", "accept decision"):
        plain = f"{plain_parts[label] / steps * 1000:8.2f}" if label in plain_parts else f"{'-':>8s}"
        print(f"{label:24s} {parts.get(label, 0.0) / n * 1000:12.2f} {plain}")
    rest, plain_rest = spec_ms - sum(parts.values()) / n * 1000, plain_ms - sum(plain_parts.values()) / steps * 1000
    print(f"{'rest (prefill included)':24s} {rest:12.2f} {plain_rest:8.2f}")
    print(f"{'whole (timed by generate)':24s} {spec_ms:12.2f} {plain_ms:8.2f}")
    print(
        f"a round costs {spec_ms / plain_ms:.2f}x a plain step; at AL {al:.3f} the speedup is "
        f"{al * plain_ms / spec_ms:.2f}x"
    )


if __name__ == "__main__":
    main()
