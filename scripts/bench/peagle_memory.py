"""Peak memory of one P-EAGLE training step with and without sequence partitioning.

    python scripts/bench/peagle_memory.py --max-length 2048 --num-depths 7 --segments 1,2,4

A synthetic micro-batch (one sequence of `--max-length` tokens, every token an assistant token,
random aux states and target distribution) through a SmolLM2-sized head (hidden 576, 9/3 heads,
N=2 layers, 32k draft vocabulary): one forward+backward of `PEagleObjective` per segment count.
On CUDA the peak is `torch.cuda.max_memory_allocated` above what the step started with; on CPU
each segment count runs in its own process and the peak is its maximum resident set size
(getrusage) above the resident size just before the step. Also prints the step's seconds, the
element count and the largest segment (elements computed by one forward).
"""

import argparse
import json
import multiprocessing as mp
import resource
import time

import torch

from eagle_train.draft_config import DraftConfig
from eagle_train.methods.peagle import batch as pb
from eagle_train.methods.peagle.config import NUM_DEPTHS
from eagle_train.methods.peagle.head import PEagleHead
from eagle_train.methods.peagle.train import PEagleObjective
from eagle_train.vocab_map import DRAFT_VOCAB_SIZE


def smollm2_sized_head(num_depths: int, layers: int, draft_vocab: int) -> PEagleHead:
    cfg = DraftConfig(
        hidden_size=576,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        intermediate_size=1536,
        vocab_size=49152,
        draft_vocab_size=draft_vocab,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        rope_scaling=None,
        max_position_embeddings=8192,
        target_hidden_size=576,
        target_num_layers=30,
        aux_layer_ids=(2, 15, 27),
        num_hidden_layers=layers,
        method="peagle",
        mask_token_id=16,
        num_depths=num_depths,
    )
    return PEagleHead(cfg)


def synthetic_batch(length: int, head: PEagleHead, device):
    g = torch.Generator().manual_seed(0)
    vd = head.config.draft_vocab_size
    probs = torch.softmax(torch.randn(1, length, vd, generator=g) * 3, -1)
    return {
        "input_ids": torch.randint(17, 49152, (1, length), generator=g).to(device),
        "loss_mask": torch.ones(1, length, dtype=torch.bool, device=device),
        "aux_hidden": torch.randn(1, length, 3 * 576, generator=g).to(device),
        "target_probs": probs.to(device),
        "in_draft": torch.ones(1, length, dtype=torch.bool, device=device),
    }


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def measure(args, segments: int) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    torch.manual_seed(0)
    head = smollm2_sized_head(args.num_depths, args.layers, args.draft_vocab).to(device)
    batch = synthetic_batch(args.max_length, head, device)
    objective = PEagleObjective(args.num_depths, segments)
    run = lambda fn, *a: fn(head, *a)  # noqa: E731  (the trainer's HeadRunner protocol)
    torch.manual_seed(1)
    elements = pb.build_elements(
        batch["loss_mask"], batch["in_draft"], torch.tensor([args.max_length]), args.num_depths
    )
    largest = max(s.anchor.shape[1] for s in pb.partition(elements, segments, args.max_length))
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = rss_bytes()
    start = time.perf_counter()
    torch.manual_seed(1)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        metrics = objective(run, batch, lambda loss: loss.backward())
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    return {
        "segments": segments,
        "device": device.type,
        "peak_mib": round(peak / 2**20),
        "seconds": round(time.perf_counter() - start, 2),
        "elements": int(elements.anchor.shape[1]),
        "largest_segment": largest,
        "loss": round(float(metrics["loss"]), 4),
    }


def child(args, segments, queue):
    queue.put(measure(args, segments))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--num-depths", type=int, default=NUM_DEPTHS)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--draft-vocab", type=int, default=DRAFT_VOCAB_SIZE)
    p.add_argument("--segments", default="1,2,4", help="comma-separated segment counts to compare")
    p.add_argument("--cpu", action="store_true", help="measure on CPU even when CUDA is available")
    p.add_argument("--json", help="also write the rows to this file")
    args = p.parse_args(argv)
    counts = [int(s) for s in args.segments.split(",")]
    default = pb.default_num_segments(args.max_length, args.num_depths)
    print(
        f"P-EAGLE step, max length {args.max_length}, K={args.num_depths}, N={args.layers} layers, "
        f"draft vocab {args.draft_vocab}; default segments: {default}"
    )
    rows = []
    for s in counts:
        if torch.cuda.is_available() and not args.cpu:
            row = measure(args, s)
        else:  # ru_maxrss is a lifetime peak: one process per measurement
            ctx = mp.get_context("spawn")
            queue = ctx.Queue()
            proc = ctx.Process(target=child, args=(args, s, queue))
            proc.start()
            row = queue.get()
            proc.join()
        rows.append(row)
        print(
            f"segments {row['segments']}: peak +{row['peak_mib']} MiB ({row['device']}), {row['seconds']} s, "
            f"{row['elements']} elements, largest forward {row['largest_segment']} elements, loss {row['loss']}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
