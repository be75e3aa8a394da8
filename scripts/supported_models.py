"""The README's supported-models table, from the architecture matrix the tests measure: runs
tests/test_every_architecture.py (every stage for every model_type, the slow end-to-end runs included) and
replaces the table between README.md's supported-models markers with the one the tests printed."""

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import transformers

REPO = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- supported-models:begin -->", "<!-- supported-models:end -->"
COMMAND = [sys.executable, "-m", "pytest", "-q", "-m", "slow or not slow", "tests/test_every_architecture.py"]


def main():
    with tempfile.TemporaryDirectory() as tmp:
        table = Path(tmp) / "matrix.md"
        done = subprocess.run(COMMAND, cwd=REPO, env={**os.environ, "EAGLE_MATRIX_MARKDOWN": str(table)})
        if done.returncode != 0 or not table.is_file():
            sys.exit(f"the matrix tests failed (exit {done.returncode}): the README keeps its table")
        lines = table.read_text()
    measured = (
        f"Measured by `python scripts/supported_models.py` (transformers {transformers.__version__}, "
        f"torch {torch.__version__}, CPU):\n\n"
    )
    readme = (REPO / "README.md").read_text()
    block = f"{BEGIN}\n{measured}{lines}{END}"
    updated, count = re.subn(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: block, readme, flags=re.S)
    if count != 1:
        sys.exit(f"README.md has no {BEGIN} ... {END} block")
    (REPO / "README.md").write_text(updated)
    print(lines)


if __name__ == "__main__":
    main()
