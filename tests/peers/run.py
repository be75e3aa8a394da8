"""The peers' own code on our files: `peer_child.py` in their environment (.venv-peers, scripts/install_peers.sh, or
the python EAGLE_PEERS_PYTHON names), one child process per request."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).with_name("peer_child.py")


def peer_python() -> str | None:
    """The python of the peers' environment, when it is installed."""
    path = os.environ.get("EAGLE_PEERS_PYTHON") or str(REPO / ".venv-peers" / "bin" / "python")
    return path if Path(path).is_file() else None


def run_peer(request: dict, tmp: Path) -> dict:
    """The child's result for `request` (its docstring lists the ops); the test fails with the peer's own error when
    it fails, and skips when the peers' environment is not installed."""
    python = peer_python()
    if python is None:
        pytest.skip("the peers' libraries (speculators, z-lab dflash) are not installed: bash scripts/install_peers.sh")
    tmp.mkdir(parents=True, exist_ok=True)
    ask, answer = tmp / "request.json", tmp / "result.json"
    ask.write_text(json.dumps(request))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ""}
    done = subprocess.run([python, str(CHILD), str(ask), str(answer)], env=env, capture_output=True, text=True)
    if not answer.is_file():
        sys.stderr.write(done.stderr[-4000:])
        pytest.fail(f"the peers' child wrote no result (exit {done.returncode})")
    result = json.loads(answer.read_text())
    assert result["ok"], f"{request['op']} in the peers' library failed: {result.get('error')}"
    return result
