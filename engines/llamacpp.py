"""llama.cpp in the loop: the one place that knows how to build and run llama.cpp.

`build()` compiles llama-completion and llama-speculative-simple from the llama-cpp-python sdist,
whose vendor/llama.cpp is a pinned llama.cpp, into `<cache>/llamacpp/<version>/bin` once per
version; EAGLE_LLAMACPP_BIN points at another build's bin directory instead.

    eagle-llamacpp build            # prints the bin directory
    eagle-llamacpp where

`run_plain`, `run_head` and `run_ngram` decode one chat-templated prompt greedily and return what
llama.cpp measured. How its counters become forwards: every round of llama-speculative-simple runs
[last token, drafts...] through the target in one forward and adds the tokens it keeps (accepted
drafts + the target's own) to n_predict and the accepted drafts to n_accept, so
forwards = n_predict - n_accept. The prompt but its last token is decoded before the loop and
generates nothing; its last token rides in the first round. Plain decoding generates one token per
forward, the first from the prompt's. (Targets whose cache cannot drop rejected drafts, recurrent
ones, redo a partially accepted round from a checkpoint; llama.cpp does not count those redos.)
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from eagle_train.target import cache_dir

VERSION = "0.3.36"  # llama-cpp-python's sdist; its vendor/llama.cpp speaks draft-eagle3
TOOLS = ("llama-completion", "llama-speculative-simple")
CONVERTER = ("convert_hf_to_gguf.py", "conversion", "gguf-py")  # llama.cpp's own HF -> GGUF converter, kept beside bin/
CMAKE_FLAGS = (
    "-DGGML_NATIVE=ON",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DCMAKE_BUILD_RPATH_USE_ORIGIN=ON",  # the tools find their shared libraries next to them, wherever bin/ goes
)
BUILD_HINT = "eagle-llamacpp build"
LOG_TAIL = 15


class LlamaCppError(RuntimeError):
    pass


# ---- building ----------------------------------------------------------------------------------


def home(version: str = VERSION) -> Path:
    return cache_dir() / "llamacpp" / version


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
class Run:
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


def parse_speculative(stdout: str, stderr: str, prompt: str) -> Run:
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
    return Run(
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


def parse_completion(stdout: str, stderr: str) -> Run:
    """llama-completion's output (--no-display-prompt): the new text [+ " [end of text]\\n"] + "\\n\\n",
    its perf counters on stderr. Every eval run but the prompt's generates one token."""
    tool = "llama-completion"
    prompt_ms, prompt_tokens = counter(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens", stderr, tool)
    ms, runs = counter(r"common_perf_print:\s+eval time =\s*([\d.]+) ms /\s*(\d+) runs", stderr, tool)
    if not stdout.endswith("\n\n"):
        raise LlamaCppError(f"{tool}'s stdout was cut short: {stdout[-200:]!r}")
    tokens = int(runs) + 1
    text = stdout[:-2].removesuffix(" [end of text]\n")
    return Run(
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


def same_text(plain: Run, drafted: Run) -> bool:
    """Whether a speculative run wrote plain decoding's text: the same text if plain stopped at an
    end-of-generation token, else plain's text continued (speculative runs may overshoot by k tokens)."""
    return drafted.text == plain.text if plain.eos else drafted.text.startswith(plain.text)


def run_plain(target, prompt: str, n: int, threads: int | None = None) -> Run:
    """Plain greedy decoding of up to `n` new tokens (llama-completion)."""
    args = ["-m", target, "-n", n, "-no-cnv", "--no-display-prompt"]
    return parse_completion(*run_tool("llama-completion", args, prompt, threads))


def run_speculative(target, prompt: str, n: int, spec: list, threads: int | None) -> Run:
    """The loop stops once it has more than -n tokens and drafts no further than the budget left, except
    that a budget of 0 means unbounded: -n n-1 gives n to n+k tokens (fewer at an end-of-generation token)."""
    args = ["-m", target, "-n", n - 1, *spec]
    return parse_speculative(*run_tool("llama-speculative-simple", args, prompt, threads), prompt)


def run_head(target, head, prompt: str, n: int, k: int, threads: int | None = None) -> Run:
    """Speculative decoding with an EAGLE-3 head GGUF drafting chains of up to `k` tokens."""
    spec = ["-md", head, "--spec-type", "draft-eagle3", "--spec-draft-n-max", k]
    return run_speculative(target, prompt, n, spec, threads)


def run_ngram(target, prompt: str, n: int, k: int, threads: int | None = None) -> Run:
    """Speculative decoding without a head: the `k` tokens that followed the last n-gram's latest earlier
    occurrence (llama.cpp's ngram-simple). It drafts nothing when its draft length is below its lookup
    length, so that is min(k, 12), 12 its default."""
    spec = ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", min(k, 12), "--spec-ngram-simple-size-m", k]
    return run_speculative(target, prompt, n, spec, threads)


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


if __name__ == "__main__":
    sys.exit(main())
