"""vLLM decoding live: plain, with a head (EAGLE-3, P-EAGLE, DFlash) or n-gram drafting, greedy at batch 1,
for eagle-eval (`VllmTurns`, an engine of the bench loop `inference.evaluate.run_bench`) and the live check.

vLLM takes over the process it runs in (thread binding, torch's thread count, a process group,
logging) and builds one engine per speculative config, so each `Decoder` is an engine in a child
process that stays up between calls: the bench loop holds plain decoding's, the head's and n-gram's up
together and asks each for every turn in turn, so all three are timed close together.

    with Decoder("smollm2-135m", speculative("eagle3", "my-head", 3)) as vllm:
        turns = vllm.decode(prompt_ids, 64)

fp32 on a CPU, where the live checks compare against HF in fp32, bf16 on CUDA; one prompt at a time
after a warm-up. vLLM counts spec-decode drafts, draft tokens and accepted tokens (in total and per
draft position); each prompt's share is the difference of the counters around its generate call.
"""

import json
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from eagle_train.checkpoint import load_draft_head, locate_head
from eagle_train.draft_config import DraftConfig
from eagle_train.export import export_head
from eagle_train.export.draft_files import DraftFiles
from eagle_train.export.layouts import block_read, block_settings, is_block, is_causal_lm
from eagle_train.methods import method_with, noun_of, row
from engines import vllm_child  # its missing() looked up when called: tests stand in for it
from engines.rules import is_parallel
from engines.vllm_child import ChildServer, VllmError, exit_child
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

DECODE_CHILD = "import sys; from engines.vllm_decode import serve; serve(*sys.argv[1:])"
CANNOT_COMBINE = (
    "no head + n-gram row: vLLM's speculative_config takes one method (SpeculativeConfig.method), so it cannot draft "
    "by n-gram lookup and fall back to a head as llama.cpp does"
)
SPEC_METRICS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted",
    "vllm:spec_decode_num_accepted_tokens_per_pos": "accepted_per_pos",
    "vllm:time_to_first_token_seconds": "first_token_seconds",  # a histogram: its sum
}


def speculative(method: str, head_dir, k: int) -> dict:
    """vLLM's speculative_config for a head of our `method` (its row's `vllm_method`; a P-EAGLE head drafts all K
    in one pass, a DFlash or DSpark head K from one block), or for "ngram", prompt lookup (no head; the same 2- to
    4-gram lookup as the built-in runtime's)."""
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": MIN_N, "prompt_lookup_max": MAX_N}
    config = {"method": row(method).vllm_method, "model": str(head_dir), "num_speculative_tokens": k}
    if row(method).family == "parallel":
        config["parallel_drafting"] = True
    return config


def export_dir(draft, tmp: Path):
    """(the export directory vLLM loads for `draft`, the head when `draft` is a training checkpoint or
    None): an engine-layout directory is used as it is, a checkpoint is exported in fp32 into `tmp`, in its
    method's own layout (`Method.layout`)."""
    found = locate_head(draft)
    if not found.ours:
        return found.path, None
    head = load_draft_head(found.path)
    return export_head(head, Path(tmp) / "export", row(head.config.method).layout, dtype="fp32"), head


def export_method(directory) -> str:
    """The method (for `speculative()`) an export directory drafts with: a block head's, a draft model's, else the
    method of the peagle layout (parallel drafting) or of the eagle3 layout."""
    files = DraftFiles(directory)
    if is_block(files.config):
        return block_settings(files.config)["method"]
    if is_causal_lm(files.config):
        return method_with(layout="draft_model")
    return method_with(layout="peagle" if is_parallel(files.config, files.meta) else "eagle3")


def head_method(draft) -> str:
    """The method of the head at `draft`, one of ours or an export, without reading its weights (a config that
    names none: DraftConfig's default)."""
    found = locate_head(draft)
    if found.ours:
        return found.config.get("method", DraftConfig.method)
    return export_method(found.path) if found.config is not None else DraftConfig.method


def check_block_k(directory, k: int) -> None:
    """Refuse, in one line, K drafts a block head cannot give (vLLM would draft them from slots it never trained)."""
    cfg = block_read(DraftFiles(directory).config)
    most = row(cfg.method).drafts(cfg)
    if not 1 <= k <= most:
        raise ValueError(
            f"a {cfg.method} head with block_size {cfg.block_size} drafts at most {most} tokens a "
            f"forward: use K from 1 to {most} (got {k})"
        )


@dataclass
class Turn:
    """One prompt decoded by vLLM, with its spec-decode counters."""

    prompt_ids: list[int]
    output_ids: list[int]
    seconds: float
    answer: str = ""  # the output as text, special tokens left out
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    first_token_seconds: float = 0.0  # of `seconds`, until the prefill's token (vLLM's time to first token)


class Decoder:
    """A vLLM engine (`spec`: a `speculative()` config, None: plain decoding) in a child process, up until
    `close`. `dtype` ("float32", "bfloat16"): the target's (default fp32 on a CPU, bf16 on CUDA)."""

    def __init__(self, target: str, spec: dict | None = None, dtype: str | None = None):
        reason = vllm_child.missing()
        if reason:
            raise VllmError(reason)
        self.server = ChildServer(DECODE_CHILD, {"target": target, "speculative_config": spec, "dtype": dtype})
        self.version, self.init_seconds = self.server.started["version"], self.server.started["init_seconds"]
        self.dtype = self.server.started["dtype"]

    def decode(self, prompts: list[list[int]], max_new_tokens: int) -> list[Turn]:
        """Each prompt (token ids) decoded greedily on its own, timed and counted."""
        reply = self.server.ask({"prompts": prompts, "max_new_tokens": max_new_tokens})
        return [Turn(**t) for t in reply["turns"]]

    def close(self) -> None:
        self.server.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def decode(target: str, prompts: list[list[int]], max_new_tokens: int, spec=None, dtype=None) -> list[Turn]:
    """`prompts` through one engine started for them."""
    with Decoder(target, spec, dtype) as vllm:
        return vllm.decode(prompts, max_new_tokens)


def rounds(turn: Turn) -> list[int]:
    """Accepted drafts per target forward, rebuilt from vLLM's counters: a chain accepts a prefix, so
    the rounds reaching position i are accepted_per_pos[i - 1] (their order is lost, not needed).
    vLLM counts only rounds that drafted; the others (n-gram finding no match) are forwards that
    accepted nothing: every forward emits one token plus its accepted drafts, the prefill the first."""
    reached = [turn.drafts, *turn.accepted_per_pos, 0]
    drafted = [j for j in range(len(reached) - 1) for _ in range(reached[j] - reached[j + 1])]
    undrafted = len(turn.output_ids) - 1 - turn.accepted - turn.drafts
    return drafted + [0] * max(undrafted, 0)


def turn_result(turn: Turn) -> TurnResult:
    """A vLLM turn in the bench loop's counts, the built-in runtime's: the prefill and its token left out."""
    accepted = rounds(turn)
    return TurnResult(
        answer=turn.answer,
        output_ids=turn.output_ids,
        tokens=len(turn.output_ids),
        forwards=len(accepted),
        emitted=sum(a + 1 for a in accepted),
        seconds=turn.seconds,
        timed_tokens=len(turn.output_ids),
        prefill_seconds=turn.first_token_seconds,
        accepted=accepted,
        accepted_total=turn.accepted,
        per_forward=[a + 1 for a in accepted],
    )


class VllmTurns(TurnEngine):
    """vLLM decoding the bench loop's turns: "spec" with the export in `head_dir` (`method`: eagle3, peagle,
    dflash or dspark), "ngram" with vLLM's prompt lookup, both at K = `k`; one engine per session (the loop
    holds them open together)."""

    def __init__(self, target: str, head_dir, method: str, k: int, ngram: bool = True, dtype: str | None = None):
        self.target, self.dtype = target, dtype
        self.configs = {"plain": None, "spec": speculative(method, head_dir, k), "ngram": speculative("ngram", None, k)}
        self.drafters = ("spec", "ngram") if ngram else ("spec",)
        self.noun = noun_of(method_with(vllm_method=method))  # "head", or "draft model"
        self.engines = {}  # drafter -> (vLLM version, engine start seconds, dtype)

    @contextmanager
    def session(self, drafter: str):
        with Decoder(self.target, self.configs[drafter], self.dtype) as vllm:
            self.engines[drafter] = (vllm.version, vllm.init_seconds, vllm.dtype)
            yield lambda prompts, max_new_tokens: [turn_result(t) for t in vllm.decode(prompts, max_new_tokens)]

    def decode(self, drafter: str, prompts: list[list[int]], max_new_tokens: int) -> list[TurnResult]:
        with self.session(drafter) as decode:
            return decode(prompts, max_new_tokens)

    def configurations(self, target: str, head_name: str) -> dict[str, Configuration]:
        """Each drafter as the verdict names it, with the `vllm serve` command that serves it (`head_name`: the
        export directory as the user names it)."""

        def serve(config: dict) -> str:
            shown = {k: head_name if k == "model" else v for k, v in config.items()}
            return f"vllm serve {target} --speculative-config '{json.dumps(shown)}'"

        labels = {
            "spec": (self.noun, "head"),
            "ngram": (f"n-gram (free, vLLM ngram, {MIN_N}- to {MAX_N}-gram)", "free"),
        }
        return {name: Configuration(*labels[name], serve(self.configs[name])) for name in self.drafters}


def evaluate(options: EvalOptions, answers=None) -> dict:
    """The bench through vLLM: plain, the head and n-gram drafting (unless options.ngram is off)."""
    from eagle_train.target import load_tokenizer

    o = options
    refusal = vllm_child.check_refusal(o.target, o.threads)  # the engine's own word on its arguments
    if refusal:
        raise ValueError(refusal)
    if o.tree or not o.greedy:
        raise ValueError("--engine vllm decodes greedy chains here: leave out --tree, --temperature, --top-p, --top-k")
    reason = vllm_child.missing() or vllm_child.head_refusal(row(head_method(o.draft)).vllm_method)
    if reason:
        raise ValueError(reason)
    k = o.depth
    prompts = load_bench(o.bench, o.num_prompts)
    tokenizer = load_tokenizer(o.target)
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        head_dir, exported = export_dir(o.draft, tmp)
        method = export_method(head_dir)
        if row(method).family == "block":
            check_block_k(head_dir, k)
        engine = VllmTurns(o.target, head_dir, method, k, o.ngram, o.dtype)
        results = run_bench(
            engine, tokenizer, prompts, o.max_new_tokens, answers, f"eagle-eval vLLM {o.bench}", o.repeats
        )
    served = "EXPORT_DIR" if exported is not None else str(o.draft)  # a checkpoint is served once exported
    summary = summarise_drafters(results, k, engine.configurations(o.target, served))
    if o.ngram:
        summary["notes"] = [CANNOT_COMBINE]
    version, _, dtype = engine.engines["plain"]
    family = row(method).family
    drafting = f"chain K={k}" if family == "chain" else f"{family} ({row(method).title}) K={k}"
    return {
        "engine": "vllm",
        "title": f"{o.bench}: {len(prompts)} prompts, vLLM {version}, {drafting}, greedy, {dtype}",
        "vllm_version": version,
        "target": o.target,
        "draft": str(o.draft),
        "bench": o.bench,
        "drafting": {"depth": k, "chain": True, "parallel": family != "chain", "ngram": k if o.ngram else None},
        "dtype": dtype,
        "max_new_tokens": o.max_new_tokens,
        "engine_init_seconds": [seconds for _, seconds, _ in engine.engines.values()],
        "wall_seconds": time.time() - t0,
        "summary": summary,
        "prompts": results,
    }


# ---- the child process ---------------------------------------------------------------------------


def counters(llm) -> dict:
    values = {name: 0 for name in SPEC_METRICS.values()}
    for metric in llm.get_metrics():
        name = SPEC_METRICS.get(metric.name)
        if name == "accepted_per_pos":
            values[name] = list(metric.values)
        elif name == "first_token_seconds":
            values[name] = metric.sum
        elif name is not None:
            values[name] = int(metric.value)
    return values


def decode_one(llm, tokenizer, ids: list[int], params) -> Turn:
    from vllm.inputs import TokensPrompt

    before = counters(llm)
    t = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0].outputs[0]
    seconds = time.perf_counter() - t
    after = counters(llm)
    delta = {k: after[k] - before[k] for k in after if k != "accepted_per_pos"}
    per_pos = after["accepted_per_pos"] or []
    delta["accepted_per_pos"] = [a - b for a, b in zip(per_pos, before["accepted_per_pos"] or [0] * len(per_pos))]
    answer = tokenizer.decode(out.token_ids, skip_special_tokens=True)
    return Turn(ids, list(out.token_ids), seconds, answer, **delta)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def serve(request_path) -> None:
    """The child of `Decoder` (`DECODE_CHILD`): start the engine, say so in one JSON line on stdout, then
    decode one JSON request per stdin line and answer each in one JSON line. The first request's first
    prompt is decoded once untimed, so engine warm-up stays out of the timings."""
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from eagle_train.target import load_tokenizer, resolve_target

    request = json.loads(Path(request_path).read_text())
    tokenizer = load_tokenizer(request["target"])
    t0 = time.perf_counter()
    llm = LLM(
        model=resolve_target(request["target"]),
        dtype=request["dtype"] or ("float32" if not _cuda() else "bfloat16"),
        enforce_eager=not _cuda(),
        disable_log_stats=False,
        speculative_config=request["speculative_config"],
        seed=0,
    )
    init_seconds = time.perf_counter() - t0
    dtype = str(llm.llm_engine.model_config.dtype).removeprefix("torch.")
    print(json.dumps({"version": vllm.__version__, "init_seconds": init_seconds, "dtype": dtype}), flush=True)
    warm = False
    for line in sys.stdin:
        asked = json.loads(line)
        if not warm and asked["prompts"]:
            first = TokensPrompt(prompt_token_ids=asked["prompts"][0])
            llm.generate([first], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
            warm = True
        params = SamplingParams(temperature=0.0, max_tokens=asked["max_new_tokens"])
        turns = [asdict(decode_one(llm, tokenizer, ids, params)) for ids in asked["prompts"]]
        print(json.dumps({"turns": turns}), flush=True)
    exit_child(llm)
