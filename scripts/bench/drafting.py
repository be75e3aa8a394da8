"""Drafting time per speculative step: EAGLE-3 chain drafting vs P-EAGLE parallel drafting.

    python scripts/bench/drafting.py --eagle3 runs/eagle3_smollm2/final --peagle runs/peagle_smollm2/final \
        --target smollm2-135m --ks 3,5,7

One step is what the runtime does between two verifications: the catch-up over the accepted
tokens (`--accepted`, padded to the fixed size the CUDA graphs use) plus the drafting of K tokens.
EAGLE-3 (`inference.drafting.Drafter`): the catch-up forward and K-1 sequential one-token steps.
P-EAGLE (`inference.parallel_drafting.ParallelDrafter`): one forward over the catch-up rows and
the K-1 mask rows. Without --eagle3/--peagle, heads of the target's size with random weights are
timed (the cost does not depend on the weights; only the target's config is read). On CUDA the
draft steps run as CUDA graphs, as in the runtime. Reports the median of `--repeats` steps after
warm-up, in milliseconds, at a context of `--context` committed tokens.
"""

import argparse
import statistics
import time

import torch

from eagle_train.checkpoint import load_draft_head
from eagle_train.methods.eagle3.head import Eagle3Head
from eagle_train.methods.peagle.head import PEagleHead
from eagle_train.target import load_target, load_target_config
from inference.drafting import Drafter, TreeShape
from inference.graphs import GraphedStep
from inference.parallel_drafting import ParallelDrafter
from inference.sampling import Sampler


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def step_ms(drafter, aux, ids, start, repeats, device) -> float:
    times = []
    for i in range(repeats + 3):
        sync(device)
        t0 = time.perf_counter()
        h, logits = drafter.catch_up_padded(aux, ids, start)
        drafter.draft(ids[0, -1], None if h is None else h, logits, start + ids.shape[1])
        sync(device)
        if i >= 3:  # warm-up
            times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--eagle3", help="EAGLE-3 head (default: random weights, target-sized)")
    p.add_argument("--peagle", help="P-EAGLE head (default: random weights, target-sized, 2 layers below hidden 2048)")
    p.add_argument("--ks", default="3,5,7", help="draft counts K")
    p.add_argument("--accepted", type=int, default=2, help="tokens accepted per step (catch-up rows)")
    p.add_argument("--context", type=int, default=512, help="committed tokens before the step")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--device", default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    ks = [int(k) for k in args.ks.split(",")]
    if args.eagle3 or args.peagle:
        model, _ = load_target(args.target, device=device)
    else:  # random heads need only the target's sizes and an embedding to copy
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(load_target_config(args.target)).to(device)
        model = model.to(torch.bfloat16 if device.type == "cuda" else torch.float32)
    dtype = model.dtype
    eagle3 = load_draft_head(args.eagle3, model) if args.eagle3 else Eagle3Head.from_target(model)
    peagle = (
        load_draft_head(args.peagle, model)
        if args.peagle
        else PEagleHead.from_target(model, mask_token_id=0, num_depths=max(ks))
    )
    g = torch.Generator().manual_seed(0)
    h3 = 3 * model.config.hidden_size
    print(
        f"drafting time per step on {device} {str(dtype).replace('torch.', '')}: context {args.context}, "
        f"{args.accepted} accepted tokens per step, P-EAGLE N={peagle.config.num_hidden_layers} layers"
    )
    print(f"{'K':>3} {'EAGLE-3 chain ms':>17} {'P-EAGLE parallel ms':>20} {'ratio':>6}")
    for k in ks:
        row = []
        for head, cls in ((eagle3, Drafter), (peagle, ParallelDrafter)):
            head = head.to(device=device, dtype=dtype).eval()
            step = GraphedStep(head.step) if device.type == "cuda" else head.step  # as the runtime does
            drafter = cls(head, TreeShape.chain(k), Sampler(), step)
            drafter.setup_cache(args.context + 4 * k + 8)
            n = args.accepted + 1
            aux = torch.randn(1, n, h3, generator=g).to(device, dtype)
            ids = torch.randint(0, model.config.vocab_size, (1, n), generator=g).to(device)
            with torch.inference_mode():
                row.append(step_ms(drafter, aux, ids, args.context, args.repeats, device))
        print(f"{k:>3} {row[0]:>17.2f} {row[1]:>20.2f} {row[0] / row[1]:>6.2f}")


if __name__ == "__main__":
    main()
