"""The live engine check: a head run in a serving engine, compared with the built-in runtime.

Static rules say what an engine will load; they cannot see how it then drafts. A file the engine
loads but reads differently from the head (a vocab map shifted by one, fc fed the wrong target
layers) still decodes the right text, only without speed-up: the silent case. So the check
decodes a few MT-Bench first turns greedily in the engine and in the built-in runtime with the same
head and fails when the engine accepts far fewer drafts per forward. Each engine that runs here
says how to get it, what its file must hold (static findings naming the likely cause and the fix)
and how to run it (`Engine.prepare`, `static_findings`, `run_live`: llama.cpp a GGUF, vLLM an
export directory); this module is the driver they share and the findings both name.

    report = ENGINES["llamacpp"].check_live("head.gguf", "smollm2-135m", source="runs/eagle3/final")
    report = ENGINES["vllm"].check_live("runs/eagle3/final", "smollm2-135m")   # exported to a temporary directory
    print(report.render())
    sys.exit(report.exit_code)   # 0 OK, 1 problems, 3 skipped (no engine here, or a head drafting nothing)
"""

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eagle_train.methods import row
from eagle_train.target import end_of_turn_ids
from engines.rules import Finding

PROMPTS, NEW_TOKENS, K = 4, 32, 3  # a few seconds per runtime on a CPU
# "Far below": the engine's accepted drafts per forward under half the built-in runtime's. Measured
# with a trained SmolLM2 head (built-in 0.278) on these prompts and sizes: llama.cpp 0.287 on the f32
# target, 0.330 on the Q4_1 one (its quantized numerics), per prompt 0.19 to 0.39; the files it
# silently drafts badly with: 0.00 (d2t shifted by one), 0.07 (target_layers reversed).
FAR = 0.5
# Below this many accepted drafts per forward in the built-in runtime the head drafts (almost)
# nothing anyway, and a broken file cannot be told from an untrained head: the check says SKIPPED.
SILENT = 0.05
EXIT_CODES = {"OK": 0, "PROBLEMS": 1, "SKIPPED": 3}
REFERENCE = {True: "the source head", False: "the file read back"}  # what the built-in runtime runs


class EngineFailed(RuntimeError):
    """The engine refused the file or failed while decoding with it."""


@dataclass
class Pooled:
    """Tokens and the target forwards that produced them, over every prompt."""

    tokens: int
    forwards: int

    @property
    def per_forward(self) -> float:
        return self.tokens / self.forwards if self.forwards else 0.0

    @property
    def accepted(self) -> float:  # accepted drafts per forward: the head's share of the tokens
        return self.per_forward - 1 if self.forwards else 0.0

    def __str__(self) -> str:
        return f"{self.per_forward:.3f} tokens per forward ({self.tokens}/{self.forwards})"


@dataclass
class LiveReport:
    engine: str
    checked: str
    findings: list[Finding] = field(default_factory=list)
    live: str = ""  # what the live comparison measured ...
    engine_run: Pooled | None = None  # ... in the engine
    builtin_run: Pooled | None = None  # ... and in the built-in runtime
    skipped: str = ""  # why it did not run or cannot conclude
    rules_stand: bool = False  # the engine is not installed and its rule check (findings) is the verdict (exit 0)

    @property
    def status(self) -> str:
        if any(f.severity == "error" for f in self.findings):
            return "PROBLEMS"
        return "SKIPPED" if self.skipped else "OK"

    @property
    def exit_code(self) -> int:
        if self.status == "SKIPPED" and self.rules_stand:
            return EXIT_CODES["OK"]
        return EXIT_CODES[self.status]

    def render(self) -> str:
        lines = [f"== {self.engine}, {self.checked}: {self.status}"]
        if self.live:
            lines.append(f"  live: {self.live}")
        if self.skipped:
            lines.append(f"  SKIPPED (live): {self.skipped}")
        lines += [f"  {f.severity.upper()}: {f.message}" for f in self.findings]
        return "\n".join(lines)


# ---- the comparison, and the findings both engines name ------------------------------------------


def builtin_pooled(head, model, tokenizer, prompts: list[list[int]], k: int, n: int) -> Pooled:
    """The built-in runtime's greedy chain-K decoding of the same prompts, AL counted as eagle-eval does."""
    from inference.drafting import TreeShape
    from inference.generate import Runtime
    from inference.sampling import Sampler

    eos = end_of_turn_ids(model, tokenizer)
    head = head.to(device=model.device, dtype=model.dtype).eval()
    runtime = Runtime(model, head, TreeShape.chain(k), Sampler(0.0, 0, 1.0), eos_token_ids=eos, cuda_graphs=False)
    runs = [runtime.generate(ids, n) for ids in prompts]
    return Pooled(sum(sum(r.emitted) for r in runs), sum(r.forwards for r in runs))


def verdict(title: str, engine: Pooled, builtin: Pooled, causes: list[str], from_source: bool) -> Finding:
    """The engine against the built-in runtime, for a head that drafts something (see SILENT)."""
    reference = REFERENCE[from_source]
    figures = f"{engine.accepted:.3f} vs {builtin.accepted:.3f} accepted drafts per forward"
    if engine.accepted >= FAR * builtin.accepted:
        still = "; the errors above stand: the file is not what the head was trained with" if causes else ""
        return Finding("info", f"{title} drafts as well as the built-in runtime with {reference}: {figures}{still}")
    likely = (
        "; ".join(dict.fromkeys(causes))
        if causes
        else "something the engine reads differently from the head that the static rules above do not see "
        "(Q/K rows not in llama.cpp's RoPE order, weights of another head, a lossy --outtype)"
        + ("" if from_source else "; pass --source HEAD to compare the file with its head")
    )
    return Finding(
        "error",
        f"{title} loads the file but accepts far fewer drafts than the built-in runtime with {reference} "
        f"({figures}; under {FAR:.0%} of the built-in's is far): it decodes the right text without the "
        f"speed-up. Likely cause: {likely}",
    )


def check(
    engine,
    artifact,
    target: str,
    source=None,
    threads: int | None = None,
    prompts: int = PROMPTS,
    new_tokens: int = NEW_TOKENS,
    k: int = K,
) -> LiveReport:
    """Static findings on what `engine` (an Engine) would load for `artifact` (a head, or the engine's
    own file with `source` the head it should hold), then the live comparison on `prompts` MT-Bench
    first turns, unless the engine cannot run here (report.skipped says how to get it)."""
    from eagle_train.target import load_target
    from inference.evaluate import chat_ids, load_bench

    with tempfile.TemporaryDirectory() as tmp:
        file, source_head = engine.prepare(Path(artifact), target, source, Path(tmp))
        report = LiveReport(
            engine.live_title, f"{artifact} against {target}", engine.static_findings(file, target, source_head)
        )
        report.skipped = engine.missing()
        if report.skipped:
            return report
        model, tokenizer = load_target(target, device="cuda" if torch.cuda.is_available() else "cpu")
        if source_head is None:
            try:
                head = engine.read_back(file, model)
            except ValueError as e:
                report.skipped = f"the built-in runtime cannot run the file ({e})"
                return report
        else:
            head = source_head
            if not head.owns_embedding:
                head.use_target_weights(model)
        method = row(head.config.method)
        if method.family == "block":  # a block head drafts its whole block in every engine
            k = method.drafts(head.config)
        questions = [p["turns"][0] for p in load_bench("mt_bench", prompts)]
        ids = [chat_ids(tokenizer, [{"role": "user", "content": q}]) for q in questions]
        try:
            measured, identical = engine.run_live(file, target, questions, k, new_tokens, threads)
        except EngineFailed as e:
            report.findings.append(Finding("error", f"{engine.title} fails with the file: {e}"))
            return report
        builtin = builtin_pooled(head, model, tokenizer, ids, k, new_tokens)
    report.engine_run, report.builtin_run = measured, builtin
    drafting = "block" if row(head.config.method).family == "block" else "chain"
    report.live = (
        f"{prompts} MT-Bench first turns x {new_tokens} new tokens, greedy, {drafting} K={k}: "
        f"{engine.title} {measured}, "
        f"built-in runtime ({REFERENCE[source_head is not None]}) {builtin}; "
        f"{engine.title}'s text equal to its plain decoding on {identical}/{prompts}"
        + (
            " (batched verification numerics differ from one-token steps, e.g. on a quantized target)"
            if identical < prompts
            else ""
        )
    )
    from_source = source_head is not None
    if builtin.accepted < SILENT:
        report.skipped = (
            f"{REFERENCE[from_source]} accepts almost no drafts in the built-in runtime ({builtin.accepted:.3f} per "
            "forward), so the comparison cannot tell a broken file from an untrained head"
            + ("" if from_source else "; pass --source HEAD, the head the file came from")
        )
        return report
    causes = [f.cause for f in report.findings if f.severity == "error" and f.cause]
    report.findings.append(verdict(engine.title, measured, builtin, causes, from_source))
    return report


def layers_finding(got: list[int], want: list[int], engine: str, key: str) -> Finding:
    """`key` (the file's aux-layer setting) against the layers the head was trained on, for `engine`."""
    shift = {g - w for g, w in zip(got, want)} if len(got) == len(want) else set()
    if len(shift) == 1:
        (s,) = shift
        why = (
            f"every id {s:+d}: {engine} reads Hugging Face hidden_states indices (layer inputs, 0 = the embedding "
            "output), as eagle-train does"
            + ("; ours minus one is the SGLang / TensorRT-LLM convention" if s == -1 else "")
        )
    elif got == want[::-1]:
        why = "reversed: fc's input is the three layers in the head's order"
    else:
        why = "another head's layers"
    return Finding(
        "error",
        f"{key} is {got}, the head was trained on {want} ({why}): {engine} feeds fc other "
        "target layers than the head learned from",
        cause=f"wrong extract layers ({key} {got} instead of {want})",
    )


def d2t_finding(got: torch.Tensor, want: torch.Tensor, engine: str) -> Finding:
    """Name how the file's absolute ids differ from the head's: a constant shift, or offsets written raw."""
    diffs, counts = torch.unique(got - want, return_counts=True)
    top = diffs[counts.argmax()].item()
    if torch.equal(got, want - torch.arange(len(want))):
        what = "holds the head's offsets (target id - draft id) instead of absolute target ids"
        cause = "d2t written as offsets"
    elif top and counts.max().item() >= 0.99 * len(want):  # a shift, some ids clipped at the vocabulary's end
        what = f"is shifted by {top:+d} (draft id j proposes the target id next to the one the head predicts)"
        cause = f"d2t off by {top:+d}"
    else:
        what = f"differs from the head's vocab map at {(got != want).sum().item()} of {len(want)} draft ids"
        cause = "d2t of another vocab map"
    return Finding(
        "error",
        f"d2t {what}: {engine} maps the draft logits to d2t's ids, so the head proposes tokens it did "
        "not predict and (almost) none is accepted",
        cause=cause,
    )
