#!/usr/bin/env bash
# The peers' own libraries, for checking that heads go in and out of them: vllm-project's `speculators` 0.9.0
# (EAGLE-3, DFlash, DSpark as SpeculatorModel checkpoints) and z-lab's `dflash` 0.1.0 (DFlashDraftModel, with its
# `local` extra: torch and transformers). Each pins its own stack (dflash: torch==2.13.0 and transformers==5.15.0;
# speculators: torch<=2.14.1, transformers<=5.19.0, datasets<=5.1.0, tqdm<=4.70.1, torchvision, torchaudio,
# hs-connectors, openai...), which the project's environment must not take on, so they live in their own venv,
# .venv-peers at the repo root; tests/peers/peer_child.py runs in it as a child process and speaks JSON and
# safetensors files with the project. Both coexist: torch 2.13.0 satisfies both pins, and it is the CPU build
# (`pip install torch==2.13.0` resolves to the local 2.13.0+cpu wheel, as in the project's own envs) installed first,
# so neither library's resolution pulls a CUDA torch. speculators requires torchvision and torchaudio, whose PyPI
# wheels are built for CUDA torch: against the CPU one they fail at import ("operator torchvision::nms does not
# exist"), and transformers imports torchvision whenever it is installed, so `from transformers import
# PreTrainedModel` breaks. Neither peer's code imports them, so, as scripts/install_vllm.sh does, the ones that fail
# go (pip check then names them as missing requirements of speculators, which is expected).
# Idempotent: an existing .venv-peers is reused, and pip runs only when it lacks one of the three pinned versions.
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
