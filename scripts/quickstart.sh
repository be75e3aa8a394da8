#!/usr/bin/env bash
# The main job on the embedded default, sized for a CPU (about 10 minutes on 2 cores):
# SmolLM2-135M-Instruct + ShareGPT -> tokens, loss masks, draft vocab, hidden-state store
# (configs/smollm2_sharegpt.yaml) -> EAGLE-3 head with training-time test (configs/eagle3_smollm2.yaml,
# cut to $STEPS steps) -> engine-exact export, checked -> acceptance-length table on MT-Bench.
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${STEPS:-30}
RUN=runs/smollm2_sharegpt   # the out_dir of configs/smollm2_sharegpt.yaml

[ -f "$RUN/store/manifest.json" ] || eagle-prep run --config configs/smollm2_sharegpt.yaml
accelerate launch --num_processes 1 --num_machines 1 --mixed_precision no --dynamo_backend no \
    scripts/train_eagle3.py --config configs/eagle3_smollm2.yaml output_dir=runs/eagle3_smollm2 \
    max_steps="$STEPS" warmup_steps=5 learning_rate=6e-4 save_every=10 resume=auto
eagle-export runs/eagle3_smollm2/final --format eagle3 --out runs/eagle3_smollm2/export --target smollm2-135m
eagle-eval --target smollm2-135m --draft runs/eagle3_smollm2/export --bench mt_bench --num-prompts 4 \
    --max-new-tokens 64 --chain 3 --out runs/eagle3_smollm2/eval_mt_bench.json
