#!/usr/bin/env bash
# The peers' own libraries, which the round-trip tests (tests/peers/) run as a child process: vllm-project's
# `speculators` 0.9.0 and z-lab's `dflash` 0.1.0, in .venv-peers, apart from the project's environment (each pins its
# own stack). torch 2.13.0 (the local CPU wheel) satisfies both and is installed first, so no CUDA torch comes in.
# speculators pulls torchvision and torchaudio built for CUDA torch, which break `import transformers` against the
# CPU one; neither peer imports them, so, as in scripts/install_vllm.sh, the ones that fail to import go.
# Idempotent: an existing .venv-peers holding the three pinned versions is kept as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv-peers/bin/python ] || python3 -m venv .venv-peers
PY=.venv-peers/bin/python
if ! "$PY" -c "from importlib.metadata import version as v
assert (v('torch'), v('speculators'), v('dflash')) == ('2.13.0+cpu', '0.9.0', '0.1.0')" 2>/dev/null; then
  "$PY" -m pip install -q torch==2.13.0
  "$PY" -m pip install -q speculators==0.9.0 'dflash[local]==0.1.0' torch==2.13.0
fi
for media in torchvision torchaudio; do
  if "$PY" -m pip show -q "$media" 2>/dev/null && ! "$PY" -c "import $media" 2>/dev/null; then
    "$PY" -m pip uninstall -y -q "$media"
  fi
done
"$PY" - <<'EOF'
import torch, transformers, speculators, dflash
from importlib.metadata import version
assert torch.version.cuda is None, f"a CUDA torch came in: {torch.__version__}"
from speculators import SpeculatorModel  # noqa: F401
from speculators.models.eagle3 import Eagle3DraftModel  # noqa: F401
from dflash.model import DFlashDraftModel  # noqa: F401
print("peers ready: torch", torch.__version__, "| transformers", transformers.__version__,
      "| speculators", version("speculators"), "| dflash", version("dflash"))
EOF
