"""Wall time and tokens/s of one small EAGLE-3 run under each training backend.

    python scripts/bench/distributed.py --data-path <store> [--backends one ddp zero2 zero3] [--steps 12]

Every backend trains the same run: the same data, seed and global batch (one process accumulates
as many micro-batches as the others have processes), launched with `accelerate launch` as a user
would. The table gives the command's wall time (start-up included), the median tokens/s of the
steps after the first (the first pays for set-up and allocations), and the last loss, which must
agree across backends. FSDP runs on GPUs
only (accelerate's rule); on a CPU this machine's cores are shared by the processes, so the figures
compare overheads, not scaling.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from eagle_train.train_checkpoint import newest_checkpoint

REPO = Path(__file__).resolve().parents[2]
LAUNCH = {
    "one": ["--num_processes", "1"],
    "ddp": ["--multi_gpu", "--num_processes", "2", "--mixed_precision", "no"],
    "fsdp": ["--config_file", "configs/accelerate/fsdp.yaml", "--num_processes", "2"],
    "zero2": ["--config_file", "configs/accelerate/deepspeed_zero2.yaml", "--num_processes", "2"],
    "zero3": ["--config_file", "configs/accelerate/deepspeed_zero3.yaml", "--num_processes", "2"],
}


def run(backend: str, args, out: Path) -> dict:
    overrides = [
        f"data_path={args.data_path}",
        f"output_dir={out}",
        f"max_steps={args.steps}",
        f"tokens_per_batch={args.tokens_per_batch}",
        f"max_length={args.max_length}",
        f"draft_vocab_size={args.draft_vocab_size}",
        f"gradient_accumulation_steps={2 if backend == 'one' else 1}",
        "eval_fraction=0",
        "report_to=none",
        "log_every=0",
    ]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *LAUNCH[backend], "--num_machines", "1"]
    cmd += ["--dynamo_backend", "no", "scripts/train_eagle3.py", *overrides]
    threads = str(max(1, (os.cpu_count() or 2) // (1 if backend == "one" else 2)))
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": threads})
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        return {"backend": backend, "error": proc.stderr.strip().splitlines()[-1]}
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["split"] == "train"]
    _, state = newest_checkpoint(out)
    return {
        "backend": backend,
        "processes": state["num_processes"],
        "wall_s": wall,
        "tok_s": statistics.median(r["tokens_per_s"] for r in steps[1:]),
        "tokens": state["tokens_consumed"],
        "last_loss": steps[-1]["loss"],
    }


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-path", required=True, help="a hidden-state store (eagle-prep capture)")
    p.add_argument("--backends", nargs="+", default=["one", "ddp", "zero2", "zero3"], choices=list(LAUNCH))
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--tokens-per-batch", type=int, default=1024, help="per micro-batch and process")
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--draft-vocab-size", type=int, default=8192)
    args = p.parse_args()
    print(f"{'backend':8s} {'procs':>5s} {'wall s':>7s} {'tok/s':>7s} {'tokens':>7s} {'last loss':>10s}")
    with tempfile.TemporaryDirectory() as tmp:
        for backend in args.backends:
            r = run(backend, args, Path(tmp) / backend)
            if "error" in r:
                print(f"{backend:8s} failed: {r['error']}")
                continue
            print(
                f"{backend:8s} {r['processes']:5d} {r['wall_s']:7.1f} {r['tok_s']:7.0f} "
                f"{r['tokens']:7d} {r['last_loss']:10.4f}"
            )


if __name__ == "__main__":
    main()
