"""The peers' own code on our files: `peer_child.py` in their environment (.venv-peers, scripts/install_peers.sh, or
the python EAGLE_PEERS_PYTHON names), one child per test process that answers every request (its imports of the
libraries take seconds: paid once, not per request)."""

import atexit
import json
import os
import subprocess
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).with_name("peer_child.py")
_child: subprocess.Popen | None = None


def peer_python() -> str | None:
    """The python of the peers' environment, when it is installed."""
    path = os.environ.get("EAGLE_PEERS_PYTHON") or str(REPO / ".venv-peers" / "bin" / "python")
    return path if Path(path).is_file() else None


def child(python: str) -> subprocess.Popen:
    """The running child, started (again, if the last one died) when needed."""
    global _child
    if _child is None or _child.poll() is not None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ""}
        log = tempfile.TemporaryFile("w+")  # its stderr: the libraries' prints and a crash's traceback
        _child = subprocess.Popen(
            [python, str(CHILD)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env, text=True
        )
        _child.log = log
        atexit.register(_child.kill)
    return _child


def run_peer(request: dict) -> dict:
    """The child's answer to `request` (its docstring lists the ops); the test fails with the peer's own error when
    it fails, and skips when the peers' environment is not installed."""
    python = peer_python()
    if python is None:
        pytest.skip("the peers' libraries (speculators, z-lab dflash) are not installed: bash scripts/install_peers.sh")
    peer = child(python)
    peer.stdin.write(json.dumps(request) + "\n")
    peer.stdin.flush()
    answer = peer.stdout.readline()
    if not answer:
        peer.wait()
        peer.log.seek(0)
        pytest.fail(f"the peers' child died (exit {peer.returncode}):\n{peer.log.read()[-4000:]}")
    result = json.loads(answer)
    assert result["ok"], f"{request['op']} in the peers' library failed: {result.get('error')}"
    return result
