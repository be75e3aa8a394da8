#!/usr/bin/env bash
# Run a command while another job takes every core for a stretch of it: how a speed verdict is checked on a
# busy machine (issue: "a speed verdict that holds on a busy machine").
#   bash scripts/dev/busy.sh AFTER_S FOR_S eagle-eval --target smollm2-135m --draft runs/eagle3_smollm2/export ...
# One busy-looping process per core starts AFTER_S seconds into the command and stops FOR_S seconds later.
set -euo pipefail
after=$1 span=$2; shift 2
(
  sleep "$after"
  pids=()
  for _ in $(seq "$(nproc)"); do python3 -c "while True: pass" & pids+=($!); done
  echo "busy.sh: $(nproc) busy processes from ${after}s for ${span}s" >&2
  sleep "$span"
  kill "${pids[@]}"
  echo "busy.sh: the machine is idle again" >&2
) &
hog=$!
trap 'kill $hog 2>/dev/null; pkill -P $hog 2>/dev/null || true' EXIT
"$@"
