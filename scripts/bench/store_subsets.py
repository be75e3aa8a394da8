"""Subsets of one store, equal in size and vocabulary map, that differ in what their answers teach: does it move a
bench?

- `natural`: the store's first N samples (ShareGPT's own mix);
- `domain`: every sample whose prompt looks like code or a calculation (`CODE`, `MATH`: rough regexes over the
  chat-templated prompt), filled up to N with the others in store order;
- `copy`: the N samples whose answers most repeat words already in their text (the share of answer tokens that
  `sampled_acceptance.py --by-token` counts as "repeats an earlier token"): what a head must do on GSM8K.

Each is a store of its own with the source's vocabulary map, so heads trained on them at equal steps differ in their
answers alone.

    python scripts/bench/store_subsets.py --store runs/q/wide1200/store --out runs/mix --num-samples 600
    python scripts/train_eagle3.py --config configs/eagle3_smollm2.yaml data_path=runs/mix/domain/store ...
"""

import argparse
import json
import re
import shutil
from collections import Counter
from pathlib import Path

import torch
from sampled_acceptance import TOKEN_CLASSES, token_class  # beside this file: its --by-token rule

from eagle_train.store import HIDDEN_FORMAT, VOCAB_MAP, ShardedSamples, StoreWriter, finalize_manifest, read_manifest
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


def is_word(text: str) -> bool:
    """A token that, already in the text, `sampled_acceptance.py --by-token` counts as a repeat (not a number or
    punctuation)."""
    return token_class(text, in_draft=True, seen_earlier=True) == TOKEN_CLASSES[3]


def prompt_kind(prompt: str) -> str:
    return "code" if CODE.search(prompt) else "math" if MATH.search(prompt) else "other"


def copy_share(input_ids: list[int], loss_mask: list[bool], words: set[int]) -> float:
    """The share of a sample's answer tokens that are words (ids in `words`) already in the text before them."""
    seen, copies, answers = set(), 0, 0
    for token, answer in zip(input_ids, loss_mask):
        if answer:
            answers += 1
            copies += token in words and token in seen
        seen.add(token)
    return copies / max(answers, 1)


def subsets(kinds: list[str], copy_shares: list[float], n: int) -> dict[str, list[int]]:
    domain = [i for i, k in enumerate(kinds) if k != "other"][:n]
    domain += [i for i, k in enumerate(kinds) if k == "other"][: n - len(domain)]
    copy = sorted(range(len(kinds)), key=lambda i: -copy_shares[i])[:n]
    return {"natural": list(range(min(n, len(kinds)))), "domain": sorted(domain), "copy": sorted(copy)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--store", required=True, help="a finished hidden-state store")
    p.add_argument("--out", required=True, help="new directory: <out>/{natural,domain,copy}/store")
    p.add_argument("--num-samples", type=int, required=True, help="samples in each subset")
    args = p.parse_args(argv)
    src, out = Path(args.store), Path(args.out)
    if args.num_samples < 1:
        p.error(f"--num-samples must be at least 1, got {args.num_samples}")
    if out.exists():
        p.error(f"--out {out} exists: choose a new directory")
    try:
        manifest = read_manifest(src)
    except (FileNotFoundError, ValueError) as e:
        p.error(str(e))
    if manifest["format"] != HIDDEN_FORMAT:
        p.error(f"{src} is a tokenized dataset: subsets need a store of hidden states (`eagle-prep capture`)")
    # bf16 and fp32 stores are copied exactly; an fp8 one is read in fp32 and quantised again
    read_dtype = torch.bfloat16 if manifest["dtype"] == "bfloat16" else torch.float32
    store, tokenizer = ShardedSamples(src, dtype=read_dtype), load_tokenizer(manifest["tokenizer"])
    words = {i for i, t in enumerate(tokenizer.batch_decode([[i] for i in range(len(tokenizer))])) if is_word(t)}
    kinds, copy_shares = [], []
    for i in range(len(store)):
        t = store.tokens(i)
        kinds.append(prompt_kind(tokenizer.decode(t["input_ids"][: int(t["loss_mask"].nonzero()[0])])))
        copy_shares.append(copy_share(t["input_ids"].tolist(), t["loss_mask"].tolist(), words))
    print(f"{src}: {dict(Counter(kinds))}, answer words repeated: {sum(copy_shares) / len(copy_shares):.3f}")
    header = {k: v for k, v in manifest.items() if k not in MANIFEST_COUNTS}
    for name, ids in subsets(kinds, copy_shares, args.num_samples).items():
        path = out / name / "store"
        path.mkdir(parents=True)
        with StoreWriter(path, dtype=manifest["dtype"]) as writer:
            for s in range(0, len(ids), SHARD_SAMPLES):
                chunk = ids[s : s + SHARD_SAMPLES]
                writer.add_shard(s // SHARD_SAMPLES, [store[i] for i in chunk], list(range(s, s + len(chunk))))
        finalize_manifest(path, header)
        shutil.copy(src / VOCAB_MAP, path / VOCAB_MAP)
        (out / name / "source_samples.json").write_text(json.dumps(ids))
        shares = sum(copy_shares[i] for i in ids) / len(ids)
        print(
            f"{name}: {len(ids)} samples {dict(Counter(kinds[i] for i in ids))}, words repeated {shares:.3f} -> {path}"
        )


if __name__ == "__main__":
    main()
