"""llama.cpp's tools, built from the llama-cpp-python sdist, and `eagle-llamacpp`, the command that builds or
finds them (`main`); `LlamaCppError`, the error every llama.cpp module raises.

`build()` compiles llama-completion and llama-speculative-simple from the llama-cpp-python sdist,
whose vendor/llama.cpp is a pinned llama.cpp, into `<cache>/llamacpp/<version>-<flags>/bin` once per
version and set of build flags, and keeps llama.cpp's own HF -> GGUF converter beside it (`convert_target`);
EAGLE_LLAMACPP_BIN points at another build's bin directory instead.

    eagle-llamacpp build            # prints the bin directory
    eagle-llamacpp where
"""

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from eagle_train.target import cache_dir
from engines.engine import EngineError

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


def tail(stderr: str) -> str:
    """A tool's stderr cut to its last LOG_TAIL non-blank lines, for an error to quote."""
    return "\n".join([line for line in stderr.splitlines() if line.strip()][-LOG_TAIL:])


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
