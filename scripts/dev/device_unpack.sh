#!/usr/bin/env bash
# On the GPU machine: joins the two GGUF halves and installs the carried gguf wheel (see device_pack.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p /tmp/eg && cp .carry/part2/* /tmp/eg/
cat /tmp/eg/gguf.0 /tmp/eg/gguf.1 > /tmp/eg/SmolLM2-135M-Instruct.Q4_1.gguf
xz -dkf /tmp/eg/sharegpt.jsonl.xz
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/eg/site /tmp/eg/gguf-*.whl
echo "export PYTHONPATH=/tmp/eg/site:\$PWD"
