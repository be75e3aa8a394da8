"""llama.cpp as an engine (`LlamaCpp`, its entry in engines.ENGINES): it loads no export directory: its file is
one GGUF (`draft_gguf`: a head's as `eagle_train.export.gguf.export_gguf` writes it, a draft model's as llama.cpp's
converter does), and it decodes a bench live for eagle-eval (`LlamaCppTurns`, `evaluate`) and the live check.

Building its tools is engines/llamacpp_build.py (with `eagle-llamacpp`), running them and reading their
counters engines/llamacpp_run.py, what it reads from a draft's GGUF engines/llamacpp_rules.py.
"""

import shutil
import tempfile
import time
from pathlib import Path

from eagle_train.checkpoint import GGUF, load_draft_head, locate_head
from eagle_train.export import export_head
from eagle_train.export.gguf import export_gguf, with_target_tokenizer
from eagle_train.export.layouts import layout
from eagle_train.methods import method_with, noun_of, row
from eagle_train.target import load_tokenizer, target_gguf
from engines.engine import Engine
from engines.live import EngineFailed, Pooled
from engines.llamacpp_build import BUILD_HINT, LlamaCppError, convert_target, require_tools, tools_dir
from engines.llamacpp_rules import static_findings
from engines.llamacpp_run import (
    LlamaCppRun,
    drafting,
    free_types,
    head_flags,
    hybrid_flags,
    measure,
    ngram_key,
    run_plain,
    run_speculative,
)
from engines.rules import Finding
from inference.evaluate import (
    Configuration,
    EvalOptions,
    TurnEngine,
    TurnResult,
    load_bench,
    run_bench,
    summarise_drafters,
)

# ---- the engine ----------------------------------------------------------------------------------


def head_gguf(draft, target, out: Path):
    """(the GGUF llama.cpp loads for `draft`, the head exported into it or None): a .gguf is used as it
    is, a training checkpoint or head directory is exported to `out` against the target's GGUF."""
    found = locate_head(draft)
    if found.kind == GGUF:
        return found.path, None
    head = load_draft_head(found.path)
    return draft_gguf(head, out, target), head


def draft_gguf(head, out, target, outtype: str = "f32") -> Path:
    """`head` as the one GGUF llama.cpp loads beside the target's: a head by `export_gguf` (against the target's
    GGUF `target`), a draft model by llama.cpp's own converter from its model directory (`Layout.llamacpp_converts`:
    a model of the target's architecture is llama.cpp's format to know), with the target's GGUF tokenizer."""
    own = row(head.config.method).layout
    if own is None or not layout(own).llamacpp_converts:
        return export_gguf(head, out, target, outtype)
    with tempfile.TemporaryDirectory() as tmp:
        export_head(head, Path(tmp) / "model", own, dtype="fp32")
        converted = with_target_tokenizer(
            convert_target(Path(tmp) / "model", Path(tmp) / "model.gguf", outtype), target
        )
        return Path(shutil.move(converted, out))


class LlamaCpp(Engine):
    name = "llamacpp"
    title = "llama.cpp"
    live_title = "llama.cpp (llama-speculative-simple -md HEAD.gguf)"
    decodes_live = True

    def missing(self) -> str:
        try:
            found = tools_dir()
        except LlamaCppError as e:
            return str(e)
        return "" if found else f"no llama.cpp build: run `{BUILD_HINT}` (a few minutes, once), then check again"

    def check_refusal(self, target: str | None, threads: int | None) -> str:
        """It reads the target's GGUF (the head's tokenizer, the live run), so every check needs --target;
        --threads sets llama.cpp's CPU threads."""
        if target:
            return ""
        return "--engine llamacpp checks --check PATH against --target TARGET.gguf (or an alias shipping one)"

    def prepare(self, artifact: Path, target: str, source, tmp: Path):
        if source and locate_head(artifact).kind != GGUF:
            raise ValueError("--source names the head a .gguf came from; a head directory is its own source")
        file, head = head_gguf(artifact, target, tmp / "head.gguf")
        return file, head if head is not None else load_draft_head(Path(source)) if source else None

    def static_findings(self, file: Path, target: str, source_head) -> list[Finding]:
        return static_findings(file, target, source_head)

    def read_back(self, file: Path, model):
        return load_draft_head(file, model)

    def run_live(self, file: Path, target: str, questions: list[str], k: int, n: int, threads: int | None):
        from inference.evaluate import chat_text

        tokenizer = load_tokenizer(target)
        texts = [chat_text(tokenizer, [{"role": "user", "content": q}]) for q in questions]
        # a block head drafts its whole block: llama.cpp's block is n_max (+ 1) tokens, and a shorter one than the
        # head was trained on changes every draft of a non-causal head
        k = drafting(file).max_drafts or k
        try:
            runs = measure(target_gguf(target), file, texts, k, n, threads)
        except LlamaCppError as e:
            raise EngineFailed(str(e)) from e
        pooled = Pooled(sum(r["head"].tokens for r in runs), sum(r["head"].forwards for r in runs))
        return pooled, sum(r["identical"] for r in runs)

    def evaluate(self, options, answers=None) -> dict:
        return evaluate(options, answers)


# ---- eagle-eval --engine llamacpp ----------------------------------------------------------------


def turn_result(run: LlamaCppRun) -> TurnResult:
    """A `LlamaCppRun` in the bench loop's counts: every new token came from a counted forward (the first round
    carries the prompt's last token), tokens/s is llama.cpp's own (tokens inside its timed span)."""
    return TurnResult(
        answer=run.text,
        output_ids=None,
        tokens=run.tokens,
        forwards=run.forwards,
        emitted=run.tokens,
        seconds=run.seconds,
        timed_tokens=run.decoded,
        accepted_total=run.accepted,
        extra={"eos": run.eos, "llamacpp_prompt_tokens": run.prompt_tokens, "drafted": run.drafted},
    )


class LlamaCppTurns(TurnEngine):
    """llama.cpp's tools decoding turns greedily: "spec" with a head GGUF, each of `free_types` without one, and
    "hybrid", head + n-gram (`hybrid_flags`). Each prompt goes to the tools as the text of its chat-templated
    tokens, byte for byte."""

    def __init__(self, target_gguf: Path, head: Path, tokenizer, k: int, threads: int | None, ngram: bool = True):
        self.target, self.head, self.tokenizer, self.k, self.threads = target_gguf, head, tokenizer, k, threads
        self.flags = {"spec": head_flags(head, k)}
        if ngram:
            self.flags |= free_types(k) | {"hybrid": hybrid_flags(head, k)}
        self.drafters = tuple(self.flags)

    def decode(self, drafter: str, prompts: list[list[int]], max_new_tokens: int) -> list[TurnResult]:
        results = []
        for ids in prompts:
            text, n = self.tokenizer.decode(ids, clean_up_tokenization_spaces=False), max_new_tokens
            if drafter == "plain":
                run = run_plain(self.target, text, n, self.threads)
            else:
                run = run_speculative(self.target, text, n, self.flags[drafter], self.threads)
            results.append(turn_result(run))
        return results

    def same(self, plain: TurnResult, other: TurnResult) -> bool:
        """`same_text`: a speculative run may write up to K tokens past plain's unless plain stopped."""
        return other.answer == plain.answer if plain.extra["eos"] else other.answer.startswith(plain.answer)

    def configurations(self, target_name: str, head_name: str) -> dict[str, Configuration]:
        """Each drafter as the verdict names it, with the llama-server command that serves it (`target_name`,
        `head_name`: the GGUFs as the user names them)."""

        def serve(flags: list) -> str:
            shown = [head_name if f == self.head else str(f) for f in flags]
            return f"llama-server -m {target_name} " + " ".join(shown)

        noun = noun_of(method_with(gguf_spec_type=drafting(self.head).spec_type))  # "head", or "draft model"
        labels = {
            "spec": (noun, "head"),
            "ngram": (f"n-gram (free, ngram-simple key {ngram_key(self.k)})", "free"),
            "ngram-map-k": (f"n-gram (free, ngram-map-k key {ngram_key(self.k)})", "free"),
            "ngram-mod": (f"n-gram (free, ngram-mod key {ngram_key(self.k)})", "free"),
            "ngram-cache": ("n-gram (free, ngram-cache)", "free"),
            "hybrid": (f"{noun} + n-gram", "hybrid"),
        }
        return {name: Configuration(*labels[name], serve(flags)) for name, flags in self.flags.items()}


def evaluate(options: EvalOptions, answers=None) -> dict:
    """The bench through llama.cpp: plain, the head, each free type and head + n-gram on the same templated
    prompts (`LlamaCppTurns`; `--no-ngram`: plain and the head). A block head
    (DFlash, DSpark) drafts its whole block a round unless --parallel or --chain K asks for fewer drafts, which
    llama.cpp makes from a block of K (+ 1) tokens."""
    o = options
    builtin_only = {
        "--tree": o.tree,
        "--device": o.device,
        "--dtype": o.dtype,
        "--no-cuda-graphs": not o.cuda_graphs,
    }
    given = [flag for flag, value in builtin_only.items() if value]
    if given:
        raise ValueError(
            f"{', '.join(given)}: the built-in runtime's; --engine llamacpp drafts chains (--chain K) "
            "or a DFlash or DSpark head's blocks (--parallel K)"
        )
    if not o.greedy:
        raise ValueError("--engine llamacpp decodes greedily: leave out --temperature, --top-p and --top-k")
    k = o.depth
    if k < 1 or o.max_new_tokens < 1:
        raise ValueError(f"--chain and --max-new-tokens must be >= 1, got {k} and {o.max_new_tokens}")
    gguf = target_gguf(o.target)
    if gguf is None:
        raise ValueError(f"--engine llamacpp needs --target as a .gguf file or an alias shipping one, not {o.target!r}")
    prompts = load_bench(o.bench, o.num_prompts)
    bin_dir = require_tools()
    tokenizer = load_tokenizer(o.target)
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        head, _ = head_gguf(o.draft, gguf, Path(tmp) / "head.gguf")
        block = drafting(head).max_drafts
        if o.parallel and block is None:
            raise ValueError(
                "--parallel K drafts a DFlash or DSpark head's block; an EAGLE-3 head drafts chains: --chain K"
            )
        if block:
            k = min(k if o.parallel or o.chain else block, block)
        engine = LlamaCppTurns(gguf, head, tokenizer, k, o.threads, o.ngram)
        results = run_bench(
            engine, tokenizer, prompts, o.max_new_tokens, answers, f"eagle-eval llama.cpp {o.bench}", o.repeats
        )
        named = str(o.draft) if str(o.draft).endswith(".gguf") else "HEAD.gguf"
        summary = summarise_drafters(results, k, engine.configurations(str(gguf), named))
    return {
        "engine": "llamacpp",
        "title": f"{o.bench}: {len(prompts)} prompts, {summary['turns']} turns, llama.cpp greedy, "
        f"{'block' if block else 'chain'} K={k}, "
        f"{o.threads or 'default'} threads",
        "llamacpp_bin": str(bin_dir),
        "target": o.target,
        "target_gguf": str(gguf),
        "draft": str(o.draft),
        "bench": o.bench,
        "drafting": {"depth": k, "chain": not block, "parallel": bool(block), "ngram": k if o.ngram else None},
        "threads": o.threads,
        "max_new_tokens": o.max_new_tokens,
        "wall_seconds": time.time() - t0,
        "summary": summary,
        "prompts": results,
    }
