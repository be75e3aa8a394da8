"""The experiment of training a head for head + n-gram drafting: a store whose loss mask leaves out the answer
tokens that n-gram lookup would draft anyway.

Served behind n-gram lookup (`inference.hybrid_drafting`), a head drafts only where the lookup has no draft. This
writes a copy of a store in which every answer token that a 2- to 4-gram lookup over the sample's own earlier tokens
(`inference.prompt_lookup.propose`, the built-in runtime's rule) proposes as its first draft is no longer
supervised: the loss weighs the positions where the lookup would not propose the target's token (weight 1) against
those where it would (weight 0). Train on it with the same recipe as on the source, at equal minutes, and compare
both heads' head + n-gram rows (`eagle-eval`, "hybrid").

    python scripts/bench/lookup_weighting.py --store runs/smollm2_sharegpt/store --out runs/lookup/store
"""

import argparse
import shutil
from pathlib import Path

import torch

from eagle_train.store import HIDDEN_FORMAT, VOCAB_MAP, ShardedSamples, StoreWriter, finalize_manifest, read_manifest
from inference.prompt_lookup import propose

MANIFEST_COUNTS = ("version", "complete", "num_samples", "num_tokens", "shard_naming", "shards")
SHARD_SAMPLES = 128


def looked_up(input_ids: list[int], loss_mask: list[bool]) -> list[bool]:
    """Per position, whether it is an answer token that lookup over the tokens before it proposes first."""
    return [bool(m) and propose(input_ids[:q], 1) == [input_ids[q]] for q, m in enumerate(loss_mask)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--store", required=True, help="a finished hidden-state store")
    p.add_argument("--out", required=True, help="a new directory for the store without the looked-up answer tokens")
    args = p.parse_args(argv)
    src, out = Path(args.store), Path(args.out)
    if out.exists():
        p.error(f"--out {out} exists: choose a new directory")
    manifest = read_manifest(src)
    if manifest["format"] != HIDDEN_FORMAT:
        p.error(f"{src} is a tokenized dataset: this needs a store of hidden states")
    read_dtype = torch.bfloat16 if manifest["dtype"] == "bfloat16" else torch.float32
    store = ShardedSamples(src, dtype=read_dtype)
    out.mkdir(parents=True)
    answers = dropped = 0
    with StoreWriter(out, dtype=manifest["dtype"]) as writer:
        for s in range(0, len(store), SHARD_SAMPLES):
            samples = []
            for i in range(s, min(s + SHARD_SAMPLES, len(store))):
                sample = dict(store[i])
                mask = sample["loss_mask"].bool()
                hits = torch.tensor(looked_up(sample["input_ids"].tolist(), mask.tolist()))
                sample["loss_mask"] = (mask & ~hits).to(sample["loss_mask"].dtype)
                answers, dropped = answers + int(mask.sum()), dropped + int(hits.sum())
                samples.append(sample)
            writer.add_shard(s // SHARD_SAMPLES, samples, list(range(s, s + len(samples))))
    finalize_manifest(out, {k: v for k, v in manifest.items() if k not in MANIFEST_COUNTS})
    shutil.copy(src / VOCAB_MAP, out / VOCAB_MAP)
    share = dropped / max(answers, 1)
    print(f"{out}: {len(store)} samples, {dropped} of {answers} answer tokens ({share:.1%}) drafted by lookup")


if __name__ == "__main__":
    main()
