"""Benchmark hidden-state capture against a bare forward of the same batches.

    python scripts/bench/capture.py --num-conversations 100 --max-length 1024

Tokenizes N ShareGPT conversations for the target, then times, over the same length-sorted
batches: (1) a bare `model.model(...)` forward, (2) a bf16 capture into a store, (3) an fp8
capture. Prints tokens/s, the capture overhead over the bare forward, bytes per token of each
store, and the fp8 store's relative error against the bf16 one.
"""

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from data_prep.capture import capture, pad_batch, plan_shards
from data_prep.dataset import tokenize_dataset
from eagle_train.store import ShardedSamples
from eagle_train.target import SMOLLM2, load_target


def bare_forward_seconds(model, data: ShardedSamples, plan, pad_id: int) -> float:
    device = next(model.parameters()).device
    start = time.perf_counter()
    for shard in plan:
        for batch in shard:
            ids, mask = pad_batch([data.tokens(i) for i in batch], pad_id, device)
            with torch.no_grad():
                model.model(input_ids=ids, attention_mask=mask, use_cache=False)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def store_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("shard-*.safetensors"))


def fp8_error(bf16: ShardedSamples, fp8: ShardedSamples) -> dict:
    """Relative error ||fp8 - bf16|| / ||bf16|| over all tokens, and of the worst token, per tensor."""
    out = {}
    for key in ("aux_hidden", "final_hidden"):
        num = den = 0.0
        worst = 0.0
        for i in range(len(bf16)):
            a, b = fp8[i][key], bf16[i][key]
            num += float((a - b).pow(2).sum())
            den += float(b.pow(2).sum())
            worst = max(worst, float(((a - b).norm(dim=-1) / b.norm(dim=-1)).max()))
        out[key] = {"relative": (num / den) ** 0.5, "worst_token": worst}
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=SMOLLM2)
    p.add_argument("--data", default="sharegpt")
    p.add_argument("--num-conversations", type=int, default=100)
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--token-budget", type=int, default=8192)
    p.add_argument("--shard-tokens", type=int, default=1 << 16)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="target dtype (default fp32 on CPU, bf16 on CUDA)")
    p.add_argument("--repeats", type=int, default=1, help="time each variant this many times, keep the best")
    p.add_argument("--json", default=None, help="also write the results here")
    a = p.parse_args(argv)

    model, tokenizer = load_target(a.target, dtype=a.dtype, device=a.device)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        manifest, _, _ = tokenize_dataset(
            a.data, tmp / "tok", a.target, max_length=a.max_length, limit=a.num_conversations, tokenizer=tokenizer
        )
        data = ShardedSamples(tmp / "tok")
        tokens = manifest["num_tokens"]
        plan = plan_shards(data.lengths(), a.token_budget, a.shard_tokens)
        padded = sum(len(b) * max(data.lengths()[i] for i in b) for s in plan for b in s)
        print(
            f"{a.target} on {a.device} ({next(model.parameters()).dtype}): {len(data)} conversations, "
            f"{tokens} tokens, {sum(len(s) for s in plan)} batches (budget {a.token_budget}), "
            f"padding {100 * (padded / tokens - 1):.1f}%"
        )
        # warm up kernels / allocator on the longest batch
        bare_forward_seconds(model, data, [[plan[0][0]]], tokenizer.pad_token_id)
        results = {"tokens": tokens, "conversations": len(data), "device": a.device, "repeats": a.repeats}
        for _ in range(a.repeats):  # interleaved, best of each: a shared CPU's noise hits all three alike
            bare = bare_forward_seconds(model, data, plan, tokenizer.pad_token_id)
            results["bare_s"] = min(bare, results.get("bare_s", bare))
            for dtype in ("bfloat16", "float8_e4m3fn"):
                shutil.rmtree(tmp / dtype, ignore_errors=True)
                start = time.perf_counter()
                capture(
                    model,
                    tmp / "tok",
                    tmp / dtype,
                    target_name=a.target,
                    dtype=dtype,
                    token_budget=a.token_budget,
                    shard_tokens=a.shard_tokens,
                    pad_id=tokenizer.pad_token_id,
                    progress=False,
                )
                took = time.perf_counter() - start
                results[f"{dtype}_s"] = min(took, results.get(f"{dtype}_s", took))
                results[f"{dtype}_bytes_per_token"] = store_bytes(tmp / dtype) / tokens
        results["fp8_error_vs_bf16"] = fp8_error(
            ShardedSamples(tmp / "bfloat16"), ShardedSamples(tmp / "float8_e4m3fn")
        )

    bare = tokens / results["bare_s"]
    print(f"bare forward       {bare:10.0f} tok/s  ({results['bare_s']:.1f}s)")
    for dtype in ("bfloat16", "float8_e4m3fn"):
        rate = tokens / results[f"{dtype}_s"]
        print(
            f"capture {dtype:13s}{rate:8.0f} tok/s  ({results[f'{dtype}_s']:.1f}s, "
            f"{100 * (results[f'{dtype}_s'] / results['bare_s'] - 1):+.1f}% vs bare), "
            f"{results[f'{dtype}_bytes_per_token']:.0f} bytes/token"
        )
    for key, err in results["fp8_error_vs_bf16"].items():
        print(
            f"fp8 vs bf16 {key:12s} relative error {100 * err['relative']:.2f}% "
            f"(worst token {100 * err['worst_token']:.2f}%)"
        )
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
