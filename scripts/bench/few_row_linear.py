"""F.linear vs inference.llama.FewRowLinear at the row counts decoding multiplies, on the CPU.

    python scripts/bench/few_row_linear.py [--threads 2]

Sixty [1536, 576] fp32 weights (212 MB, beyond the caches, like a SmolLM2 MLP stack) are
multiplied by 1..17 rows; the best of 5 passes is printed, with the weight bandwidth it implies.
"""

import argparse
import time

import torch
import torch.nn.functional as F

from inference.llama import FewRowLinear


def best_ms(fn, layers, x, reps=5):
    for layer in layers:
        fn(layer, x)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for layer in layers:
            fn(layer, x)
        best = min(best, time.perf_counter() - t0)
    return best * 1000


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    linears = [torch.nn.Linear(576, 1536, bias=False).requires_grad_(False) for _ in range(60)]
    few = [FewRowLinear(m) for m in linears]
    gbytes = sum(m.weight.numel() for m in linears) * 4 / 1e9
    print(f"{len(linears)} x [1536, 576] fp32 = {gbytes * 1000:.0f} MB, {args.threads} threads")
    print(f"{'rows':>4s} {'F.linear ms':>12s} {'FewRowLinear ms':>16s} {'GB/s':>12s}")
    with torch.no_grad():
        for rows in (1, 2, 3, 4, 8, 17):
            x = torch.randn(1, rows, 576)
            a = best_ms(lambda m, x: F.linear(x, m.weight), linears, x)
            b = best_ms(lambda m, x: m(x), few, x)
            print(f"{rows:4d} {a:12.1f} {b:16.1f} {gbytes / a * 1e3:5.0f} -> {gbytes / b * 1e3:4.0f}")


if __name__ == "__main__":
    main()
