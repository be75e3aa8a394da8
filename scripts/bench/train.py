"""Training throughput of the EAGLE-3 head: tokens/s, peak memory and (on CUDA) model FLOPs utilisation.

    python scripts/bench/train.py                                  # SmolLM2 head on this machine
    python scripts/bench/train.py --tokens-per-batch 32768 --peak-tflops 989   # H100 SXM bf16 dense

Synthetic batches (random aux states and target hidden states) of the shape a real run sees, so the
number is the head's own cost: one step = target distribution from final hidden states + TTT
forward/backward + clip + AdamW, exactly the trainer's per-micro-batch work without data loading.
MFU counts the head's forward+backward matmul FLOPs (3x forward; recomputation under
--gradient-checkpointing is not counted as useful work) against --peak-tflops.
"""

import argparse
import contextlib
import resource
import time

import torch

from eagle_train.hidden_states import TargetLogits
from eagle_train.methods.eagle3.head import Eagle3Head
from eagle_train.methods.eagle3.ttt import ttt_loss
from eagle_train.target import load_target
from eagle_train.train_config import TTT_LENGTH
from eagle_train.training_parts import target_distribution
from eagle_train.vocab_map import DRAFT_VOCAB_SIZE


def head_forward_flops(cfg, batch: int, seq: int, ttt_length: int) -> float:
    """Matmul FLOPs of one TTT forward: fc once, then per step the layer, the attention and lm_head."""
    h, d = cfg.hidden_size, cfg.head_dim
    tokens = batch * seq
    fc = 2 * tokens * 3 * cfg.target_hidden_size * h
    qkv = 2 * tokens * 2 * h * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d
    o = 2 * tokens * cfg.num_attention_heads * d * h
    mlp = 2 * tokens * 3 * h * cfg.intermediate_size
    lm_head = 2 * tokens * h * cfg.draft_vocab_size
    attention = 2 * 2 * batch * cfg.num_attention_heads * d * seq * (seq + 1) / 2  # causal QK^T and PV
    return fc + ttt_length * (qkv + o + mlp + lm_head + attention)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--tokens-per-batch", type=int, default=2048)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--ttt-length", type=int, default=TTT_LENGTH)
    p.add_argument("--draft-vocab-size", type=int, default=DRAFT_VOCAB_SIZE)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="accelerator peak (H100 SXM bf16 dense: 989)")
    args = p.parse_args()

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    target, _ = load_target(args.target, device=device)
    torch.manual_seed(0)
    head = Eagle3Head.from_target(target, draft_vocab_size=args.draft_vocab_size).float().to(device)
    cfg = head.config
    target_logits = TargetLogits.of(target, device, torch.float32)
    batch = max(1, args.tokens_per_batch // args.seq_len)
    shape = (batch, args.seq_len)
    aux = torch.randn(*shape, 3 * cfg.target_hidden_size, device=device)
    final = torch.randn(*shape, cfg.target_hidden_size, device=device)
    ids = torch.randint(0, cfg.vocab_size, shape, device=device)
    mask = torch.ones(shape, dtype=torch.bool, device=device)
    params = [q for q in head.parameters() if q.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5, betas=(0.9, 0.95), fused=cuda)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()

    def sync():
        if cuda:
            torch.cuda.synchronize()

    step_times, fwd_bwd_times = [], []
    for step in range(args.warmup + args.steps):
        sync()
        t0 = time.perf_counter()
        probs, in_draft = target_distribution(final, target_logits, head.t2d)
        in_draft = torch.ones_like(in_draft)  # random states rarely pick draft ids; supervise every position
        sync()
        t1 = time.perf_counter()
        with autocast:
            loss, _ = ttt_loss(
                head, aux, ids, mask, probs, in_draft, args.ttt_length, checkpoint_logits=args.gradient_checkpointing
            )
        loss.backward()
        sync()
        t2 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        if step >= args.warmup:
            step_times.append(time.perf_counter() - t0)
            fwd_bwd_times.append(t2 - t1)

    tokens = batch * args.seq_len
    step_s = sorted(step_times)[len(step_times) // 2]
    fb_s = sorted(fwd_bwd_times)[len(fwd_bwd_times) // 2]
    print(
        f"device {torch.cuda.get_device_name() if cuda else f'cpu ({torch.get_num_threads()} threads)'}, "
        f"{'bf16 autocast' if cuda else 'fp32'}; head H={cfg.hidden_size} Vd={cfg.draft_vocab_size}, "
        f"ttt_length {args.ttt_length}, batch {batch} x {args.seq_len} tokens"
        f"{', logit checkpointing' if args.gradient_checkpointing else ''}"
    )
    print(
        f"training step: {tokens / step_s:,.0f} tokens/s ({step_s * 1e3:.1f} ms/step, median of {args.steps}); "
        f"head fwd+bwd alone {tokens / fb_s:,.0f} tokens/s"
    )
    if cuda:
        flops = 3 * head_forward_flops(cfg, batch, args.seq_len, args.ttt_length)
        print(
            f"peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB; head fwd+bwd "
            f"{flops / fb_s / 1e12:.1f} TFLOP/s = {100 * flops / fb_s / 1e12 / args.peak_tflops:.1f}% MFU "
            f"of {args.peak_tflops:g} TFLOP/s"
        )
    else:
        print(
            f"peak process memory (RSS, incl. the target) "
            f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB"
        )


if __name__ == "__main__":
    main()
