"""llama.cpp: the one place that knows how to build and run it, what it reads from a head GGUF, and
how it decodes a bench live (`LlamaCpp`, its entry in engines.ENGINES). It loads no export directory:
its file is the single GGUF `eagle_train.export.gguf.export_gguf` writes.

`build()` compiles llama-completion and llama-speculative-simple from the llama-cpp-python sdist,
whose vendor/llama.cpp is a pinned llama.cpp, into `<cache>/llamacpp/<version>/bin` once per
version; EAGLE_LLAMACPP_BIN points at another build's bin directory instead.

    eagle-llamacpp build            # prints the bin directory
    eagle-llamacpp where

`run_plain`, `run_head` and `run_ngram` decode one chat-templated prompt greedily and return what
llama.cpp measured; a head GGUF drafts as its file says (`drafting`): EAGLE-3 chains (draft-eagle3) or a
DFlash / DSpark block a round (draft-dflash, draft-dspark: K at most the block's drafts). The free types
(`free_types`: ngram-simple, ngram-map-k, ngram-mod, ngram-cache) draft without a head, and comma-separated
types combine (`hybrid_flags`): llama.cpp tries them in its own order, the n-gram types first, and a round
takes the first that drafts (common/speculative.cpp). How its
counters become forwards: every round of llama-speculative-simple runs
[last token, drafts...] through the target in one forward and adds the tokens it keeps (accepted
drafts + the target's own) to n_predict and the accepted drafts to n_accept, so
forwards = n_predict - n_accept. The prompt but its last token is decoded before the loop and
generates nothing; its last token rides in the first round. Plain decoding generates one token per
forward, the first from the prompt's. (Targets whose cache cannot drop rejected drafts, recurrent
ones, redo a partially accepted round from a checkpoint; llama.cpp does not count those redos.)
"""

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader

from eagle_train.checkpoint import GGUF, load_draft_head, locate_head
from eagle_train.export.gguf import BLOCK_ARCH, MASK_KEY, export_gguf, field_value, read_gguf, read_target
from eagle_train.target import cache_dir, load_tokenizer, target_gguf
from engines.engine import Engine, EngineError
from engines.live import EngineFailed, Pooled, d2t_finding, layers_finding
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

VERSION = "0.3.36"  # llama-cpp-python's sdist; its vendor/llama.cpp speaks draft-eagle3
TOOLS = ("llama-completion", "llama-speculative-simple")
CONVERTER = ("convert_hf_to_gguf.py", "conversion", "gguf-py")  # llama.cpp's own HF -> GGUF converter, kept beside bin/
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"  # AMX tiles need the kernel's leave (arch_prctl); VMs often
# withhold it, and a native build then dies with SIGILL at its first matmul
CMAKE_FLAGS = (
    "-DGGML_NATIVE=ON",
    f"-DCMAKE_C_FLAGS={NO_AMX}",
    f"-DCMAKE_CXX_FLAGS={NO_AMX}",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DCMAKE_BUILD_RPATH_USE_ORIGIN=ON",  # the tools find their shared libraries next to them, wherever bin/ goes
)
BUILD_HINT = "eagle-llamacpp build"
LOG_TAIL = 15


class LlamaCppError(EngineError):
    pass


# ---- building ----------------------------------------------------------------------------------


def home(version: str = VERSION) -> Path:
    """The build's cache directory, one per version and set of build flags (changed flags build anew)."""
    flags = hashlib.sha1(" ".join(CMAKE_FLAGS).encode()).hexdigest()[:8]
    return cache_dir() / "llamacpp" / f"{version}-{flags}"


def has_tools(directory: Path) -> bool:
    return all((directory / tool).is_file() for tool in TOOLS)


def tools_dir(version: str = VERSION) -> Path | None:
    """The bin directory to run: EAGLE_LLAMACPP_BIN, else a finished build in the cache, else None."""
    env = os.environ.get("EAGLE_LLAMACPP_BIN")
    if env:
        path = Path(env).expanduser()
        if not has_tools(path):
            raise LlamaCppError(f"EAGLE_LLAMACPP_BIN={env} does not hold {' and '.join(TOOLS)}")
        return path
    built = home(version) / "bin"
    return built if has_tools(built) else None


def converter_script(version: str = VERSION) -> Path | None:
    """llama.cpp's `convert_hf_to_gguf.py` kept by the build beside the tools' bin directory, or None.
    Run it with its `gguf-py` directory first on PYTHONPATH (it needs a newer gguf than PyPI's)."""
    found = tools_dir(version)
    script = found.parent / "convert" / CONVERTER[0] if found is not None else None
    return script if script is not None and script.is_file() else None


def convert_target(hf_dir, out_gguf, outtype: str = "f32") -> Path:
    """A Hugging Face model directory as a target GGUF, written by llama.cpp's own converter (a
    target is llama.cpp's format to know, not ours); kept, and reused, at `out_gguf`."""
    out = Path(out_gguf)
    if out.is_file():
        return out
    script = converter_script()
    if script is None:
        raise LlamaCppError(f"converting a target needs llama.cpp's converter: run `{BUILD_HINT}` first")
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    env = {**os.environ, "PYTHONPATH": str(script.parent / "gguf-py")}
    cmd = [sys.executable, script, hf_dir, "--outtype", outtype, "--outfile", partial]
    done = subprocess.run([str(c) for c in cmd], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise LlamaCppError(f"llama.cpp's converter failed on {hf_dir} (exit {done.returncode}):\n{tail(done.stderr)}")
    partial.rename(out)
    return out


def require_tools() -> Path:
    found = tools_dir()
    if found is None:
        raise LlamaCppError(
            f"no llama.cpp build found: run `{BUILD_HINT}` (a few minutes, once), "
            f"or set EAGLE_LLAMACPP_BIN to a bin directory holding {' and '.join(TOOLS)}"
        )
    return found


def check_toolchain() -> None:
    if shutil.which("cmake") is None:
        raise LlamaCppError("building llama.cpp needs cmake: pip install cmake (or apt-get install cmake)")
    if not (os.environ.get("CXX") or any(shutil.which(c) for c in ("c++", "g++", "clang++"))):
        raise LlamaCppError(
            "building llama.cpp needs a C++ compiler: apt-get install g++ (macOS: xcode-select --install), or set CXX"
        )


def step(cmd: list, log) -> None:
    """One build command, its output appended to the build log; a failure quotes the log's tail."""
    log.write(f"$ {' '.join(map(str, cmd))}\n")
    log.flush()
    done = subprocess.run([str(c) for c in cmd], stdout=log, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        log.flush()
        tail = "\n".join(Path(log.name).read_text(errors="replace").splitlines()[-LOG_TAIL:])
        raise LlamaCppError(
            f"`{' '.join(map(str, cmd[:3]))} ...` failed (exit {done.returncode}); {log.name} ends:\n{tail}"
        )


def extract_llamacpp(sdist: Path, dest: Path) -> Path:
    """vendor/llama.cpp out of the sdist; returns its directory."""
    with tarfile.open(sdist) as tar:
        # <top>/vendor/llama.cpp/..., not the git metadata the sdist also carries under .git/modules/vendor/
        members = [m for m in tar.getmembers() if m.name.split("/")[1:3] == ["vendor", "llama.cpp"]]
        if not members:
            raise LlamaCppError(f"{sdist.name} holds no vendor/llama.cpp")
        tar.extractall(dest, members=members, filter="data")
    return dest / members[0].name.split("/")[0] / "vendor" / "llama.cpp"


def build(version: str = VERSION, jobs: int | None = None) -> Path:
    """Build the tools of llama-cpp-python==`version` into the cache once; returns their bin directory.

    Everything happens in a private directory that becomes `bin/` by one rename when both tools
    exist, so an interrupted build is never taken for a finished one.
    """
    out = home(version)
    bin_dir = out / "bin"
    if has_tools(bin_dir):
        return bin_dir
    check_toolchain()
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".build-", dir=out))
    try:
        with open(out / "build.log", "w") as log:
            pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
            step([*pip, f"llama-cpp-python=={version}", "-d", work], log)
            sdists = list(work.glob("*.tar.gz"))
            if len(sdists) != 1:
                raise LlamaCppError(f"pip download left {len(sdists)} sdists in {work}, expected one")
            source = extract_llamacpp(sdists[0], work / "src")
            step(["cmake", "-S", source, "-B", work / "build", *CMAKE_FLAGS], log)
            step(["cmake", "--build", work / "build", "--target", *TOOLS, "-j", jobs or os.cpu_count() or 1], log)
        built = work / "build" / "bin"
        if not has_tools(built):
            raise LlamaCppError(f"the build finished without {' and '.join(TOOLS)} in {built}")
        shutil.rmtree(out / "convert", ignore_errors=True)
        (work / "convert").mkdir()
        for name in CONVERTER:
            (source / name).rename(work / "convert" / name)
        (work / "convert").rename(out / "convert")  # before bin/: a finished build always has its converter
        shutil.rmtree(bin_dir, ignore_errors=True)  # a bin/ without both tools is someone's leftover
        try:
            built.rename(bin_dir)
        except OSError:  # another build finished first; its tools are as good as ours
            if not has_tools(bin_dir):
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return bin_dir


# ---- running -----------------------------------------------------------------------------------


@dataclass
class LlamaCppRun:
    """One greedy decode of one prompt, as llama.cpp counted and timed it."""

    text: str  # the new text (an end-of-generation token is not printed)
    eos: bool | None  # stopped at an end-of-generation token (plain runs; llama-speculative-simple does not say)
    prompt_tokens: int  # the prompt as llama.cpp tokenized it
    tokens: int  # new tokens, an end-of-generation token included
    forwards: int  # target forwards that generated them
    drafted: int
    accepted: int
    decoded: int  # tokens generated inside llama.cpp's timed decode span ...
    seconds: float  # ... and its length (plain: eval time, the prompt's forward out; speculative: the whole loop)
    target_seconds: float  # all the target's forwards by its perf counters, the prompt's included

    @property
    def tokens_per_forward(self) -> float:
        return self.tokens / self.forwards if self.forwards else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.decoded / self.seconds if self.seconds else 0.0


def tail(stderr: str) -> str:
    return "\n".join([line for line in stderr.splitlines() if line.strip()][-LOG_TAIL:])


def counter(pattern: str, stderr: str, tool: str) -> tuple[str, ...]:
    match = re.search(pattern, stderr)
    if match is None:
        raise LlamaCppError(f"{tool} printed no {pattern!r} line; its stderr ends:\n{tail(stderr)}")
    return match.groups()


def parse_speculative(stdout: str, stderr: str, prompt: str) -> LlamaCppRun:
    """llama-speculative-simple's output: stdout = "\\n\\n" + prompt + new text + "\\n\\n\\n\\n", counters on stderr."""
    tool = "llama-speculative-simple"
    n_input, _ = counter(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds", stderr, tool)
    n_predict, seconds = counter(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", stderr, tool)
    (drafted,) = counter(r"n_drafted\s*=\s*(\d+)", stderr, tool)
    (accepted,) = counter(r"n_accept\s*=\s*(\d+)", stderr, tool)
    # the target context's perf lines (the draft's print empty): the prompt, then every verification
    batched_ms, _ = counter(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens", stderr, tool)
    single_ms, _ = counter(r"common_perf_print:\s+eval time =\s*([\d.]+) ms /\s*(\d+) runs", stderr, tool)
    if not stdout.endswith("\n\n\n\n"):
        raise LlamaCppError(f"{tool}'s stdout was cut short: {stdout[-200:]!r}")
    start = stdout.find(prompt)  # after "\n\n" and, for a target that adds one, the BOS token's text
    if start < 0:
        raise LlamaCppError(f"{tool} did not echo the prompt as given; its stdout begins {stdout[:200]!r}")
    tokens = int(n_predict)
    return LlamaCppRun(
        text=stdout[start + len(prompt) : -4],
        eos=None,
        prompt_tokens=int(n_input),
        tokens=tokens,
        forwards=tokens - int(accepted),
        drafted=int(drafted),
        accepted=int(accepted),
        decoded=tokens,
        seconds=float(seconds),
        target_seconds=(float(batched_ms) + float(single_ms)) / 1000,
    )


def parse_completion(stdout: str, stderr: str) -> LlamaCppRun:
    """llama-completion's output (--no-display-prompt): the new text [+ " [end of text]\\n"] + "\\n\\n",
    its perf counters on stderr. Every eval run but the prompt's generates one token."""
    tool = "llama-completion"
    prompt_ms, prompt_tokens = counter(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens", stderr, tool)
    ms, runs = counter(r"common_perf_print:\s+eval time =\s*([\d.]+) ms /\s*(\d+) runs", stderr, tool)
    if not stdout.endswith("\n\n"):
        raise LlamaCppError(f"{tool}'s stdout was cut short: {stdout[-200:]!r}")
    tokens = int(runs) + 1
    text = stdout[:-2].removesuffix(" [end of text]\n")
    return LlamaCppRun(
        text=text,
        eos=len(text) < len(stdout) - 2,
        prompt_tokens=int(prompt_tokens),
        tokens=tokens,
        forwards=tokens,
        drafted=0,
        accepted=0,
        decoded=int(runs),
        seconds=float(ms) / 1000,
        target_seconds=(float(prompt_ms) + float(ms)) / 1000,
    )


def run_tool(tool: str, args: list, prompt: str, threads: int | None) -> tuple[str, str]:
    """Run a tool on `prompt` (passed byte for byte: -bf, no escapes) greedily; returns (stdout, stderr)."""
    with tempfile.TemporaryDirectory() as tmp:
        prompt_file = Path(tmp) / "prompt.txt"
        prompt_file.write_bytes(prompt.encode())
        cmd = [require_tools() / tool, *args, "-bf", prompt_file, "--no-escape", "--temp", "0", "--color", "off"]
        if threads:
            cmd += ["-t", threads]
        done = subprocess.run([str(c) for c in cmd], capture_output=True)
    stdout, stderr = done.stdout.decode(errors="replace"), done.stderr.decode(errors="replace")
    if done.returncode != 0:
        raise LlamaCppError(f"{tool} failed (exit {done.returncode}); its stderr ends:\n{tail(stderr)}")
    return stdout, stderr


def same_text(plain: LlamaCppRun, drafted: LlamaCppRun) -> bool:
    """Whether a speculative run wrote plain decoding's text: the same text if plain stopped at an
    end-of-generation token, else plain's text continued (speculative runs may overshoot by k tokens)."""
    return drafted.text == plain.text if plain.eos else drafted.text.startswith(plain.text)


def run_plain(target, prompt: str, n: int, threads: int | None = None) -> LlamaCppRun:
    """Plain greedy decoding of up to `n` new tokens (llama-completion)."""
    args = ["-m", target, "-n", n, "-no-cnv", "--no-display-prompt"]
    return parse_completion(*run_tool("llama-completion", args, prompt, threads))


def run_speculative(target, prompt: str, n: int, spec: list, threads: int | None) -> LlamaCppRun:
    """The loop stops once it has more than -n tokens and drafts no further than the budget left, except
    that a budget of 0 means unbounded: -n n-1 gives n to n+k tokens (fewer at an end-of-generation token)."""
    args = ["-m", target, "-n", n - 1, *spec]
    return parse_speculative(*run_tool("llama-speculative-simple", args, prompt, threads), prompt)


@dataclass
class Drafting:
    """How llama-speculative-simple drafts with a head GGUF: its --spec-type and the most drafts a round."""

    spec_type: str
    max_drafts: int | None  # a block head's drafts per block (None: EAGLE-3 chains of any length)

    def flags(self, k: int) -> list:
        return ["--spec-type", self.spec_type, "--spec-draft-n-max", min(k, self.max_drafts or k)]


def drafting(head) -> Drafting:
    """What the file says it is: a dflash file drafts as draft-dspark where it has the Markov head or drafts
    from the anchor's slot (llama.cpp's default for DSpark when the key is absent), up to block_size drafts,
    else as draft-dflash, up to block_size - 1 (the anchor's slot drafts nothing). A file that does not read
    as a GGUF goes as draft-eagle3, and llama.cpp says why it cannot load it."""
    try:
        reader = GGUFReader(head)
        arch = field_value(reader.fields["general.architecture"]).decode()
    except (OSError, ValueError, KeyError, IndexError):
        return Drafting("draft-eagle3", None)
    if arch != BLOCK_ARCH:
        return Drafting("draft-eagle3", None)

    def key(name, default):
        found = reader.fields.get(f"{BLOCK_ARCH}.{name}")
        return field_value(found) if found is not None else default

    markov = any(t.name == "markov_w1.weight" for t in reader.tensors)
    block_size, from_anchor = key("block_size", 16), key("sample_from_anchor", markov)
    if markov or from_anchor:
        return Drafting("draft-dspark", block_size if from_anchor else block_size - 1)
    return Drafting("draft-dflash", block_size - 1)


def head_flags(head, k: int) -> list:
    """A head GGUF drafting up to `k` tokens a round (`drafting`: EAGLE-3 chains, or a DFlash or DSpark block,
    `k` clamped to its drafts per block)."""
    return ["-md", head, *drafting(head).flags(k)]


def run_head(target, head, prompt: str, n: int, k: int, threads: int | None = None) -> LlamaCppRun:
    """Speculative decoding with a head GGUF (`head_flags`)."""
    return run_speculative(target, prompt, n, head_flags(head, k), threads)


NGRAM_KEY = 2  # the n-gram types' lookup length at their best here (docs/performance.md); their defaults, 12 to 24,
# rarely fire on a chat turn


def ngram_key(k: int) -> int:
    """ngram-simple drafts nothing when its draft length is below its lookup length: the key is at most K."""
    return min(k, NGRAM_KEY)


def ngram_simple_flags(k: int) -> list:
    """ngram-simple: the `k` tokens that followed the last n-gram's latest earlier occurrence, the n-gram
    `ngram_key(k)` tokens long."""
    return ["--spec-ngram-simple-size-n", ngram_key(k), "--spec-ngram-simple-size-m", k]


def free_types(k: int) -> dict[str, list]:
    """llama.cpp's drafting types that need no head, by the bench loop's drafter names, each with the flags that
    make it draft up to `k` tokens after a short key (ngram-cache takes no length: llama.cpp drafts up to 8)."""
    key = ngram_key(k)
    return {
        "ngram": ["--spec-type", "ngram-simple", *ngram_simple_flags(k)],
        "ngram-map-k": ["--spec-type", "ngram-map-k", "--spec-ngram-map-k-size-n", key, "--spec-ngram-map-k-size-m", k],
        "ngram-mod": [
            "--spec-type", "ngram-mod", "--spec-ngram-mod-n-match", key, "--spec-ngram-mod-n-min", 1,
            "--spec-ngram-mod-n-max", k,
        ],
        "ngram-cache": ["--spec-type", "ngram-cache"],
    }  # fmt: skip


def hybrid_flags(head, k: int) -> list:
    """Head + n-gram: `--spec-type ngram-simple,<the head's type>`; llama.cpp drafts by ngram-simple where it
    finds a draft, else by the head."""
    found = drafting(head)
    return [
        "-md", head, "--spec-type", f"ngram-simple,{found.spec_type}", *ngram_simple_flags(k),
        "--spec-draft-n-max", min(k, found.max_drafts or k),
    ]  # fmt: skip


def run_ngram(target, prompt: str, n: int, k: int, threads: int | None = None) -> LlamaCppRun:
    """Speculative decoding without a head by ngram-simple (`ngram_simple_flags`), up to `k` drafts."""
    return run_speculative(target, prompt, n, free_types(k)["ngram"], threads)


def measure(target_gguf, head_gguf, prompts_text: list[str], k: int, n: int, threads: int | None = None) -> list:
    """Per templated prompt: the head's tokens per forward in llama.cpp and whether its greedy text is
    plain decoding's (what a live check of an exported head needs)."""
    results = []
    for prompt in prompts_text:
        plain = run_plain(target_gguf, prompt, n, threads)
        head = run_head(target_gguf, head_gguf, prompt, n, k, threads)
        results.append(
            {
                "tokens_per_forward": head.tokens_per_forward,
                "identical": same_text(plain, head),
                "plain": plain,
                "head": head,
            }
        )
    return results


# ---- what llama.cpp reads from a head GGUF ---------------------------------------------------------

# Largest |file - head| / max |head| a weight may show for its GGUF type: one rounding step of that
# type (f16 2^-11, bf16 2^-8, q8_0 a block's max / 254), doubled; coarser types are not compared.
TOLERANCE = {
    GGMLQuantizationType.F32: 1e-6,
    GGMLQuantizationType.F16: 1e-3,
    GGMLQuantizationType.BF16: 1e-2,
    GGMLQuantizationType.Q8_0: 1e-2,
}
REEXPORT = "re-export it: eagle-export HEAD --format gguf --out FILE.gguf --target {target}"
# The target architectures (general.architecture) whose llama.cpp graph exposes its layer inputs (res->t_layer_inp,
# src/models/*.cpp of llama-cpp-python VERSION's vendor/llama.cpp), which EAGLE-3 and DFlash / DSpark drafting read
# through llama_set_embeddings_layer_inp; on any other target llama.cpp aborts ("layer input tensor is null").
LAYER_INPUT_ARCHS = frozenset(
    {
        "bailingmoe3", "deepseek4", "gemma4", "gpt-oss", "hunyuan_vl", "lfm2", "llama", "mimo2", "minimax-01",
        "minimax-m2", "muse-glimmer", "nanbeige", "nemotron_h", "qwen3", "qwen35", "qwen35moe", "qwen3moe",
        "qwen3next", "qwen4exp",
    }
)  # fmt: skip


def target_arch_finding(target_arch: str, head_arch: str) -> list[Finding]:
    """llama.cpp drafts from a target's layer inputs only where its graph for the target exposes them."""
    if target_arch in LAYER_INPUT_ARCHS:
        return []
    kind = "DFlash / DSpark" if head_arch == BLOCK_ARCH else "EAGLE-3"
    return [
        Finding(
            "error",
            f"llama.cpp {VERSION} drafts no {kind} head on a {target_arch!r} target: its graph for that architecture "
            "exposes no layer inputs (it aborts with 'layer input tensor is null'); evaluate the head with the "
            "built-in runtime (eagle-eval --engine builtin) or serve it with another engine",
            f"a target llama.cpp drafts no {kind} head on ({target_arch})",
        )
    ]


def static_findings(file: Path, target: str, source_head) -> list[Finding]:
    """What llama.cpp would read from `file` against the target's GGUF and, given a source head,
    against what export_gguf writes for it; errors name the likely cause and the fix."""
    head, tgt = read_gguf(file), read_target(target)
    arch = field_value(tgt.fields["general.architecture"]).decode()

    def target_key(name, default=None):
        found = tgt.fields.get(f"{arch}.{name}")
        return field_value(found) if found is not None else default

    findings = gguf_target_findings(
        head, target_key("rope.freq_base", 10000.0), target_key("block_count"), target_key("embedding_length")
    )
    findings += gguf_size_findings(head, tgt)
    if head.arch == BLOCK_ARCH:
        findings += block_findings(head)
    if source_head is not None:
        with tempfile.TemporaryDirectory() as tmp:
            expected = read_gguf(export_gguf(source_head, Path(tmp) / "expected.gguf", target))
        findings += gguf_source_findings(head, expected, {f.cause for f in findings})
    for f in findings:
        if f.severity == "error":
            f.message += f"; {REEXPORT.format(target=target)}"
    return target_arch_finding(arch, head.arch) + findings


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
    keys, findings, arch = head.keys, [], head.arch
    theta = keys["rope.freq_base"]
    if not np.isclose(theta, target_theta, rtol=1e-6):
        findings.append(
            Finding(
                "error",
                f"{arch}.rope.freq_base is {theta:g}, the target's {target_theta:g}: llama.cpp rotates the draft's "
                "queries and keys at frequencies the head was not trained with (our heads use the target's "
                "RoPE; a converter that leaves the key out gets llama.cpp's default 10000)",
                cause=f"a wrong RoPE base ({theta:g} instead of {target_theta:g})",
            )
        )
    layers = list(keys.get("target_layers", []))
    fc = head.tensors.get("fc.weight")
    if arch != BLOCK_ARCH and len(layers) != 3:
        findings.append(Finding("error", f"eagle3.target_layers is {layers}: llama.cpp needs exactly three ids"))
    elif arch == BLOCK_ARCH and (fc is None or fc.shape[1] != len(layers) * keys.get("embedding_length", 0)):
        findings.append(
            Finding(
                "error",
                f"dflash.target_layers {layers} gives fc {len(layers)} x {keys.get('embedding_length')} inputs, "
                f"fc.weight takes {None if fc is None else fc.shape[1]}: llama.cpp refuses the file",
            )
        )
    elif any(not 0 <= i <= n_layer for i in layers):
        findings.append(
            Finding(
                "error",
                f"{arch}.target_layers {layers} reaches outside the target's layer inputs 0..{n_layer} "
                f"(a {n_layer}-layer target; llama.cpp aborts): the head was made for another target",
                cause="target_layers of another target",
            )
        )
    elif layers != sorted(layers):
        findings.append(
            Finding(
                "warning",
                f"{arch}.target_layers {layers} is not in increasing order: our heads read their layers from low "
                "to high, so it may be reversed",
            )
        )
    widths = ("embedding_length", "target_hidden_size") if arch != BLOCK_ARCH else ("embedding_length",)
    for key in widths:
        if keys.get(key) != width:
            findings.append(
                Finding(
                    "error",
                    f"{arch}.{key} is {keys.get(key)}, the target's embedding_length {width}: "
                    "made for another target (llama.cpp reads the target's layer inputs at the draft's width"
                    + (" and borrows the target's embeddings)" if arch != BLOCK_ARCH else ")"),
                )
            )
    return findings


def block_findings(head) -> list[Finding]:
    """What llama.cpp's dflash loader and drafting need of a block head's file beyond the target's sizes."""
    keys, tensors, findings = head.keys, head.tensors, []
    if keys.get("block_size", 0) < 2:
        findings.append(
            Finding(
                "error",
                f"dflash.block_size is {keys.get('block_size')}: llama.cpp drafts block_size - 1 tokens a block "
                "(DSpark's Markov head asserts the key)",
            )
        )
    mask = head.mask_token_id
    if mask is None or not 0 <= mask < head.n_vocab:
        findings.append(
            Finding(
                "error",
                f"{MASK_KEY} is {mask}: llama.cpp embeds the block's masks by this token's row of token_embd, "
                f"so it must be a token of the {head.n_vocab}-token vocabulary",
            )
        )
    elif "embed_tokens.weight" not in tensors:
        findings.append(
            Finding(
                "warning",
                "the file has no token_embd.weight: llama.cpp embeds the masks by the target's row "
                f"{mask}, not the head's learnt mask embedding",
                cause="no mask embedding",
            )
        )
    norms = [f"layers.{i}.self_attn.{n}_norm.weight" for i in range(keys.get("block_count", 0)) for n in "qk"]
    absent = [n for n in norms if n not in tensors]
    if absent:
        findings.append(Finding("error", f"the file lacks {absent}: llama.cpp's dflash loader requires them"))
    w1, w2 = tensors.get("markov_head.markov_w1"), tensors.get("markov_head.markov_w2")
    lm_head = tensors.get("lm_head.weight")
    if (w1 is None) != (w2 is None):
        findings.append(Finding("error", "the file holds one of markov_w1 and markov_w2: llama.cpp needs both"))
    elif w1 is not None:
        rank = w1.shape[1]
        want = {"markov_w1": [head.n_vocab, rank], "markov_w2": [len(lm_head) if lm_head is not None else 0, rank]}
        for name, got in (("markov_w1", w1), ("markov_w2", w2)):
            if list(got.shape) != want[name]:
                findings.append(Finding("error", f"{name} is {list(got.shape)}, llama.cpp's loader wants {want[name]}"))
        conf = tensors.get("confidence_head.proj.weight")
        if conf is not None and list(conf.shape) != [1, keys["embedding_length"] + rank]:
            findings.append(
                Finding(
                    "error",
                    f"conf_proj.weight is {list(conf.shape)}, llama.cpp reads [hidden state; markov_w1 row]: "
                    f"[1, {keys['embedding_length'] + rank}]",
                )
            )
    return findings


def gguf_source_findings(head, expected, covered: set[str]) -> list[Finding]:
    """Where the file differs from export_gguf's file for the source head; `covered` causes are not repeated."""
    if head.arch != expected.arch:
        return [
            Finding("error", f"the file is a {head.arch!r} draft, export_gguf writes the head as {expected.arch!r}")
        ]
    findings = []
    if head.mask_token_id != expected.mask_token_id:
        findings.append(
            Finding("error", f"{MASK_KEY} is {head.mask_token_id}, the head's mask token is {expected.mask_token_id}")
        )
    for key in sorted(set(head.keys) | set(expected.keys)):
        got, want = head.keys.get(key), expected.keys.get(key)
        if key == "target_layers" and list(got or []) != list(want):
            findings.append(layers_finding(list(got or []), list(want), "llama.cpp", f"{head.arch}.target_layers"))
        elif key == "rope.freq_base" and not np.isclose(got, want, rtol=1e-6):
            findings.append(
                Finding(
                    "error",
                    f"{head.arch}.rope.freq_base is {got:g}, the head was trained with {want:g}",
                    cause=f"a wrong RoPE base ({got:g} instead of {want:g})",
                )
            )
        elif key not in ("target_layers", "rope.freq_base") and got != want:
            findings.append(
                Finding(
                    "error",
                    f"{head.arch}.{key} is {got}, export_gguf writes {want} for the source head",
                    f"{head.arch}.{key}",
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


# ---- the engine ----------------------------------------------------------------------------------


def head_gguf(draft, target, out: Path):
    """(the GGUF llama.cpp loads for `draft`, the head exported into it or None): a .gguf is used as it
    is, a training checkpoint or head directory is exported to `out` against the target's GGUF."""
    found = locate_head(draft)
    if found.kind == GGUF:
        return found.path, None
    head = load_draft_head(found.path)
    return export_gguf(head, out, target), head


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

        labels = {
            "spec": ("head", "head"),
            "ngram": (f"n-gram (free, ngram-simple key {ngram_key(self.k)})", "free"),
            "ngram-map-k": (f"n-gram (free, ngram-map-k key {ngram_key(self.k)})", "free"),
            "ngram-mod": (f"n-gram (free, ngram-mod key {ngram_key(self.k)})", "free"),
            "ngram-cache": ("n-gram (free, ngram-cache)", "free"),
            "hybrid": ("head + n-gram", "hybrid"),
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


# ---- eagle-llamacpp ----------------------------------------------------------------------------


def main(argv=None):
    p = argparse.ArgumentParser(
        prog="eagle-llamacpp", description="build or locate the llama.cpp tools eagle-eval runs"
    )
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="fetch llama-cpp-python's sdist and build its llama.cpp tools (once per version)")
    b.add_argument("--version", default=VERSION, help=f"llama-cpp-python version (default {VERSION})")
    b.add_argument("--jobs", type=int, default=None, help="parallel compile jobs (default: all cores)")
    sub.add_parser("where", help="print the bin directory eagle-eval --engine llamacpp runs")
    args = p.parse_args(argv)
    try:
        if args.command == "build":
            print(build(args.version, args.jobs))
            return 0
        found = tools_dir()
    except LlamaCppError as e:
        raise SystemExit(f"eagle-llamacpp: error: {e}") from e
    if found is None:
        raise SystemExit(f"no llama.cpp build found; build one with: {BUILD_HINT}")
    print(found)
    return 0
