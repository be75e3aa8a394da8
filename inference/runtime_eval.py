"""The built-in runtime as an evaluation engine: its "decode one turn" for the bench loop
(`inference.evaluate.run_bench`) and `evaluate`, eagle-eval's run with it.

Each turn is decoded plainly (the speedup's reference), with the head ("spec", or prompt lookup alone
for `draft="ngram"`), with prompt lookup at the head's K ("ngram", the free baseline the head has to
beat) and with both, lookup first ("hybrid", llama.cpp's rule), one after another, all on one `Runtime`, so
they share the target's weights, caches and CUDA graphs.
"""

import time

import torch

from eagle_train.methods import noun_of
from inference.divergence import first_divergence
from inference.evaluate import (
    Configuration,
    EvalOptions,
    TurnEngine,
    TurnResult,
    load_bench,
    run_bench,
    summarise_drafters,
)
from inference.prompt_lookup import MAX_N, MIN_N

LOOKUP = f"{MIN_N}- to {MAX_N}-gram lookup"
FREE = Configuration(f"n-gram (free, {LOOKUP})", "free", "n-gram lookup alone, no head")


def turn_result(result, tokenizer) -> TurnResult:
    """A `GenerationResult`: the prefill and its token are not counted, each later forward is."""
    return TurnResult(
        answer=tokenizer.decode(result.output_ids, skip_special_tokens=True),
        output_ids=result.output_ids,
        tokens=len(result.output_ids),
        forwards=result.forwards,
        emitted=sum(result.emitted),
        seconds=result.seconds,
        timed_tokens=len(result.output_ids),
        prefill_seconds=result.prefill_seconds,
        accepted=result.accepted,
        accepted_total=sum(result.accepted),
        per_forward=result.emitted,
    )


class RuntimeEngine(TurnEngine):
    """Built-in runtimes decoding turns: plainly on `plain`, and with each of `drafters` (name -> a runtime's
    generate(prompt_ids, max_new_tokens), `eval_drafters`'s or a head per drafting's); they share the target,
    so `plain` also reruns it where a greedy decode parts from plain decoding."""

    def __init__(self, plain, drafters: dict, tokenizer):
        self.plain, self.generate, self.tokenizer = plain, drafters, tokenizer
        self.drafters = tuple(drafters)
        self.finds_divergence = plain.sampler.greedy

    def decode(self, drafter: str, prompts: list[list[int]], max_new_tokens: int) -> list[TurnResult]:
        generate = self.plain.generate_plain if drafter == "plain" else self.generate[drafter]
        return [turn_result(generate(ids, max_new_tokens), self.tokenizer) for ids in prompts]

    def divergence(self, prompt_ids, plain: TurnResult, other: TurnResult, max_new_tokens: int) -> dict | None:
        return first_divergence(self.plain, prompt_ids, plain.output_ids, other.output_ids, max_new_tokens)


def eval_drafters(runtime, ngram: int | None) -> tuple[dict, dict]:
    """eagle-eval's drafters on one runtime, each a generate(ids, max_new_tokens) and its `Configuration`: "spec"
    with its head (without one: prompt lookup with up to `ngram` drafts), and beside a head "ngram" (prompt
    lookup) and "hybrid" (lookup first, then the head), both with up to `ngram` drafts (None: not run)."""

    def lookup(ids, max_new_tokens):
        return runtime.generate_lookup(ids, max_new_tokens, ngram)

    def hybrid(ids, max_new_tokens):
        return runtime.generate_hybrid(ids, max_new_tokens, ngram)

    if runtime.drafter is None:
        if not ngram:
            raise ValueError("a runtime without a head drafts by prompt lookup: give its K (ngram)")
        return {"spec": lookup}, {"spec": FREE}
    cfg = runtime.drafter.head.config
    spec = Configuration(noun_of(cfg.method), "head", "export it for your engine (docs/deploying.md)")
    if not ngram:
        return {"spec": runtime.generate}, {"spec": spec}
    generate = {"spec": runtime.generate, "ngram": lookup, "hybrid": hybrid}
    return generate, {"spec": spec, "ngram": FREE, "hybrid": hybrid_configuration(cfg)}


def hybrid_configuration(cfg) -> Configuration:
    """Head + n-gram as the verdict names it: how llama.cpp serves it (vLLM cannot combine drafters; llama.cpp
    drafts only with the heads whose row has a GGUF spec type)."""
    from eagle_train.export.gguf import spec_type
    from eagle_train.methods import row

    method, label = row(cfg.method), f"{noun_of(cfg.method)} + n-gram"
    if method.gguf_spec_type is None:
        return Configuration(label, "hybrid", f"no engine here serves a {method.title} head behind n-gram lookup")
    combined = f"--spec-type ngram-simple,{spec_type(cfg)}"
    serve = f"llama.cpp: {combined}, the whole command printed by eagle-export --format gguf; vLLM cannot combine them"
    return Configuration(label, "hybrid", serve)


def precheck_head(draft, target_cfg):
    """The config-only check of a training checkpoint / head dir: its DraftConfig (exports are checked once
    loaded: None)."""
    from eagle_train.checkpoint import locate_head
    from eagle_train.draft_config import DraftConfig

    found = locate_head(draft)
    if not found.ours:
        return None
    cfg = DraftConfig.from_dict(found.config)
    cfg.check_fits(target_cfg)
    return cfg


def drafting_shape(o: EvalOptions, cfg):
    """The drafting eagle-eval asks of a head of config `cfg` (None: not known yet, or no head). --parallel K:
    K drafts from one forward, a P-EAGLE or block head's; a block head drafts its whole block by default."""
    from eagle_train.methods import row
    from inference.block_drafting import check_block_drafts
    from inference.drafting import TreeShape

    method = row(cfg.method) if cfg is not None else None
    if method is not None and method.family == "block":
        if o.tree:
            raise ValueError(
                f"{o.draft} holds a {method.title} head, which drafts a chain: use --parallel K, not --tree"
            )
        shape = TreeShape.chain(next(k for k in (o.parallel, o.chain, method.drafts(cfg)) if k is not None))
        check_block_drafts(cfg, shape.depth)
        return shape
    if o.parallel and method is not None and method.family == "chain":
        raise ValueError(
            f"--parallel drafts with a P-EAGLE or block (DFlash, DSpark) head; {o.draft} holds a {method.title} head "
            "(use --chain K or --tree)"
        )
    return TreeShape.parse(o.tree) if o.tree else TreeShape.chain(o.depth)  # K=0 is an error, not the default


def evaluate(options: EvalOptions) -> dict:
    """The bench through the built-in runtime: the record eagle-eval writes (its "title" is the table's)."""
    from eagle_train.checkpoint import load_draft_head
    from eagle_train.methods import row
    from eagle_train.target import end_of_turn_ids, load_target, load_target_config
    from inference.generate import Runtime
    from inference.sampling import Sampler

    o = options
    # everything a user can get wrong is checked before the target's weights are loaded
    if o.threads is not None:
        raise ValueError("--threads is for --engine llamacpp (the built-in runtime uses torch's threads)")
    lookup_only = o.draft == "ngram"
    if lookup_only and (o.tree or o.parallel or not o.ngram):
        raise ValueError("--draft ngram evaluates prompt lookup alone, which drafts a chain: give --chain K only")
    shape = drafting_shape(o, None)
    sampler = Sampler(o.temperature, o.top_k, o.top_p)
    if o.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {o.max_new_tokens}")
    prompts = load_bench(o.bench, o.num_prompts)
    device = torch.device(o.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but CUDA is not available")
    if not lookup_only:
        shape = drafting_shape(o, precheck_head(o.draft, load_target_config(o.target)))

    model, tokenizer = load_target(o.target, dtype=o.dtype, device=device)
    head = None if lookup_only else load_draft_head(o.draft, model)
    if head is not None:
        head.config.check_fits(model.config)
        shape = drafting_shape(o, head.config)  # an export's method is known once loaded
        head.to(device=device, dtype=model.dtype).eval()
    method = row(head.config.method) if head is not None else None
    family = method.family if method is not None else None
    ngram = shape.depth if o.ngram else None  # prompt lookup's K: the chain's, the tree's depth
    eos = end_of_turn_ids(model, tokenizer)
    runtime = Runtime(model, head, shape, sampler, eos_token_ids=eos, cuda_graphs=o.cuda_graphs, seed=o.seed)
    generate, configurations = eval_drafters(runtime, ngram)
    engine = RuntimeEngine(runtime, generate, tokenizer)

    if device.type == "cuda":  # kernel selection and graph capture stay out of the timings
        warmup = {"question_id": "warmup", "category": "", "turns": prompts[0]["turns"][:1]}
        run_bench(engine, tokenizer, [warmup], min(8, o.max_new_tokens))
    t0 = time.time()
    progress = f"eagle-eval {o.bench}"
    results = run_bench(engine, tokenizer, prompts, o.max_new_tokens, progress=progress, repeats=o.repeats)
    summary = summarise_drafters(results, shape.depth, configurations)
    drafting = f"tree {shape.depth},{shape.topk},{shape.total}" if o.tree else f"chain K={shape.depth}"
    if family in ("parallel", "block"):
        drafting = f"{family} ({method.title}) K={shape.depth}"
    if lookup_only:
        drafting = f"prompt lookup (no head) K={shape.depth}"
    dtype = str(model.dtype).replace("torch.", "")
    return {
        "engine": "builtin",
        "title": f"{o.bench}: {len(prompts)} prompts, {drafting}, temperature {o.temperature}, {device.type} {dtype}",
        "target": o.target,
        "draft": str(o.draft),
        "bench": o.bench,
        "drafting": {
            "depth": shape.depth,
            "topk": shape.topk,
            "total": shape.total,
            "chain": not o.tree,
            "parallel": family == "parallel",
            "block": family == "block",  # K drafts from one block of a DFlash or DSpark head
            "ngram": ngram,  # K of prompt lookup ("spec" with --draft ngram, else the "ngram" row); None: skipped
        },
        "sampling": {"temperature": o.temperature, "top_p": o.top_p, "top_k": o.top_k, "seed": o.seed},
        "device": str(device),
        "dtype": dtype,
        "cuda_graphs": runtime.use_graphs,
        "max_new_tokens": o.max_new_tokens,
        "wall_seconds": time.time() - t0,
        "summary": summary,
        "prompts": results,
    }
