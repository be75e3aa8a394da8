#!/usr/bin/env bash
# The main job on the embedded default, sized for a CPU:
# SmolLM2-135M-Instruct answers ShareGPT first turns itself -> self-distilled hidden-state store with loss
# masks and draft vocab (configs/smollm2_sharegpt.yaml) -> a draft head (DRAFTER, configs/<drafter>_smollm2.yaml,
# cut to $STEPS steps) -> engine-exact export, checked -> acceptance-length table on MT-Bench, speculative against
# plain decoding and n-gram drafting.
#
# DRAFTER=eagle3 (default): an EAGLE-3 head trained with training-time test, drafting a chain of K=$K (default 1:
#   the K at which a head this small pays off on a CPU, where each draft step costs about a fifth of a target
#   step); it is trained for that K (ttt_length=K): steps beyond K are never drafted.
# DRAFTER=dflash | dspark: a block head (one forward gives 7 drafts with DFlash, 8 with DSpark at block_size 8),
#   exported in the z-lab (vLLM) or DeepSpec layout; the eval drafts the first K=$K of them (--parallel K,
#   default 1), the head trained for the whole block whatever K. DRAFTER=peagle: a P-EAGLE head (7 drafts a
#   forward), the same way.
# DRAFTER=draft_model: a draft model, SmolLM2's first 3 layers with its embedding, final norm and lm_head, distilled
#   on the same store, exported as the model directory engines serve as a standalone drafter (vLLM draft_model,
#   SGLang STANDALONE; llama.cpp -md after eagle-export --format gguf); the eval drafts a chain of K=$K (default 1).
#
# SCALE=smoke runs every step at toy size (a few conversations, steps and tokens) into runs/smoke:
# what CI runs to prove the job finishes, not a head worth measuring.
set -euo pipefail
cd "$(dirname "$0")/.."
DRAFTER=${DRAFTER:-eagle3}
# the method's drafting family and own export layout, from its row (eagle_train/methods/__init__.py)
read -r FAMILY LAYOUT < <(python -c 'import sys; from eagle_train.methods import METHODS as m; d = sys.argv[1]
print(m[d].family, m[d].layout) if d in m else sys.exit("DRAFTER=" + d + ": choose one of " + ", ".join(m))' "$DRAFTER")
case "$FAMILY" in
  chain) DRAFTING=(--chain "${K:-1}"); METHOD=(ttt_length="${K:-1}") ;;
  model) DRAFTING=(--chain "${K:-1}"); METHOD=() ;;   # a draft model's steps: K of them a round
  *) DRAFTING=(--parallel "${K:-1}"); METHOD=() ;;   # the first K of one forward's drafts
esac
if [ "${SCALE:-full}" = smoke ]; then
  RUN=runs/smoke; HEAD=runs/smoke/$DRAFTER
  PREP=(out_dir="$RUN" prep.num_conversations=6 prep.max_length=256 prep.distil.max_new_tokens=16 prep.vocab_fill.conversations=50)
  TRAIN=(tokens_per_batch=512 max_steps=2 warmup_steps=1 save_every=1)   # max_length: the store's, 256
  EVAL=(--num-prompts 1 --max-new-tokens 8)
else
  RUN=runs/smollm2_sharegpt; HEAD=runs/${DRAFTER}_smollm2   # the configs' out_dir and output_dir
  PREP=()
  TRAIN=(max_steps="${STEPS:-240}" save_every=40)
  EVAL=(--num-prompts 5 --max-new-tokens 64)
fi

eagle-prep run --config smollm2_sharegpt "${PREP[@]}"   # resumes a killed run; a finished one is kept
accelerate launch --num_processes 1 --num_cpu_threads_per_process "$(nproc)" --num_machines 1 --mixed_precision no \
    --dynamo_backend no -m eagle_cli.train --config "${DRAFTER}_smollm2" \
    data_path="$RUN/store" output_dir="$HEAD" resume=auto "${METHOD[@]}" "${TRAIN[@]}"
eagle-export "$HEAD/final" --format "$LAYOUT" --out "$HEAD/export" --target smollm2-135m
eagle-eval --target smollm2-135m --draft "$HEAD/export" --bench mt_bench "${DRAFTING[@]}" \
    --out "$HEAD/eval_mt_bench.json" "${EVAL[@]}"
