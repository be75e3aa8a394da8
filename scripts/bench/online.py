"""Three ways to feed training, at the same data: offline (a vLLM-distilled store, then training on it), online-HF (the
target runs in the training process) and online-vLLM (a vLLM engine makes the samples while the head trains,
through a bounded buffer; data_prep/feed.py).

    python scripts/bench/online.py --conversations 64 --max-new-tokens 64 --engine-core 1

The same ShareGPT first turns, answered greedily by the target (SmolLM2 unless --target), train the same EAGLE-3
head config for --epochs. The trainer runs one thread; the vLLM engine is bound to --engine-core. Prints per way
the wall seconds of all it takes (offline: distil, then training; online-vLLM: the engine's start too), the tokens
trained and their rate over that wall, the peak bytes on disk (online-HF: those of a tokenized dataset of the same
tokens, ids and masks) and the held-out simulated AL after training. Then, in samples per second without the
engine's start: the engine alone (distil), the trainer alone (training on the store) and online-vLLM, over the
slower of the two, over the whole run and over its training steps alone (without the engine's start, the held-out
samples made before the first step and those of its last call trained after it): the overlap is real when that is
near 1 or above.
"""

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch


def state_of(result) -> dict:
    return json.loads((result["checkpoint"] / "trainer_state.json").read_text())


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
    p.add_argument("--ttt-length", type=int, default=7)
    p.add_argument("--engine-batch", type=int, default=32, help="engine_batch_size of online-vLLM")
    p.add_argument("--draft-vocab", type=int, default=16384)
    p.add_argument("--out", default=None, help="a directory for the runs (default: a temporary one)")
    args = p.parse_args(argv)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = args.engine_core
    torch.set_num_threads(1)

    from data_prep.distil import distil
    from eagle_cli.train import run
    from eagle_train.store import ShardedSamples, read_manifest
    from eagle_train.target import load_tokenizer
    from eagle_train.train_config import load_train_config

    out = Path(args.out or tempfile.mkdtemp(prefix="bench-online-"))
    common = [
        f"target={args.target}",
        f"ttt_length={args.ttt_length}",
        "tokens_per_batch=2048",
        f"num_epochs={args.epochs}",
        "eval_fraction=0.1",
        "learning_rate=1e-3",
        "warmup_steps=2",
        f"draft_vocab_size={args.draft_vocab}",
        "report_to=none",
        "log_every=0",
    ]
    rows = {}

    t = time.perf_counter()
    store = out / "store"
    _, stats = distil(None, load_tokenizer(args.target), "sharegpt", store, target_name=args.target,
                      limit=args.conversations, max_length=args.max_length, max_new_tokens=args.max_new_tokens,
                      turns=1, engine="vllm", progress=False)  # fmt: skip
    distil_wall = time.perf_counter() - t
    store_bytes = sum(f.stat().st_size for f in store.glob("shard-*.safetensors"))

    t = time.perf_counter()
    offline = run(load_train_config(None, [*common, f"data_path={store}", f"output_dir={out / 'offline'}"]))
    trainer_wall = time.perf_counter() - t
    rows["offline (distil + train)"] = (distil_wall + trainer_wall, offline, store_bytes)

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
        f"engine_batch_size={args.engine_batch}",
    ]
    t = time.perf_counter()
    online_vllm = run(load_train_config(None, [*common, *feed, f"output_dir={out / 'vllm'}"]))
    written = json.loads((out / "vllm" / "buffer" / "writer.json").read_text())
    rows["online-vLLM"] = (time.perf_counter() - t, online_vllm, written["peak_bytes"])

    samples = len(ShardedSamples(store))
    print(f"{samples} ShareGPT conversations (first turns), {args.max_new_tokens} new tokens, {args.epochs} epoch(s), "
          f"{args.target}, EAGLE-3 ttt_length {args.ttt_length}, draft vocab {args.draft_vocab}; trainer 1 thread, "
          f"engine on core {args.engine_core}")  # fmt: skip
    print(f"{'way':<26} {'wall s':>8} {'tokens':>8} {'tok/s':>8} {'peak disk MiB':>14} {'held-out sim AL':>16}")
    for name, (wall, result, disk) in rows.items():
        tokens = trained(result)
        al = result["eval_after"]["sim_al"]
        print(f"{name:<26} {wall:8.1f} {tokens:8d} {tokens / wall:8.0f} {disk / 2**20:14.2f} {al:16.3f}")
    engine_alone = samples / (stats["seconds"] - stats["engine_start_seconds"])
    trainer_alone = samples / trainer_wall
    online = samples / (rows["online-vLLM"][0] - written["engine_start_seconds"])
    print(f"samples/s, the engine's start left out: engine alone {engine_alone:.2f} (distil), trainer alone "
          f"{trainer_alone:.2f} (training on the store), online-vLLM {online:.2f}: "
          f"{online / min(engine_alone, trainer_alone):.2f} x the slower; cap {args.buffer_gib} GiB")  # fmt: skip
    steps = {name: sum(m["tokens"] / m["tokens_per_s"] for m in row[1]["history"]) for name, row in rows.items()}
    trained_samples = state_of(online_vllm)["samples_consumed"]
    loop, loop_alone = trained_samples / steps["online-vLLM"], trained_samples / steps["offline (distil + train)"]
    print(f"in the training steps alone (their waits for samples included): trainer alone {loop_alone:.2f}, "
          f"online-vLLM {loop:.2f} samples/s: {loop / min(engine_alone, loop_alone):.2f} x the slower")  # fmt: skip


if __name__ == "__main__":
    main()
