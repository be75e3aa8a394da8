"""The live engine check: a head run in a serving engine, compared with the built-in runtime.

Static rules say what an engine will load; they cannot see how it then drafts. A file the engine
loads but reads differently from the head (a vocab map shifted by one, fc fed the wrong target
layers) still decodes the right text, only without speed-up: the silent case. So the check
decodes a few MT-Bench first turns greedily in the engine and in the built-in runtime with the same
head and fails when the engine accepts far fewer drafts per forward. Each engine says how to get
it, what its file must hold (static findings naming the likely cause and the fix) and how to run
it; `ENGINES` holds them: llama.cpp (a GGUF) and vLLM (an export directory).

    report = check("llamacpp", "head.gguf", "smollm2-135m", source="runs/eagle3/final")
    report = check("vllm", "runs/eagle3/final", "smollm2-135m")     # exported to a temporary directory
    print(report.render())
    sys.exit(report.exit_code)   # 0 OK, 1 problems, 3 skipped (no engine here, or a head drafting nothing)
"""

import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType

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
    rules_stand: bool = False  # the engine is not installed and its rule check (findings) is the verdict

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


# ---- shared by the engines -------------------------------------------------------------------------


def builtin_pooled(head, model, tokenizer, prompts: list[list[int]], k: int, n: int) -> Pooled:
    """The built-in runtime's greedy chain-K decoding of the same prompts, AL counted as eagle-eval does."""
    from inference.drafting import TreeShape
    from inference.generate import Runtime
    from inference.sampling import Sampler

    eos = {tokenizer.eos_token_id, *np.atleast_1d(model.generation_config.eos_token_id or [])} - {None}
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
    engine: str,
    artifact,
    target: str,
    source=None,
    threads: int | None = None,
    prompts: int = PROMPTS,
    new_tokens: int = NEW_TOKENS,
    k: int = K,
) -> LiveReport:
    """Static findings on what `engine` would load for `artifact` (a head, or the engine's own file
    with `source` the head it should hold), then the live comparison on `prompts` MT-Bench first
    turns, unless the engine cannot run here (report.skipped says how to get it)."""
    from eagle_train.target import load_target
    from inference.evaluate import chat_ids, load_bench

    spec = ENGINES[engine]
    with tempfile.TemporaryDirectory() as tmp:
        file, source_head = spec.prepare(Path(artifact), target, source, Path(tmp))
        report = LiveReport(spec.title, f"{artifact} against {target}", spec.static(file, target, source_head))
        report.skipped = spec.missing()
        if report.skipped:
            report.rules_stand = spec.rules_stand
            return report
        model, tokenizer = load_target(target, device="cuda" if torch.cuda.is_available() else "cpu")
        if source_head is None:
            try:
                head = spec.read_back(file, model)
            except ValueError as e:
                report.skipped = f"the built-in runtime cannot run the file ({e})"
                return report
        else:
            head = source_head
            if not head.owns_embedding:
                head.use_target_embedding(model)
        questions = [p["turns"][0] for p in load_bench("mt_bench", prompts)]
        ids = [chat_ids(tokenizer, [{"role": "user", "content": q}]) for q in questions]
        try:
            measured, identical = spec.run(file, target, questions, k, new_tokens, threads)
        except EngineFailed as e:
            report.findings.append(Finding("error", f"{spec.name} fails with the file: {e}"))
            return report
        builtin = builtin_pooled(head, model, tokenizer, ids, k, new_tokens)
    report.engine_run, report.builtin_run = measured, builtin
    report.live = (
        f"{prompts} MT-Bench first turns x {new_tokens} new tokens, greedy, chain K={k}: {spec.name} {measured}, "
        f"built-in runtime ({REFERENCE[source_head is not None]}) {builtin}; "
        f"{spec.name}'s text equal to its plain decoding on {identical}/{prompts}"
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
    report.findings.append(verdict(spec.name, measured, builtin, causes, from_source))
    return report


# ---- llama.cpp -------------------------------------------------------------------------------------

# Largest |file - head| / max |head| a weight may show for its GGUF type: one rounding step of that
# type (f16 2^-11, bf16 2^-8, q8_0 a block's max / 254), doubled; coarser types are not compared.
TOLERANCE = {
    GGMLQuantizationType.F32: 1e-6,
    GGMLQuantizationType.F16: 1e-3,
    GGMLQuantizationType.BF16: 1e-2,
    GGMLQuantizationType.Q8_0: 1e-2,
}
REEXPORT = "re-export it: eagle-export HEAD --format gguf --out FILE.gguf --target {target}"


def llamacpp_missing() -> str:
    from engines import llamacpp

    try:
        found = llamacpp.tools_dir()
    except llamacpp.LlamaCppError as e:
        return str(e)
    return "" if found else f"no llama.cpp build: run `{llamacpp.BUILD_HINT}` (a few minutes, once), then check again"


def llamacpp_prepare(artifact: Path, target: str, source, tmp: Path):
    """(the GGUF llama.cpp loads, the head it should hold or None): a head is exported first."""
    from eagle_train.checkpoint import load_draft_head
    from eagle_train.export.gguf import export_gguf

    if artifact.suffix == ".gguf":
        if not artifact.is_file():
            raise FileNotFoundError(f"{artifact} does not exist")
        return artifact, load_draft_head(Path(source)) if source else None
    if source:
        raise ValueError("--source names the head a .gguf came from; a head directory is its own source")
    head = load_draft_head(artifact)
    return export_gguf(head, tmp / "head.gguf", target), head


def llamacpp_static(file: Path, target: str, source_head) -> list[Finding]:
    """What llama.cpp would read from `file` against the target's GGUF and, given a source head,
    against what export_gguf writes for it; errors name the likely cause and the fix."""
    from eagle_train.export.gguf import export_gguf, field_value, read_gguf, read_target

    head, tgt = read_gguf(file), read_target(target)
    arch = field_value(tgt.fields["general.architecture"]).decode()

    def target_key(name, default=None):
        found = tgt.fields.get(f"{arch}.{name}")
        return field_value(found) if found is not None else default

    findings = gguf_target_findings(
        head, target_key("rope.freq_base", 10000.0), target_key("block_count"), target_key("embedding_length")
    )
    findings += gguf_size_findings(head, tgt)
    if source_head is not None:
        with tempfile.TemporaryDirectory() as tmp:
            expected = read_gguf(export_gguf(source_head, Path(tmp) / "expected.gguf", target))
        findings += gguf_source_findings(head, expected, {f.cause for f in findings})
    for f in findings:
        if f.severity == "error":
            f.message += f"; {REEXPORT.format(target=target)}"
    return findings


def gguf_size_findings(head, tgt) -> list[Finding]:
    tokens = tgt.fields.get("tokenizer.ggml.tokens")
    n_vocab = len(tokens.data) if tokens is not None else 0
    findings = []
    if head.n_vocab != n_vocab:
        findings.append(
            Finding(
                "error",
                f"the file's tokenizer has {head.n_vocab} tokens, the target's {n_vocab}: made for another target",
            )
        )
    d2t, lm_head = head.tensors.get("d2t"), head.tensors.get("lm_head.weight")
    if d2t is None or lm_head is None:  # a full-vocabulary head: nothing to map
        return findings
    if head.types["d2t"] != GGMLQuantizationType.I64:
        findings.append(
            Finding("error", f"d2t is {head.types['d2t'].name}; llama.cpp asserts I64 (absolute target ids)")
        )
    if len(d2t) != len(lm_head):
        findings.append(
            Finding(
                "error", f"d2t has {len(d2t)} entries, output.weight {len(lm_head)} rows: llama.cpp refuses the file"
            )
        )
    if d2t.min() < 0 or d2t.max() >= head.n_vocab:
        findings.append(
            Finding(
                "error",
                f"d2t holds ids outside the target vocabulary [0, {head.n_vocab}): llama.cpp writes out of bounds",
            )
        )
    elif d2t.unique().numel() != d2t.numel():
        findings.append(
            Finding(
                "error",
                "d2t maps several draft ids to one target id: it looks like EAGLE's offsets (target id - draft id), "
                "llama.cpp wants absolute target ids",
                cause="d2t written as offsets",
            )
        )
    return findings


def gguf_target_findings(head, target_theta: float, n_layer: int, width: int) -> list[Finding]:
    keys, findings = head.keys, []
    theta = keys["rope.freq_base"]
    if not np.isclose(theta, target_theta, rtol=1e-6):
        findings.append(
            Finding(
                "error",
                f"eagle3.rope.freq_base is {theta:g}, the target's {target_theta:g}: llama.cpp rotates the draft's "
                "queries and keys at frequencies the head was not trained with (EAGLE-3 heads use the target's "
                "RoPE; a converter that leaves the key out gets llama.cpp's default 10000)",
                cause=f"a wrong RoPE base ({theta:g} instead of {target_theta:g})",
            )
        )
    layers = list(keys.get("target_layers", []))
    if len(layers) != 3:
        findings.append(Finding("error", f"eagle3.target_layers is {layers}: llama.cpp needs exactly three ids"))
    elif any(not 0 <= i <= n_layer for i in layers):
        findings.append(
            Finding(
                "error",
                f"eagle3.target_layers {layers} reaches outside the target's layer inputs 0..{n_layer} "
                f"(a {n_layer}-layer target; llama.cpp aborts): the head was made for another target",
                cause="target_layers of another target",
            )
        )
    elif layers != sorted(layers):
        findings.append(
            Finding(
                "warning",
                f"eagle3.target_layers {layers} is not in increasing order: EAGLE-3 heads read a low, a middle "
                "and a high layer in that order, so it may be reversed",
            )
        )
    for key in ("embedding_length", "target_hidden_size"):
        if keys.get(key) != width:
            findings.append(
                Finding(
                    "error",
                    f"eagle3.{key} is {keys.get(key)}, the target's embedding_length {width}: "
                    "made for another target (llama.cpp borrows the target's embeddings and layer inputs)",
                )
            )
    return findings


def gguf_source_findings(head, expected, covered: set[str]) -> list[Finding]:
    """Where the file differs from export_gguf's file for the source head; `covered` causes are not repeated."""
    findings = []
    for key in sorted(set(head.keys) | set(expected.keys)):
        got, want = head.keys.get(key), expected.keys.get(key)
        if key == "target_layers" and list(got or []) != list(want):
            findings.append(layers_finding(list(got or []), list(want), "llama.cpp", "eagle3.target_layers"))
        elif key == "rope.freq_base" and not np.isclose(got, want, rtol=1e-6):
            findings.append(
                Finding(
                    "error",
                    f"eagle3.rope.freq_base is {got:g}, the head was trained with {want:g}",
                    cause=f"a wrong RoPE base ({got:g} instead of {want:g})",
                )
            )
        elif key not in ("target_layers", "rope.freq_base") and got != want:
            findings.append(
                Finding(
                    "error", f"eagle3.{key} is {got}, export_gguf writes {want} for the source head", f"eagle3.{key}"
                )
            )
    missing = sorted(set(expected.tensors) - set(head.tensors))
    extra = sorted(set(head.foreign) - set(expected.foreign))
    if missing or extra:
        findings.append(Finding("error", f"the file lacks the tensors {missing} and holds {extra} besides"))
    for name in sorted(set(expected.tensors) & set(head.tensors)):
        got, want = head.tensors[name], expected.tensors[name]
        if got.shape != want.shape:
            findings.append(Finding("error", f"{name} is {list(got.shape)}, the source head's {list(want.shape)}"))
        elif name == "d2t":
            if not torch.equal(got, want):
                findings.append(d2t_finding(got, want, "llama.cpp"))
        elif head.types[name] in TOLERANCE:
            diff = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-12)
            if diff > TOLERANCE[head.types[name]]:
                findings.append(
                    Finding(
                        "error",
                        f"{name} differs from the source head's by {diff:.2g} of its largest value "
                        f"({head.types[name].name} allows {TOLERANCE[head.types[name]]:g}): the file holds another "
                        "head's weights, or Q/K rows not in llama.cpp's RoPE order",
                        cause="weights that are not the source head's",
                    )
                )
    return [f for f in findings if f.cause not in covered or not f.cause]


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


def llamacpp_read_back(file: Path, model):
    from eagle_train.export.gguf import import_gguf

    return import_gguf(file, model)


def llamacpp_run(file: Path, target: str, questions: list[str], k: int, n: int, threads: int | None):
    """(tokens per forward pooled over the prompts, how many speculative texts equal plain decoding's)."""
    from eagle_train.target import load_tokenizer, target_gguf
    from engines import llamacpp
    from inference.evaluate import chat_text

    tokenizer = load_tokenizer(target)
    texts = [chat_text(tokenizer, [{"role": "user", "content": q}]) for q in questions]
    try:
        runs = llamacpp.measure(target_gguf(target), file, texts, k, n, threads)
    except llamacpp.LlamaCppError as e:
        raise EngineFailed(str(e)) from e
    pooled = Pooled(sum(r["head"].tokens for r in runs), sum(r["head"].forwards for r in runs))
    return pooled, sum(r["identical"] for r in runs)


# ---- vLLM ------------------------------------------------------------------------------------------

VLLM_KEY = "eagle_aux_hidden_state_layer_ids"


def vllm_missing() -> str:
    from engines import vllm as vllm_engine

    return vllm_engine.missing()


def vllm_prepare(artifact: Path, target: str, source, tmp: Path):
    """(the directory vLLM loads, the head it should hold or None): a training checkpoint is exported first."""
    from eagle_train.checkpoint import load_draft_head
    from engines import vllm as vllm_engine

    directory, head = vllm_engine.export_dir(artifact, tmp)
    if head is None:
        return directory, load_draft_head(Path(source)) if source else None
    if source:
        raise ValueError("--source names the head an export came from; a training checkpoint is its own source")
    return directory, head


def vllm_static(directory: Path, target: str, source_head) -> list[Finding]:
    """The rule check of what vLLM loads from `directory` (engines.rules) and, given the
    source head, where the head vLLM would build differs from it."""
    from eagle_train.export import check_directory, import_head
    from eagle_train.target import load_target_config

    config = load_target_config(target)
    findings = list(check_directory(directory, ["vllm"], config)["vllm"].findings)
    if source_head is not None:
        covered = {f.cause for f in findings if f.cause}
        findings += [
            f
            for f in head_source_findings(import_head(directory, target_config=config), source_head, "vLLM")
            if f.cause not in covered
        ]
    return findings


def head_source_findings(file_head, source_head, engine: str) -> list[Finding]:
    """Where a head read from an engine's file differs from the head it was exported from."""
    got, want = file_head.config, source_head.config
    findings = []
    if list(got.aux_layer_ids) != list(want.aux_layer_ids):
        findings.append(layers_finding(list(got.aux_layer_ids), list(want.aux_layer_ids), engine, VLLM_KEY))
    if not np.isclose(got.rope_theta, want.rope_theta, rtol=1e-6):
        findings.append(
            Finding(
                "error",
                f"rope_theta is {got.rope_theta:g}, the head was trained with {want.rope_theta:g}",
                cause=f"a wrong RoPE base ({got.rope_theta:g} instead of {want.rope_theta:g})",
            )
        )
    mine, theirs = file_head.saved_state_dict(), source_head.saved_state_dict()
    if set(mine) != set(theirs) or any(mine[n].shape != theirs[n].shape for n in mine):
        return findings + [Finding("error", "the file holds another head's tensors or sizes than the source head")]
    arange = torch.arange(got.draft_vocab_size)
    if not torch.equal(mine["d2t"].cpu(), theirs["d2t"].cpu()):
        findings.append(d2t_finding(mine["d2t"].cpu() + arange, theirs["d2t"].cpu() + arange, engine))
    for name, t in theirs.items():
        if t.is_floating_point():
            diff = (mine[name].float().cpu() - t.float().cpu()).abs().max().item() / max(t.abs().max().item(), 1e-12)
            if diff > TOLERANCE[GGMLQuantizationType.BF16]:  # a bf16 export's rounding, doubled
                findings.append(
                    Finding(
                        "error",
                        f"{name} differs from the source head's by {diff:.2g} of its largest value: the file "
                        "holds another head's weights",
                        cause="weights that are not the source head's",
                    )
                )
                break
    return findings


def vllm_read_back(directory: Path, model):
    from eagle_train.export import import_head

    return import_head(directory, model)


def vllm_run(directory: Path, target: str, questions: list[str], k: int, n: int, threads: int | None):
    """(tokens per forward pooled over the prompts, how many speculative outputs equal plain decoding's)."""
    from engines import vllm as vllm_engine

    method = vllm_engine.method_of(directory)
    conversations = [[q] for q in questions]
    try:
        plain = vllm_engine.decode(target, conversations, n)
        spec = vllm_engine.decode(target, conversations, n, vllm_engine.speculative(method, directory, k))
    except vllm_engine.VllmError as e:
        raise EngineFailed(str(e)) from e
    turns = [(c[0], p[0]) for c, p in zip(spec.conversations, plain.conversations)]
    forwards = sum(len(vllm_engine.rounds(t)) for t, _ in turns)
    pooled = Pooled(forwards + sum(t.accepted for t, _ in turns), forwards)
    return pooled, sum(t.output_ids == p.output_ids for t, p in turns)


@dataclass(frozen=True)
class LiveEngine:
    name: str
    title: str
    missing: Callable  # () -> "" or why the engine cannot run here and how to get it
    prepare: Callable  # (artifact, target, source, tmp) -> (engine file, source head or None)
    static: Callable  # (file, target, source head) -> [Finding]
    read_back: Callable  # (file, target model) -> the head the file holds
    run: Callable  # (file, target, first-turn questions, k, n, threads) -> (Pooled, equal to plain); EngineFailed
    rules_stand: (
        bool  # without the engine installed, pass on the rule findings alone (never: a build is a command away)
    )


ENGINES = {
    "llamacpp": LiveEngine(
        "llama.cpp",
        "llama.cpp (--spec-type draft-eagle3)",
        llamacpp_missing,
        llamacpp_prepare,
        llamacpp_static,
        llamacpp_read_back,
        llamacpp_run,
        rules_stand=False,
    ),
    "vllm": LiveEngine(
        "vLLM",
        "vLLM (speculative_config method eagle3)",
        vllm_missing,
        vllm_prepare,
        vllm_static,
        vllm_read_back,
        vllm_run,
        rules_stand=True,
    ),
}
