"""One GPU benchmark run: decoding, capture, training and kernels side by side (docs/performance.md).

    python3 scripts/bench/gpu.py --target T.gguf --eagle3 HEAD --peagle HEAD --data TOKENIZED --out bench.json
    python3 scripts/bench/gpu.py --only kernels --out kernels.json          # needs no target

Sections (`--only` picks some; each prints a table and goes into the JSON):
- kernels: HBM copy bandwidth, a large bf16 matmul, and the TTT loss over a 32k draft vocabulary
  fwd+bwd as written in eagle_train/ttt.py (log_softmax) vs eagle_train/fused_ce (chunked, Triton).
- decode: tokens/s at batch 1 on the bench prompts for HF `generate`, the runtime's plain decoding,
  EAGLE-3 chains and a tree, P-EAGLE; AL, speedup over plain and over HF, speedup / AL; the roofline
  (plain decoding vs weight bytes / HBM bandwidth).
- capture: tokens/s of a bare target forward vs `target_hidden_states` vs the capture path
  (`data_prep.capture.capture_batch` + the store writer).
- train: EAGLE-3 TTT training tokens/s on real batches and the head's MFU (fwd+bwd FLOPs counted by
  torch's FlopCounterMode / step time / the GPU's bf16 dense peak).
Everything runs through the project's own functions (inference.generate.Runtime, eagle_train.methods.eagle3.ttt,
data_prep.capture); nothing here is a second implementation.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

H100_BF16_DENSE_FLOPS = 989e12  # H100 SXM, bf16 dense tensor cores (the 1979 TFLOP/s figure assumes sparsity)
H100_HBM_BYTES_PER_S = 3.35e12  # H100 SXM HBM3
SECTIONS = ("kernels", "train", "capture", "decode")  # run in this order; decode (the longest) last


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, repeat: int = 5, warmup: int = 1) -> float:
    """Median seconds of `fn()` over `repeat` runs after `warmup` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def table(title: str, header: list[str], rows: list[list]) -> str:
    cells = [header] + [[f"{c:.3g}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = [title] + ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ kernels


def bench_kernels(args, device) -> dict:
    from eagle_train.fused_ce import soft_cross_entropy, triton
    from eagle_train.vocab_map import DRAFT_VOCAB_SIZE

    cuda = device.type == "cuda"
    out = {}
    n_bytes = (1 << 30) if cuda else (64 << 20)
    src = torch.empty(n_bytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    t = timed(lambda: dst.copy_(src), device, repeat=10)
    out["copy_bandwidth_bytes_per_s"] = 2 * n_bytes / t  # read + write
    m = 8192 if cuda else 512
    a = torch.randn(m, m, dtype=torch.bfloat16 if cuda else torch.float32, device=device)
    t = timed(lambda: a @ a, device, repeat=10)
    out["matmul_flops_per_s"] = 2 * m**3 / t
    out["matmul_size"] = m

    # The TTT loss of one step: N tokens, H=576 (SmolLM2), the default Vd, hidden bf16 under autocast.
    n, h, vd = (args.loss_tokens, 576, DRAFT_VOCAB_SIZE) if cuda else (256, 64, 2000)
    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(n, h, device=device, generator=g)
    weight = (torch.randn(vd, h, device=device, generator=g) * 0.05).requires_grad_(True)
    probs = torch.softmax(torch.randn(n, vd, device=device, generator=g) * 3, dim=-1)
    supervised = torch.rand(n, device=device, generator=g) < 0.7

    def reference(tv_weight):  # eagle_train.methods.eagle3.ttt.step_loss
        def run():
            logits = torch.nn.functional.linear(x, weight)
            logp = torch.log_softmax(logits.float(), dim=-1)
            loss = -(probs * logp).sum(-1)
            if tv_weight:
                loss = (1 - tv_weight) * loss + tv_weight * 0.5 * (probs - logp.exp()).abs().sum(-1)
            correct = (logits.argmax(-1) == probs.argmax(-1))[supervised].sum()
            return loss[supervised].sum(), correct

        return run

    def fused(impl, tv_weight):
        def run():
            loss, agree = soft_cross_entropy(x, weight, probs, impl=impl, tv_weight=tv_weight)
            return (loss * supervised).sum(), (agree & supervised).sum()

        return run

    # the soft cross-entropy alone, then mixed half and half with total variation (tv_weight
    # 0.5, a second pass over the vocabulary); each implementation is compared with the log_softmax one of its loss
    groups = {"ttt_step_loss": 0.0, "ttt_step_loss_tv": 0.5}
    rows = []
    for key, tv in groups.items():
        impls = {"log_softmax (ttt.step_loss)": reference(tv), "fused_ce chunked": fused("chunked", tv)}
        if cuda and triton is not None:
            impls["fused_ce triton"] = fused("triton", tv)
        results, ref = {}, None
        for name, fn in impls.items():
            x = hidden.clone().requires_grad_(True)
            weight.grad = None

            def fwd_bwd():
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                    loss, correct = fn()  # noqa: B023 (called within this iteration)
                loss.backward()
                return loss, correct

            label = f"{name}, tv_weight {tv:g}"
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            try:
                t = timed(fwd_bwd, device, repeat=args.repeat)
                peak = (torch.cuda.max_memory_allocated() - base) if cuda else 0
                x.grad, weight.grad = None, None
                loss, correct = fwd_bwd()
            except Exception as e:  # e.g. a Triton kernel this GPU cannot compile: record it, time the others
                results[name] = {"error": f"{type(e).__name__}: {e}"}
                rows.append([label, "error", f"{type(e).__name__}: {str(e)[:60]}", "", "", "", "", ""])
                continue
            value = (float(loss.detach()), int(correct), x.grad.float().clone(), weight.grad.float().clone())
            if ref is None:
                ref = value
            err = max(float((value[2] - ref[2]).abs().max()), float((value[3] - ref[3]).abs().max()))
            rel = max(
                float((value[2] - ref[2]).norm() / ref[2].norm()), float((value[3] - ref[3]).norm() / ref[3].norm())
            )
            results[name] = {
                "seconds": t,
                "tokens_per_s": n / t,
                "peak_bytes": peak,
                "loss": value[0],
                "correct": value[1],
                "max_grad_diff_vs_log_softmax": err,
                "rel_grad_diff_vs_log_softmax": rel,
            }
            rows.append([label, t * 1e3, n / t, peak / 2**30, value[0], value[1], err, rel])
        out[key] = {"tokens": n, "hidden": h, "draft_vocab": vd, "tv_weight": tv, "impls": results}
    print(
        table(
            f"\n== kernels: HBM copy {out['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s (spec "
            f"{H100_HBM_BYTES_PER_S / 1e12} TB/s), bf16 matmul {m}^3 {out['matmul_flops_per_s'] / 1e12:.0f} "
            f"TFLOP/s (dense peak {H100_BF16_DENSE_FLOPS / 1e12:.0f})\n"
            f"   one TTT step's loss, {n} tokens x {vd} draft vocab, forward+backward:",
            ["impl", "ms", "tok/s", "peak GiB", "loss", "top-1", "max |dgrad|", "rel dgrad"],
            rows,
        )
    )
    return out


# ------------------------------------------------------------------------------------ decode


def decode_weight_bytes(model) -> int:
    """Bytes a decoding step must read: every decoder weight, the final norm and the lm_head
    (the input embedding is a one-row lookup unless it is the tied lm_head)."""
    embed = model.get_input_embeddings().weight
    lm_head = model.get_output_embeddings().weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if embed.data_ptr() != lm_head.data_ptr():
        total -= embed.numel() * embed.element_size()
    return total


def bench_decode(args, device, model, tokenizer, save=lambda partial: None) -> dict:
    from eagle_train.checkpoint import load_draft_head
    from eagle_train.target import end_of_turn_ids
    from inference.drafting import TreeShape
    from inference.evaluate import BENCHES, add_drafter, identical_note, load_bench, run_bench, summarise
    from inference.generate import Runtime
    from inference.runtime_eval import RuntimeEngine

    eos = end_of_turn_ids(model, tokenizer)
    plain_rt = Runtime(model, None, eos_token_ids=eos)
    plain_rt.generate_plain(tokenizer("Hello")["input_ids"], 8)  # graph capture
    # every turn of the first --prompts prompts of each bench, plainly; a later turn follows the plain answer
    plain_only = RuntimeEngine(plain_rt, {}, tokenizer)
    results = {b: run_bench(plain_only, tokenizer, load_bench(b, args.prompts), args.max_new_tokens) for b in BENCHES}
    turns = {b: [t for r in rs for t in r["turns"]] for b, rs in results.items()}
    all_turns = [t for b in turns.values() for t in b]
    plain_tokens = sum(t["plain"]["tokens"] for t in all_turns)
    plain_seconds = sum(t["plain"]["seconds"] for t in all_turns)
    plain_tps = plain_tokens / plain_seconds
    out = {
        "prompts_per_bench": args.prompts,
        "max_new_tokens": args.max_new_tokens,
        "turns": len(all_turns),
        "plain": {
            "tokens": plain_tokens,
            "seconds": plain_seconds,
            "tokens_per_s": plain_tps,
            "per_bench": {
                b: sum(t["plain"]["tokens"] for t in ts) / sum(t["plain"]["seconds"] for t in ts)
                for b, ts in turns.items()
            },
        },
    }

    # HF generate on the first turns of a subset (it is ~10x slower), against plain on the same turns
    subset = [ts[i] for ts in turns.values() for i in range(min(args.hf_prompts, len(ts)))]
    hf_tokens, hf_seconds = 0, 0.0
    for i, t in enumerate(subset):
        ids = torch.tensor([t["prompt_ids"]], device=device)
        n = t["plain"]["tokens"]
        sync(device)
        t0 = time.perf_counter()
        gen = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
        sync(device)
        if i > 0:  # the first call pays one-time costs
            hf_tokens += gen.shape[1] - ids.shape[1]
            hf_seconds += time.perf_counter() - t0
    sub_plain = subset[1:]
    sub_plain_tps = sum(t["plain"]["tokens"] for t in sub_plain) / max(
        sum(t["plain"]["seconds"] for t in sub_plain), 1e-9
    )
    hf_tps = hf_tokens / hf_seconds if hf_seconds else float("nan")
    out["hf_generate"] = {
        "turns": len(sub_plain),
        "tokens_per_s": hf_tps,
        "plain_tokens_per_s_same_turns": sub_plain_tps,
    }

    configs = []
    if args.eagle3:
        configs += [("eagle3", f"chain K={k}", args.eagle3, TreeShape.chain(k)) for k in args.chain]
        if args.tree:
            configs.append(("eagle3", f"tree {args.tree}", args.eagle3, TreeShape.parse(args.tree)))
    if args.peagle:
        configs += [("peagle", f"parallel K={k}", args.peagle, TreeShape.chain(k)) for k in args.parallel]
    # most wanted first (results are saved after each shape, so a time limit costs the last ones):
    # the middle chain of each head, then the tree, then the other chain lengths
    middle = {
        "eagle3": f"chain K={args.chain[len(args.chain) // 2]}" if args.chain else "",
        "peagle": f"parallel K={args.parallel[-1]}" if args.parallel else "",
    }
    configs.sort(key=lambda c: (c[1] != middle[c[0]], "tree" not in c[1]))
    heads = {}
    rows = [
        ["HF generate", "", "", hf_tps, hf_tps / sub_plain_tps, 1.0, "", ""],
        ["plain (runtime)", "", "", plain_tps, 1.0, sub_plain_tps / hf_tps, "", ""],
    ]
    out["speculative"] = []
    for method, name, path, shape in configs:
        try:
            if path not in heads:
                heads[path] = load_draft_head(path, model).to(device=device, dtype=model.dtype).eval()
            rt = Runtime(model, heads[path], shape, eos_token_ids=eos)
            rt.generate(all_turns[0]["prompt_ids"], 8)  # graph capture
            engine = RuntimeEngine(plain_rt, {name: rt.generate}, tokenizer)
            for rs in results.values():
                add_drafter(rs, engine, name, args.max_new_tokens)
        except Exception as e:  # e.g. a head the runtime cannot drive yet: the other shapes still run
            out["speculative"].append(
                {"method": method, "drafting": name, "head": str(path), "error": f"{type(e).__name__}: {e}"}
            )
            rows.append([f"{method} {name}", "error", f"{type(e).__name__}: {str(e)[:60]}", "", "", "", "", ""])
            print(f"{method} {name}: {type(e).__name__}: {e}", file=sys.stderr)
            continue
        s = summarise([r for rs in results.values() for r in rs], shape.depth, name)
        al, tps, speedup, identical = (
            s["acceptance_length"],
            s["spec_tokens_per_s"],
            s["speedup"],
            s["turns_identical_to_plain"],
        )
        record = {
            "method": method,
            "drafting": name,
            "head": str(path),
            "acceptance_length": al,
            "acceptance_rates": s["acceptance_per_position_conditional"],
            "tokens_per_s": tps,
            "speedup_vs_plain": speedup,
            "speedup_vs_hf": tps / hf_tps,
            "speedup_over_al": speedup / al,
            "identical_to_plain": identical,
            **{k: s[k] for k in ("turns_parting_at_ties", "turns_parting_unexplained", "largest_gap_rounding_steps")},
            "turns": len(all_turns),
        }
        out["speculative"].append(record)
        save(out)
        rows.append(
            [
                f"{method} {name}",
                al,
                " ".join(f"{a:.2f}" for a in record["acceptance_rates"]),
                tps,
                speedup,
                tps / hf_tps,
                f"{speedup / al:.2f}",
                f"{identical}/{len(all_turns)}{identical_note(record)}",
            ]
        )

    weight_bytes = decode_weight_bytes(model)
    bound = H100_HBM_BYTES_PER_S / weight_bytes
    out["roofline"] = {
        "weight_bytes": weight_bytes,
        "bound_tokens_per_s_spec_bw": bound,
        "plain_fraction_of_bound": plain_tps / bound,
    }
    if args.copy_bandwidth:
        out["roofline"]["bound_tokens_per_s_measured_bw"] = args.copy_bandwidth / weight_bytes
    print(
        table(
            f"\n== decode at batch 1, greedy, {len(all_turns)} turns of {args.prompts} prompts x "
            f"{len(turns)} benches, <= {args.max_new_tokens} new tokens (AL: tokens per verification)",
            ["", "AL", "accept@pos", "tok/s", "x plain", "x HF", "speedup/AL", "identical to plain"],
            rows,
        )
    )
    measured = (
        f", {out['roofline']['bound_tokens_per_s_measured_bw']:.0f} at the measured copy bandwidth"
        if args.copy_bandwidth
        else ""
    )
    print(
        f"roofline: plain decoding {plain_tps:.0f} tok/s vs {bound:.0f} tok/s = {weight_bytes / 1e6:.0f} MB of "
        f"weights per token at {H100_HBM_BYTES_PER_S / 1e12} TB/s{measured}: "
        f"{100 * plain_tps / bound:.1f}% of the bound"
    )
    return out


# ------------------------------------------------------------------------------------ capture


def real_batches(data_path, tokens_per_batch: int, max_tokens: int):
    """Length-grouped batches of the first samples of a tokenized dataset, ~max_tokens in all."""
    from eagle_train.batching import pack_by_length
    from eagle_train.store import ShardedSamples

    data = ShardedSamples(data_path)
    lengths = data.lengths()
    chosen, total = [], 0
    for i, n in enumerate(lengths):
        if total >= max_tokens:
            break
        chosen.append(i)
        total += n
    return data, pack_by_length(chosen, lengths, tokens_per_batch)


def bench_capture(args, device, model, tokenizer) -> dict:
    from data_prep.capture import capture_batch, pad_batch
    from eagle_train.hidden_states import default_aux_layer_ids, target_hidden_states
    from eagle_train.store import StoreWriter

    data, batches = real_batches(args.data, args.capture_token_budget, args.capture_tokens)
    samples = [[data.tokens(i) for i in b] for b in batches]
    tokens = sum(len(s["input_ids"]) for b in samples for s in b)
    padded = [pad_batch(b, tokenizer.pad_token_id, device) for b in samples]
    aux_ids = default_aux_layer_ids(model.config.num_hidden_layers)

    def bare():
        with torch.no_grad():
            for ids, mask in padded:
                model.model(input_ids=ids, attention_mask=mask, use_cache=False)

    def hidden():
        for ids, mask in padded:
            target_hidden_states(model, ids, mask, aux_ids)

    def full():  # what `eagle-prep capture` does per shard: forward, copy to host, pack + write in the background
        with tempfile.TemporaryDirectory() as tmp, StoreWriter(tmp, "bfloat16") as writer:
            for k, b in enumerate(samples):
                writer.add_shard(
                    k, capture_batch(model, b, aux_ids, tokenizer.pad_token_id, "bfloat16"), list(range(len(b)))
                )

    rows, out = [], {"tokens": tokens, "token_budget": args.capture_token_budget}
    for name, fn in (("bare forward", bare), ("target_hidden_states", hidden), ("capture + store writer", full)):
        t = timed(fn, device, repeat=3)
        out[name] = tokens / t
        rows.append([name, tokens / t, 100 * (out["bare forward"] / (tokens / t) - 1)])
    print(
        table(
            f"\n== capture: {tokens} tokens in {len(batches)} batches of <= {args.capture_token_budget} padded tokens",
            ["", "tok/s", "overhead %"],
            rows,
        )
    )
    return out


# ------------------------------------------------------------------------------------ train


def bench_train(args, device, model, tokenizer) -> dict:
    from torch.utils.flop_counter import FlopCounterMode

    from eagle_train.methods import objective_for
    from eagle_train.methods.eagle3.train import build_eagle3_head
    from eagle_train.store import read_vocab_map
    from eagle_train.train_config import TrainConfig
    from eagle_train.trainer import BatchSource, HeadRunner, draw_seed, micro_batch

    cfg = TrainConfig(
        target=args.target, data_path=args.data, mode="online", max_length=2048, tokens_per_batch=args.train_tokens
    )
    torch.manual_seed(0)
    head = build_eagle3_head(cfg, model, read_vocab_map(args.data)).float().to(device)
    runner = HeadRunner(head)
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95))
    source = BatchSource(cfg, model, head.t2d, list(head.config.aux_layer_ids), device)
    objective = objective_for(cfg)
    data, batches = real_batches(args.data, args.train_tokens, args.train_tokens * (args.train_steps + 2))
    batches = batches[: args.train_steps + 1]
    padded = [
        micro_batch([data.tokens(i) for i in b], b, cfg.max_length, draw_seed(cfg.seed, 0, k))
        for k, b in enumerate(batches)
    ]
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step(batch):
        with amp:
            metrics = objective(runner, batch, lambda loss: loss.backward())
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return metrics

    prepared = [source(p) for p in padded]  # target forward + distribution, timed separately below
    step(prepared[0])  # warm-up (allocator, kernels)
    with FlopCounterMode(display=False) as counter:
        with amp:
            objective(runner, prepared[0], lambda loss: loss.backward())
    optimizer.zero_grad(set_to_none=True)
    flops_first = counter.get_total_flops()
    real = [int(p["attention_mask"].sum()) for p in padded]
    padded_tokens = [p["attention_mask"].numel() for p in padded]
    sync(device)
    t0 = time.perf_counter()
    for p in padded[1:]:
        source(p)
    sync(device)
    t_source = time.perf_counter() - t0
    t0 = time.perf_counter()
    for b in prepared[1:]:
        step(b)
    sync(device)
    t_head = time.perf_counter() - t0
    flops = flops_first / padded_tokens[0] * sum(padded_tokens[1:])  # FLOPs scale with padded tokens
    tokens = sum(real[1:])
    peak = args.peak_flops
    out = {
        "steps": len(prepared) - 1,
        "tokens": tokens,
        "padded_tokens": sum(padded_tokens[1:]),
        "head_seconds": t_head,
        "target_seconds": t_source,
        "head_tokens_per_s": tokens / t_head,
        "online_tokens_per_s": tokens / (t_head + t_source),
        "head_flops_per_token": flops / tokens,
        "head_mfu": flops / t_head / peak,
        "peak_flops": peak,
    }
    print(
        table(
            f"\n== EAGLE-3 training ({cfg.ttt_length} TTT steps, {args.train_tokens} tokens per batch, bf16 autocast); "
            "MFU "
            f"vs {peak / 1e12:.0f} TFLOP/s bf16 dense",
            ["", "tok/s", "GFLOP/token", "MFU %"],
            [
                [
                    "head fwd+bwd+AdamW",
                    out["head_tokens_per_s"],
                    out["head_flops_per_token"] / 1e9,
                    100 * out["head_mfu"],
                ],
                ["+ online target fwd + distribution", out["online_tokens_per_s"], "", ""],
            ],
        )
    )
    print(f"padding: {100 * (1 - tokens / out['padded_tokens']):.1f}% of the batch tokens")
    return out


# ------------------------------------------------------------------------------------ main


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", help=".gguf, HF dir, hub id or alias")
    p.add_argument("--eagle3", help="EAGLE-3 head (training checkpoint, head dir or export)")
    p.add_argument("--peagle", help="P-EAGLE head")
    p.add_argument("--data", help="tokenized dataset (capture and training sections)")
    p.add_argument("--out", required=True, help="JSON results")
    p.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections of {SECTIONS}")
    p.add_argument("--prompts", type=int, default=80, help="prompts per bench (mt_bench, humaneval, gsm8k)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--hf-prompts", type=int, default=6, help="prompts per bench that HF generate runs")
    p.add_argument("--chain", default="3,5,7", help="EAGLE-3 chain lengths K")
    p.add_argument("--tree", default="6,8,60", help="EAGLE-3 tree depth,topk,total ('' for none)")
    p.add_argument("--parallel", default="3,5,7", help="P-EAGLE drafts K")
    p.add_argument("--capture-tokens", type=int, default=1 << 20)
    p.add_argument("--capture-token-budget", type=int, default=16384)
    p.add_argument("--train-tokens", type=int, default=16384, help="tokens per training batch")
    p.add_argument("--train-steps", type=int, default=10)
    p.add_argument("--loss-tokens", type=int, default=16384, help="tokens of the kernels section's loss")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--peak-flops", type=float, default=H100_BF16_DENSE_FLOPS, help="bf16 dense peak for MFU")
    args = p.parse_args(argv)
    args.chain = [int(k) for k in args.chain.split(",") if k]
    args.parallel = [int(k) for k in args.parallel.split(",") if k]
    sections = [s for s in args.only.split(",") if s]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        p.error(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    needs_target = set(sections) - {"kernels"}
    if needs_target and not args.target:
        p.error(f"sections {sorted(needs_target)} need --target")
    if {"capture", "train"} & set(sections) and not args.data:
        p.error("the capture and train sections need --data (a tokenized dataset)")
    for path in (args.eagle3, args.peagle, args.data):
        if path and not Path(path).exists():
            p.error(f"{path} does not exist")

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "peak_flops": args.peak_flops,
        "hbm_bytes_per_s": H100_HBM_BYTES_PER_S,
        "args": {k: v for k, v in vars(args).items()},
    }
    print(f"scripts/bench/gpu.py on {result['device']}, torch {torch.__version__}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save():
        out.write_text(json.dumps(result, indent=1, default=str))

    args.copy_bandwidth = None
    if "kernels" in sections:
        result["kernels"] = bench_kernels(args, device)
        args.copy_bandwidth = result["kernels"]["copy_bandwidth_bytes_per_s"]
        save()
    failed = []
    if needs_target:
        from eagle_train.target import load_target

        model, tokenizer = load_target(args.target, device=device)
        for name, fn in (("train", bench_train), ("capture", bench_capture), ("decode", bench_decode)):
            if name not in sections:
                continue
            t0 = time.perf_counter()
            kwargs = {"save": lambda partial: (result.update(decode=partial), save())} if name == "decode" else {}
            try:
                result[name] = fn(args, device, model, tokenizer, **kwargs)
            except Exception as e:  # one broken section must not cost the others' figures
                import traceback

                traceback.print_exc()
                result[name] = {**result.get(name, {}), "error": f"{type(e).__name__}: {e}"}
                failed.append(name)
            result[name]["bench_seconds"] = time.perf_counter() - t0
            save()
    print(f"\nresults: {out}")
    if failed:
        sys.exit(f"sections failed: {failed}")


if __name__ == "__main__":
    main()
