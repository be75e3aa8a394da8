"""Three ways to feed training, at the same data: offline (a vLLM-distilled store, then training on it), online-HF (the
target runs in the training process) and online-vLLM (a vLLM engine makes the samples while the head trains,
through a bounded buffer; data_prep/feed.py).

    python scripts/bench/online.py --conversations 64 --max-new-tokens 64 --engine-core 1

The same ShareGPT conversations, answered greedily by the target (SmolLM2 unless --target), train the same EAGLE-3
head config for --epochs. The trainer runs one thread; the vLLM engine is bound to --engine-core. Prints per way:
wall seconds (with engine starts and evals), the training loop's seconds and tokens trained per second, and the
peak bytes on disk; then the engine alone (distil's answer rate, without its start) and the trainer alone (the
offline loop) as tokens per second, and online-vLLM's loop over the slower of the two: the overlap is real when it
is near 1. Held-out simulated AL after training, per way, says whether the heads learnt alike.
"""

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch


def loop_seconds(result) -> float:
    """The training loop's time: each step's tokens over its tokens per second (data waits included, evals not)."""
    return sum(m["tokens"] / m["tokens_per_s"] for m in result["history"])


def trained(result) -> int:
    return sum(m["tokens"] for m in result["history"])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--conversations", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--engine-core", default="1", help="VLLM_CPU_OMP_THREADS_BIND of the engine")
    p.add_argument("--buffer-gib", type=float, default=0.25)
    p.add_argument("--out", default=None, help="a directory for the runs (default: a temporary one)")
    args = p.parse_args(argv)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = args.engine_core
    torch.set_num_threads(1)

    from data_prep.distil import distil
    from eagle_cli.train import run
    from eagle_train.store import read_manifest
    from eagle_train.target import load_tokenizer
    from eagle_train.train_config import load_train_config

    out = Path(args.out or tempfile.mkdtemp(prefix="bench-online-"))
    common = [
        f"target={args.target}",
        "ttt_length=3",
        "tokens_per_batch=2048",
        f"num_epochs={args.epochs}",
        "eval_fraction=0.1",
        "learning_rate=1e-3",
        "warmup_steps=2",
        "draft_vocab_size=4096",
        "report_to=none",
        "log_every=0",
    ]
    rows, figures = {}, {}

    t = time.perf_counter()
    store = out / "store"
    _, stats = distil(None, load_tokenizer(args.target), "sharegpt", store, target_name=args.target,
                      limit=args.conversations, max_length=args.max_length, max_new_tokens=args.max_new_tokens,
                      turns=1, engine="vllm", progress=False)  # fmt: skip
    distil_wall = time.perf_counter() - t
    engine_alone = stats["tokens"] / (stats["seconds"] - stats["engine_start_seconds"])
    store_bytes = sum(f.stat().st_size for f in store.glob("shard-*.safetensors"))

    t = time.perf_counter()
    offline = run(load_train_config(None, [*common, f"data_path={store}", f"output_dir={out / 'offline'}"]))
    rows["offline (distil + train)"] = (distil_wall + time.perf_counter() - t, offline, store_bytes)

    t = time.perf_counter()
    online_hf = run(load_train_config(None, [*common, "mode=online", f"data_path={store}", f"output_dir={out / 'hf'}"]))
    tokens_only = read_manifest(store)["num_tokens"] * (4 + 1)  # what a tokenized dataset of them holds: ids, mask
    rows["online-HF"] = (time.perf_counter() - t, online_hf, tokens_only)

    feed = [
        "mode=online",
        "engine=vllm",
        "data_path=sharegpt",
        f"num_conversations={args.conversations}",
        f"max_new_tokens={args.max_new_tokens}",
        f"max_length={args.max_length}",
        f"buffer_gib={args.buffer_gib}",
    ]
    t = time.perf_counter()
    online_vllm = run(load_train_config(None, [*common, *feed, f"output_dir={out / 'vllm'}"]))
    written = json.loads((out / "vllm" / "buffer" / "writer.json").read_text())
    rows["online-vLLM"] = (time.perf_counter() - t, online_vllm, written["peak_bytes"])

    print(f"{args.conversations} ShareGPT conversations, {args.max_new_tokens} new tokens, {args.epochs} epoch(s), "
          f"{args.target}; trainer 1 thread, engine on core {args.engine_core}")  # fmt: skip
    print(f"{'way':<26} {'wall s':>8} {'loop s':>8} {'tok/s':>8} {'peak disk MiB':>14} {'held-out sim AL':>16}")
    for name, (wall, result, disk) in rows.items():
        rate = trained(result) / loop_seconds(result)
        figures[name] = rate
        al = result["eval_after"]["sim_al"]
        print(f"{name:<26} {wall:8.1f} {loop_seconds(result):8.1f} {rate:8.0f} {disk / 2**20:14.1f} {al:16.3f}")
    slower = min(engine_alone, figures["offline (distil + train)"])
    print(f"engine alone {engine_alone:.0f} tok/s (distil without its start), trainer alone "
          f"{figures['offline (distil + train)']:.0f} tok/s (the offline loop): online-vLLM's loop is "
          f"{figures['online-vLLM'] / slower:.2f} x the slower; buffer cap {args.buffer_gib} GiB")  # fmt: skip


if __name__ == "__main__":
    main()
