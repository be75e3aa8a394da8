"""Two subsets of one store, equal in size, that differ in their prompts alone: does the prompt mix move a bench?

`natural` holds the store's first N samples (ShareGPT's own mix); `domain` every sample whose prompt looks like code
or a calculation (`CODE`, `MATH`: rough regexes over the chat-templated prompt), filled up to N with the others in
store order. Each is a store of its own with the source's vocabulary map, so two heads trained on them at equal
steps differ in what their answers are about, not in their vocabulary or size.

    python scripts/bench/prompt_mix.py --store runs/q/wide1200/store --out runs/mix --num-samples 600
    python scripts/train_eagle3.py --config configs/eagle3_smollm2.yaml data_path=runs/mix/domain/store ...
"""

import argparse
import json
import re
import shutil
from collections import Counter
from pathlib import Path

import torch

from eagle_train.store import VOCAB_MAP, ShardedSamples, StoreWriter, finalize_manifest, read_manifest
from eagle_train.target import load_tokenizer

CODE = re.compile(
    r"```|\bdef |\bfunction\b|\bcode\b|python|javascript|java\b|c\+\+|\bsql\b|html|css|typescript|react|"
    r"\bscript\b|\bclass\b|programming|\bapi\b|bash|regex",
    re.I,
)
MATH = re.compile(
    r"\d+\s*[\+\-\*/x×=%]\s*\d+|how many|how much|calculate|solve|equation|percent|total cost|\bprobability\b|"
    r"\bsum\b|average|\bprice\b",
    re.I,
)
MANIFEST_COUNTS = ("version", "complete", "num_samples", "num_tokens", "shard_naming", "shards")
SHARD_SAMPLES = 128


def prompt_kind(prompt: str) -> str:
    return "code" if CODE.search(prompt) else "math" if MATH.search(prompt) else "other"


def subsets(kinds: list[str], n: int) -> dict[str, list[int]]:
    domain = [i for i, k in enumerate(kinds) if k != "other"][:n]
    domain += [i for i, k in enumerate(kinds) if k == "other"][: n - len(domain)]
    return {"natural": list(range(min(n, len(kinds)))), "domain": sorted(domain)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--store", required=True, help="a finished hidden-state store")
    p.add_argument("--out", required=True, help="new directory: <out>/natural/store and <out>/domain/store")
    p.add_argument("--num-samples", type=int, required=True, help="samples in each subset")
    args = p.parse_args(argv)
    src, out = Path(args.store), Path(args.out)
    manifest = read_manifest(src)
    # bf16 and fp32 stores are copied exactly; an fp8 one is read in fp32 and quantised again
    read_dtype = torch.bfloat16 if manifest["dtype"] == "bfloat16" else torch.float32
    store, tokenizer = ShardedSamples(src, dtype=read_dtype), load_tokenizer(manifest["tokenizer"])
    kinds = []
    for i in range(len(store)):
        t = store.tokens(i)
        kinds.append(prompt_kind(tokenizer.decode(t["input_ids"][: int(t["loss_mask"].nonzero()[0])])))
    print(f"{src}: {dict(Counter(kinds))}")
    header = {k: v for k, v in manifest.items() if k not in MANIFEST_COUNTS}
    for name, ids in subsets(kinds, args.num_samples).items():
        path = out / name / "store"
        path.mkdir(parents=True)
        with StoreWriter(path, dtype=manifest["dtype"]) as writer:
            for s in range(0, len(ids), SHARD_SAMPLES):
                chunk = ids[s : s + SHARD_SAMPLES]
                writer.add_shard(s // SHARD_SAMPLES, [store[i] for i in chunk], list(range(s, s + len(chunk))))
        finalize_manifest(path, header)
        shutil.copy(src / VOCAB_MAP, path / VOCAB_MAP)
        (out / name / "source_samples.json").write_text(json.dumps(ids))
        print(f"{name}: {len(ids)} samples {dict(Counter(kinds[i] for i in ids))} -> {path}")


if __name__ == "__main__":
    main()
