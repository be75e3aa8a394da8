#!/usr/bin/env bash
# The whole SmolLM2-135M-Instruct pipeline on one H100, in two stages that each fit a 10-minute
# device call (docs/performance.md has the figures and the reasons for the choices):
#
#   kernels: environment, HBM bandwidth, matmul peak, the TTT loss kernels (needs neither model nor data).
#   stage1: unpack the carried GGUF + ShareGPT, dequantise the GGUF, let SmolLM2 answer NUM_CONV
#           ShareGPT first turns itself (batched greedy, the same forwards captured into an fp8 store:
#           self-distilled data), tokenize a few conversations for the benchmark, then train EAGLE-3
#           and P-EAGLE offline on the store, side by side on the one GPU (neither saturates an H100 alone).
#   stage2: export both heads (+ the engines' checks), scripts/bench/gpu.py (decoding on the three
#           benches for every drafting shape, capture, training MFU), eagle-eval on mt_bench /
#           humaneval / gsm8k for as many shapes as the stage's time allows.
#   objectives (instead of stage1 + stage2): stage1's data, then EAGLE-3 once per training objective
#           (scripts/bench/quality.py's RECIPES) side by side for the same steps, compared held out and on
#           the three benches (call 2 of the list below, NUM_CONV sized to leave the training its time).
#   curve (instead of stage1 + stage2): the time-to-quality curve on the GPU in one call: scripts/bench/quality.py
#           makes the data (NUM_CONV first turns) and trains EAGLE-3 under CURVE_BUDGET minutes of compute (data +
#           training), evaluating the newest checkpoint every CURVE_EVERY minutes (built-in runtime on CURVE_PROMPTS
#           prompts per bench, the chain walk over 20); then the last head's walk at K = 3, 5, 7 and the head
#           exported for the CPU engines (tarred and cut in 16 MB parts: the device tool returns files <= 16 MiB).
#   oracle: the runtime with oracle drafts (scripts/bench/oracle.py: the target's own continuation, each draft wrong
#           with probability p), free and at the cost of each method's head, chains K = 1..7, on SmolLM2 (the
#           carried GGUF) and on a random-weight Llama of 8B shape (ORACLE_PROMPTS prompts x 128 tokens each).
#           Needs the GGUF only (call 1's part1, then this call with part2); the 8B part is left out at SCALE=tiny.
#
# Device calls (the working tree travels with each; /tmp/eg survives between calls while the
# machine stays warm):
#   1. carry .carry/part1:  mkdir -p /tmp/eg && cp .carry/part1/* /tmp/eg/ && bash scripts/dev/gpu_recipe.sh kernels
#   2. carry .carry/part2:  bash scripts/dev/gpu_recipe.sh stage1
#   3.                      bash scripts/dev/gpu_recipe.sh stage2
# (the oracle stage: call 1, then carry .carry/part2 with `bash scripts/dev/gpu_recipe.sh oracle`)
# Everything is written under $RUNS (default /tmp/eg/runs); summaries, logs and metrics are copied
# to $OUT (at most 8 files come back). A stage is resumable: finished steps are skipped on rerun.
#
# Knobs (environment): SCALE=tiny runs every command line at toy size on a CPU (a dry run);
# STAGE_SECONDS (default 540) is the wall-clock budget of a stage: training stops in time for what
# follows it (the newest checkpoint is then used); DISTIL_SECONDS (default 240) bounds the data step;
# EVAL_PROMPTS, EVAL_TOKENS, NUM_CONV, DISTIL_BATCH override sizes. The objectives stage: OBJECTIVES (default all
# four recipes), OBJECTIVE_STEPS, OBJECTIVE_PROMPTS (per bench and head) and OBJECTIVE_EVAL_SECONDS (kept for the
# evaluations). The curve stage: CURVE_BUDGET and CURVE_EVERY (minutes), CURVE_STEPS and CURVE_LR (the schedule),
# CURVE_PROMPTS, CURVE_RESERVE (seconds kept for the walk and export); CURVE_NAME and CURVE_DATA train a second
# curve on an earlier one's data (charged its recorded minutes). docs/performance.md has the sizes that fit one
# 10-minute call.
set -euo pipefail
cd "$(dirname "$0")/../.."
STAGE=${1:?usage: gpu_recipe.sh kernels|stage1|stage2|all|objectives|curve|oracle}
START=$(date +%s)
SCALE=${SCALE:-full}
EG=${EG:-/tmp/eg}
PY=${PYTHON:-python3}
export PYTHONPATH="$EG/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export EAGLE_TRAIN_CACHE="$EG/cache" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
TARGET="$EG/SmolLM2-135M-Instruct.Q4_1.gguf"
DATA="$EG/sharegpt.jsonl"
if [ "$SCALE" = tiny ]; then
  RUNS=${RUNS:-$EG/runs-tiny}
  NUM_CONV=${NUM_CONV:-40}; MAX_LEN=256; NEW_TOKENS=32; DISTIL_BATCH=16; WORKERS=2; AMP=no
  TRAIN_ARGS=(max_length=256 tokens_per_batch=1024 max_steps=3 save_every=2 log_every=1 num_workers=0
              eval_fraction=0.1 mixed_precision=auto warmup_steps=1)
  EVAL_PROMPTS=${EVAL_PROMPTS:-2}; EVAL_TOKENS=${EVAL_TOKENS:-16}; TREE=3,2,4
  OBJECTIVE_STEPS=${OBJECTIVE_STEPS:-4}; OBJECTIVE_SAVE_EVERY=2; OBJECTIVE_PROMPTS=${OBJECTIVE_PROMPTS:-1}
  CURVE_BUDGET=${CURVE_BUDGET:-2.5}; CURVE_EVERY=${CURVE_EVERY:-0.5}; CURVE_SAVE_EVERY=2; WALK_PROMPTS=2; CURVE_PROMPTS=1
  CURVE_TRAIN=(max_length=256 tokens_per_batch=1024 max_steps=6 num_workers=0 warmup_steps=1 ttt_length=3)
  BENCH_ARGS=(--tree "$TREE" --hf-prompts 2 --train-tokens 512 --train-steps 2 --capture-tokens 1024
              --capture-token-budget 512 --loss-tokens 256 --repeat 2)
  STAGE_SECONDS=${STAGE_SECONDS:-3000}
  ORACLE_ARGS=(--ks 1 3 --p 0 --num-prompts 1 --max-new-tokens 16)
else
  RUNS=${RUNS:-$EG/runs}
  NUM_CONV=${NUM_CONV:-6144}; MAX_LEN=1024; NEW_TOKENS=512; DISTIL_BATCH=${DISTIL_BATCH:-256}; WORKERS=$(nproc); AMP=bf16
  TRAIN_ARGS=()
  EVAL_PROMPTS=${EVAL_PROMPTS:-80}; EVAL_TOKENS=${EVAL_TOKENS:-128}; TREE=6,8,60
  OBJECTIVE_STEPS=${OBJECTIVE_STEPS:-240}; OBJECTIVE_SAVE_EVERY=40; OBJECTIVE_PROMPTS=${OBJECTIVE_PROMPTS:-10}
  CURVE_BUDGET=${CURVE_BUDGET:-5.5}; CURVE_EVERY=${CURVE_EVERY:-1}; CURVE_SAVE_EVERY=60; WALK_PROMPTS=20; CURVE_PROMPTS=${CURVE_PROMPTS:-1}
  CURVE_TRAIN=(max_steps=${CURVE_STEPS:-500} learning_rate=${CURVE_LR:-1e-3} warmup_steps=30)
  BENCH_ARGS=(--tree "$TREE")
  STAGE_SECONDS=${STAGE_SECONDS:-540}
  ORACLE_ARGS=(--ks 1 2 3 4 5 6 7 --p 0 0.5 --num-prompts "${ORACLE_PROMPTS:-3}" --max-new-tokens 128)
fi
OUT=${OUT:-$RUNS/out}
mkdir -p "$RUNS/logs" "$OUT"
LOG="$OUT/$STAGE.log"
TIMES="$RUNS/timings.tsv"

say() { echo "[$(date -u +%H:%M:%S) +$(( $(date +%s) - START ))s] $*" | tee -a "$LOG"; }
left() { echo $(( START + STAGE_SECONDS - $(date +%s) )); }

# step NAME CMD...: run CMD with its output in $RUNS/logs/NAME.log (tail in $LOG), time it in $TIMES.
step() {
  local name=$1; shift
  say "step $name: $*"
  local t0 rc=0 dt
  t0=$(date +%s%N)
  "$@" > "$RUNS/logs/$name.log" 2>&1 || rc=$?
  dt=$(( ($(date +%s%N) - t0) / 1000000 ))
  dt="$(( dt / 1000 )).$(( dt % 1000 / 100 ))"
  printf '%s\t%s\t%s\t%s\n' "$STAGE" "$name" "$dt" "$rc" >> "$TIMES"
  tail -n 25 "$RUNS/logs/$name.log" | sed 's/\r/\n/g' | grep -v '^\s*$' | tail -n 25 >> "$LOG"
  say "step $name: rc=$rc in ${dt}s"
  return $rc
}

# newest finished checkpoint of a training run (eagle_train.train_checkpoint decides what "finished" means), or nothing
newest_checkpoint() {
  "$PY" -c 'import sys; from eagle_train.train_checkpoint import newest_checkpoint as n; f = n(sys.argv[1]); print(f[0] if f else "")' "$1"
}

# newest head of a training run: final/ when it finished, else its newest checkpoint
head_of() {
  if [ -f "$1/final/config.json" ]; then echo "$1/final"; return; fi
  local ck
  ck=$(newest_checkpoint "$1")
  [ -n "$ck" ] || { say "no head in $1: its training did not save a checkpoint" >&2; return 1; }
  echo "$ck"
}

# train NAME SCRIPT CONFIG RESERVE [key=value ...]: train with a time guard that leaves RESERVE
# seconds of the stage
train() {
  local name=$1 script=$2 config=$3 reserve=$4
  shift 4
  if [ -f "$RUNS/$name/final/config.json" ]; then say "$name: already trained"; return 0; fi
  local budget=$(( $(left) - reserve ))
  [ "$budget" -gt 30 ] || { say "$name: only ${budget}s left for training, skipped"; return 1; }
  local rc=0
  step "train_$name" timeout -k 20 "$budget" "$PY" -m accelerate.commands.launch --num_processes 1 \
      --num_machines 1 --dynamo_backend no --mixed_precision "$AMP" "$script" --config "$config" \
      target="$TARGET" data_path="$RUNS/prep/store" output_dir="$RUNS/$name" resume=auto "${TRAIN_ARGS[@]}" "$@" \
    || rc=$?
  cp "$RUNS/$name/metrics.jsonl" "$OUT/${name}_metrics.jsonl" 2>/dev/null || true
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    say "$name: stopped by the time guard after ${budget}s; newest checkpoint: $(head_of "$RUNS/$name" || echo none)"
  elif [ "$rc" != 0 ]; then
    return "$rc"
  fi
}

# EAGLE-3's fused_loss: FUSED_LOSS=true|false, or auto: true when the kernels call measured a fused_ce
# implementation faster than the log_softmax loss with the same gradients (false without that measurement)
fused_loss_choice() {
  if [ "${FUSED_LOSS:-auto}" != auto ]; then echo "$FUSED_LOSS"; return; fi
  "$PY" - "$RUNS/bench_kernels.json" <<'PY'
import json, sys
try:
    impls = json.load(open(sys.argv[1]))["kernels"]["ttt_step_loss"]["impls"]
    ref = impls.pop("log_softmax (ttt.step_loss)")
except (OSError, KeyError, ValueError):
    print("false")
    sys.exit()
good = [v for v in impls.values() if v.get("rel_grad_diff_vs_log_softmax", 1.0) < 0.02 and v["seconds"] < ref["seconds"]]
print("true" if good else "false")
PY
}

stage_kernels() {
  step env bash -c "nvidia-smi || true; $PY -c 'import torch, transformers, sys; print(sys.version); print(torch.__version__, transformers.__version__, torch.cuda.is_available())'"
  local rc=0
  step bench_kernels "$PY" scripts/bench/gpu.py --only kernels --out "$OUT/bench_kernels.json" "${BENCH_ARGS[@]}" || rc=$?
  cp "$RUNS/logs/bench_kernels.log" "$OUT/bench_kernels.txt" || true
  cp "$OUT/bench_kernels.json" "$RUNS/bench_kernels.json" || true  # stage1 reads it (fused_loss choice)
  return $rc
}

# the carried GGUF and ShareGPT unpacked (once), the environment logged, the GGUF dequantised (once per target)
carried_inputs() {
  if [ ! -f "$DATA" ] || [ ! -f "$TARGET" ]; then
    [ -d .carry/part2 ] || { say "no $DATA and no .carry/part2: carry .carry/part2 (scripts/dev/device_pack.sh)"; exit 2; }
    [ -f "$EG/gguf.0" ] || { say "no $EG/gguf.0: the previous call must copy .carry/part1 to $EG"; exit 2; }
    step unpack bash scripts/dev/device_unpack.sh
  fi
  step env bash -c "nvidia-smi || true; $PY -c 'import torch, transformers, sys; print(sys.version); print(torch.__version__, transformers.__version__, torch.cuda.is_available())'; nproc; df -h /tmp | tail -1"
  step convert "$PY" -c "from eagle_train.target import resolve_target; print(resolve_target('$TARGET'))"
}

# the self-distilled store: the carried inputs, then NUM_CONV first turns distilled
distil_store() {
  carried_inputs
  if [ ! -f "$RUNS/prep/store/manifest.json" ]; then  # a rerun resumes at the first missing batch
    step distil timeout -k 20 "${DISTIL_SECONDS:-240}" "$PY" -m data_prep.cli run --config scripts/dev/gpu_smollm2.yaml \
      target="$TARGET" data="$DATA" out_dir="$RUNS/prep" prep.num_conversations="$NUM_CONV" \
      prep.max_length="$MAX_LEN" prep.distil.max_new_tokens="$NEW_TOKENS" prep.distil.batch_size="$DISTIL_BATCH" \
      || { say "distil did not finish in ${DISTIL_SECONDS:-240}s: rerun stage1 (it resumes) or lower NUM_CONV"; return 1; }
  fi
  cp "$RUNS/prep/store/manifest.json" "$OUT/store_manifest.json"
}

stage1() {
  distil_store
  if [ ! -f "$RUNS/bench_data/tokenized/manifest.json" ]; then  # scripts/bench/gpu.py's capture and training sections
    step tokenize "$PY" -m data_prep.cli run --config scripts/dev/gpu_smollm2.yaml target="$TARGET" data="$DATA" \
      out_dir="$RUNS/bench_data" prep.num_conversations=2000 prep.max_length="$MAX_LEN" prep.workers="$WORKERS" \
      prep.distil.enabled=false prep.capture.enabled=false
  fi
  local rc_e3=0 rc_pe=0 fused
  fused=$(fused_loss_choice 2>/dev/null || true); [ "$fused" = true ] || fused=false
  say "EAGLE-3 fused_loss=$fused (FUSED_LOSS=${FUSED_LOSS:-auto}; see bench_kernels.json)"
  train eagle3 scripts/train_eagle3.py scripts/dev/eagle3_smollm2_gpu.yaml 25 fused_loss="$fused" &
  local pid_e3=$!
  train peagle scripts/train_peagle.py scripts/dev/peagle_smollm2_gpu.yaml 25 &
  wait "$pid_e3" || rc_e3=$?
  wait $! || rc_pe=$?
  say "training: eagle3 rc=$rc_e3, peagle rc=$rc_pe (stage2 retrains a missing P-EAGLE head first)"
  [ "$rc_e3" = 0 ] || return "$rc_e3"
  local e3
  e3=$(head_of "$RUNS/eagle3") || { say "stage1 ends without an EAGLE-3 head: raise STAGE_SECONDS or lower NUM_CONV"; return 1; }
  say "EAGLE-3 head for stage2: $e3; P-EAGLE head: $(head_of "$RUNS/peagle" 2>/dev/null || echo none)"
}

stage2() {
  [ -f "$RUNS/bench_data/tokenized/manifest.json" ] || { say "no tokenized data in $RUNS/bench_data: run stage1 first"; exit 2; }
  local e3 pe rc=0
  e3=$(head_of "$RUNS/eagle3") || { say "no EAGLE-3 head: run stage1 first"; exit 2; }
  if ! head_of "$RUNS/peagle" > /dev/null 2>&1; then  # stage1's P-EAGLE run failed: half the stage for it
    train peagle scripts/train_peagle.py scripts/dev/peagle_smollm2_gpu.yaml $(( STAGE_SECONDS / 2 )) || rc=$?
  fi
  pe=$(head_of "$RUNS/peagle") || pe=""
  step export_eagle3 "$PY" -m eagle_cli.export "$e3" --format eagle3 --out "$RUNS/export/eagle3" --target "$TARGET" || rc=$?
  step check_eagle3 "$PY" -m eagle_cli.export --check "$RUNS/export/eagle3" --engine all --target "$TARGET" || rc=$?
  if [ -n "$pe" ]; then
    step export_peagle "$PY" -m eagle_cli.export "$pe" --format peagle --out "$RUNS/export/peagle" --target "$TARGET" || rc=$?
    step check_peagle "$PY" -m eagle_cli.export --check "$RUNS/export/peagle" --target "$TARGET" || rc=$?
  fi
  # the benchmark covers every figure the issue asks for; it saves after each section and drafting
  # shape, and leaves EVAL_RESERVE seconds of the stage to eagle-eval
  step bench timeout -k 10 $(( $(left) - ${EVAL_RESERVE:-90} )) "$PY" scripts/bench/gpu.py --target "$TARGET" \
      --eagle3 "$e3" ${pe:+--peagle "$pe"} --data "$RUNS/bench_data/tokenized" --out "$OUT/bench.json" \
      --prompts "$EVAL_PROMPTS" --max-new-tokens "$EVAL_TOKENS" "${BENCH_ARGS[@]}" || rc=$?
  cp "$RUNS/logs/bench.log" "$OUT/bench_table.txt" 2>/dev/null || true
  # eagle-eval, most wanted shape first, while the stage has time (each run: load, warm-up, every
  # prompt speculative + plain); a run cut by the guard leaves no JSON and is reported as such.
  local shapes=("eagle3|--chain 5" "peagle|--parallel 7" "eagle3|--tree $TREE" "eagle3|--chain 3"
                "eagle3|--chain 7" "peagle|--parallel 3" "peagle|--parallel 5")
  local evals=() spec method flags draft name budget
  for spec in "${shapes[@]}"; do
    method=${spec%%|*}; flags=${spec#*|}
    draft=$e3; [ "$method" = peagle ] && draft=$pe
    [ -n "$draft" ] || continue
    for bench in mt_bench humaneval gsm8k; do
      name="eval_${method}_$(echo "$flags" | tr -d ' -' | tr ',' '_')_$bench"
      budget=$(( $(left) - 10 ))
      if [ "$budget" -lt "${EVAL_MIN_SECONDS:-45}" ]; then say "$name: skipped, ${budget}s left"; continue; fi
      # shellcheck disable=SC2086
      step "$name" timeout -k 5 "$budget" "$PY" -m eagle_cli.evaluate --target "$TARGET" --draft "$draft" \
          --bench "$bench" --num-prompts "$EVAL_PROMPTS" --max-new-tokens "$EVAL_TOKENS" $flags \
          --out "$RUNS/eval/$name.json" || rc=$?
      evals+=("$RUNS/eval/$name.json")
    done
  done
  "$PY" - "$OUT/eval.json" "${evals[@]}" <<'PY' || rc=$?
import json, os, sys
out = {}
for p in sys.argv[2:]:
    if os.path.isfile(p):
        r = json.load(open(p))
        r.pop("prompts", None)  # per-prompt outputs stay on the device; the summary comes back
        out[os.path.basename(p)[:-5]] = r
json.dump(out, open(sys.argv[1], "w"), indent=1)
print(f"{len(out)} of {len(sys.argv) - 2} eval runs -> {sys.argv[1]}")
PY
  return $rc
}

# The training objectives of scripts/bench/quality.py's RECIPES on one store: EAGLE-3 once per recipe in
# OBJECTIVES, side by side for OBJECTIVE_STEPS steps (fused loss: Triton's kernels where they pass their check
# on the device), then each head at the newest checkpoint step all runs reached:
# expected acceptance on the held-out answers at T = 0, 0.7, 1.0 (scripts/bench/sampled_acceptance.py) and
# greedy chain K=3 on the three benches (OBJECTIVE_PROMPTS each, EVAL_TOKENS new tokens). OBJECTIVE_EVAL_SECONDS
# of the stage are kept for the evaluations.
stage_objectives() {
  distil_store
  local o pids=() rc=0 args runs=() recipes
  # each recipe's overrides, looked up before any run starts so that all start together
  recipes=$("$PY" - ${OBJECTIVES:-sft tv onpolicy tv+onpolicy} <<'PY'
import sys
sys.path.insert(0, "scripts/bench")
from quality import RECIPES
for name in sys.argv[1:]:
    print(name, *RECIPES[name])
PY
)
  export OMP_NUM_THREADS=4  # four trainers share the machine's cores
  while read -r o args; do
    train "eagle3_$o" scripts/train_eagle3.py scripts/dev/eagle3_smollm2_gpu.yaml "${OBJECTIVE_EVAL_SECONDS:-200}" \
      $args fused_loss=true max_steps="$OBJECTIVE_STEPS" save_every="$OBJECTIVE_SAVE_EVERY" keep_checkpoints=20 \
      eval_fraction=0.05 < /dev/null &
    pids+=($!)
    runs+=("$RUNS/eagle3_$o")
  done <<< "$recipes"
  for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
  say "training done (last failing rc: $rc)"
  local common heads=() d
  common=$(for d in "${runs[@]}"; do
           newest_checkpoint "$d" | sed 's/.*checkpoint-//'
         done | sort -n | head -n 1)
  [ -n "$common" ] || { say "a recipe saved no checkpoint: raise STAGE_SECONDS or lower OBJECTIVE_STEPS"; return 1; }
  for d in "${runs[@]}"; do
    [ -d "$d/checkpoint-$common" ] || { say "$d has no checkpoint-$common"; return 1; }
    heads+=("$d/checkpoint-$common")
  done
  say "comparing the heads at step $common: ${heads[*]}"
  for d in "${runs[@]}"; do
    sed "s/^/$(basename "$d") /" "$d/metrics.jsonl" 2>/dev/null; rm -f "$OUT/$(basename "$d")_metrics.jsonl"
  done > "$OUT/objectives_metrics.txt"
  step sampled_acceptance "$PY" scripts/bench/sampled_acceptance.py --store "$RUNS/prep/store" --head "${heads[@]}" \
    --eval-fraction 0.05 --steps 3 --temperature 0 0.7 1.0 || rc=$?
  cp "$RUNS/logs/sampled_acceptance.log" "$OUT/sampled_acceptance.txt" || true
  step bench_objectives timeout -k 5 $(( $(left) - 5 )) "$PY" - "$OUT/objectives.json" "$OBJECTIVE_PROMPTS" "$EVAL_TOKENS" \
      "$TARGET" "${heads[@]}" <<'PY' || rc=$?
import json, sys
sys.path.insert(0, "scripts/bench")
from quality import Evaluator
from inference.drafting import TreeShape
from inference.evaluate import BENCHES
out_path, prompts, tokens, target, heads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5:]
evaluate = Evaluator(target, None, BENCHES, prompts, {"chain3": TreeShape.chain(3)}, tokens)
out = {}
for head in heads:  # saved after each head: a run cut by the time guard keeps the heads before it
    summaries, _ = evaluate(head)
    out[head] = summaries["chain3"]
    json.dump(out, open(out_path, "w"), indent=1)
    print(head, {b: round(s["acceptance_length"], 3) for b, s in out[head].items()}, flush=True)
PY
  return $rc
}

# The time-to-quality curve on this machine: data and training under one budget of compute minutes
stage_curve() {
  carried_inputs  # the dequantisation is the target's one-time conversion, outside the curve's minutes
  local rc=0 q="$RUNS/${CURVE_NAME:-curve}"  # CURVE_DATA: an earlier curve's data dir, made by the same --prep
  step curve timeout -k 10 $(( $(left) - ${CURVE_RESERVE:-50} )) "$PY" scripts/bench/quality.py --out "$q" \
      --data "${CURVE_DATA:-$q/data}" \
      --budget "$CURVE_BUDGET" --eval-every "$CURVE_EVERY" --save-every "$CURVE_SAVE_EVERY" \
      --num-prompts "$CURVE_PROMPTS" --max-new-tokens "$EVAL_TOKENS" --chain 3 --tree "$TREE" \
      --walk-prompts "$WALK_PROMPTS" --walk-new-tokens "$EVAL_TOKENS" \
      --prep scripts/dev/gpu_smollm2.yaml target="$TARGET" data="$DATA" prep.num_conversations="$NUM_CONV" \
        prep.max_length="$MAX_LEN" prep.distil.max_new_tokens="$NEW_TOKENS" prep.distil.batch_size="$DISTIL_BATCH" \
      --train scripts/dev/eagle3_smollm2_gpu.yaml target="$TARGET" fused_loss=true "${CURVE_TRAIN[@]}" || rc=$?
  cp "$q/quality.json" "$OUT/" 2>/dev/null || true
  local head
  head=$(head_of "$q/train") || return 1
  step walk "$PY" - "$TARGET" "$head" "$WALK_PROMPTS" "$EVAL_TOKENS" "$q/walk.json" <<'PY' || rc=$?
import json, sys
sys.path.insert(0, "scripts/bench")
from quality import Evaluator
from inference.evaluate import BENCHES
target, head, prompts, tokens, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
evaluator = Evaluator(target, None, BENCHES, 1, {}, tokens, prompts, tokens)
walks = {k: evaluator.walk(head, k) for k in (3, 5, 7)}
json.dump({"head": head, "walk": walks}, open(out, "w"), indent=1)
for k, per in walks.items():
    print(f"chain K={k} walk:", " ".join(f"{b} {w['acceptance_length']:.4f}" for b, w in per.items()))
PY
  step export "$PY" -m eagle_cli.export "$head" --format eagle3 --out "$RUNS/export/eagle3" --target "$TARGET" || rc=$?
  tar -C "$q" -cf "$RUNS/curve_rest.tar" walk.json train/train.log train/metrics.jsonl 2>/dev/null || true
  cp "$RUNS/curve_rest.tar" "$OUT/" || true
  tar -C "$RUNS/export" -cf - eagle3 | split -b 16000000 -d - "$OUT/eagle3.tar."
  return $rc
}

stage_oracle() {
  [ -f "$TARGET" ] || carried_inputs
  local rc=0 drafters=(--drafters free eagle3 peagle dflash dspark)
  step oracle_smollm2 "$PY" scripts/bench/oracle.py --target "$TARGET" "${ORACLE_ARGS[@]}" "${drafters[@]}" \
    --out "$OUT/oracle_smollm2.json" || rc=$?
  cp "$RUNS/logs/oracle_smollm2.log" "$OUT/oracle_smollm2.txt" || true
  if [ "$SCALE" != tiny ]; then
    step oracle_8b "$PY" scripts/bench/oracle.py --target "$TARGET" --random-target llama-8b "${ORACLE_ARGS[@]}" \
      "${drafters[@]}" --out "$OUT/oracle_8b.json" || rc=$?
    cp "$RUNS/logs/oracle_8b.log" "$OUT/oracle_8b.txt" || true
  fi
  return $rc
}

finish() {
  local rc=$?
  cp "$TIMES" "$OUT/timings.tsv" 2>/dev/null || true
  say "gpu_recipe $STAGE done: rc=$rc"
}
trap finish EXIT
say "gpu_recipe $STAGE (SCALE=$SCALE, runs in $RUNS, results in $OUT, budget ${STAGE_SECONDS}s)"
# Stages run under set -e (a failed data or training step ends the run); stage2 goes on past a failed
# export or evaluation so that everything else still comes back, and exits non-zero at the end.
case $STAGE in
  kernels) stage_kernels ;;
  stage1) stage1 ;;
  stage2) stage2 ;;
  objectives) stage_objectives ;;
  curve) stage_curve ;;
  oracle) stage_oracle ;;
  all) stage1; START=$(date +%s); stage2 ;;
  *) echo "unknown stage $STAGE: kernels, stage1, stage2, all, objectives, curve or oracle" >&2; exit 2 ;;
esac
