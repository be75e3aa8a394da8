"""Decoding speed at batch 1: HF `generate`, plain and speculative decoding on our runtime, and vLLM.

    python scripts/bench/decode.py --target smollm2-135m --draft runs/eagle3/final --chain 5
    python scripts/bench/decode.py --target smollm2-135m --draft runs/eagle3/final --chain 1 --tree 3,2,4 --vllm
    python scripts/bench/decode.py --random-llama 16,2048 --device cuda     # no model files needed

Every method decodes the same prompts greedily; the table gives tokens/s and the speedup, AL and
whether the tokens equal plain decoding's, the runtime's for it and HF, vLLM's for vLLM's rows. On
CUDA the runtime runs with CUDA graphs on and off. --tree adds a tree row beside the chain's. --vllm
adds vLLM plain, vLLM with the head (chain K) and vLLM's n-gram drafting (`engines.vllm`; timed per
generate call after a warm-up, as the runtime is). --dtype sets the target's and head's dtype in
both (default bf16 on CUDA, fp32 on a CPU; in bf16 the verify forward's rounding can turn a near-tie).
Without --draft a random head is used (AL about 1: it measures the drafting overhead).
"""

import argparse
import time

import torch

from eagle_train.methods.eagle3.head import Eagle3Head
from eagle_train.vocab_map import DRAFT_VOCAB_SIZE
from inference.drafting import TreeShape
from inference.generate import Runtime


def random_llama(spec: str, device, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    layers, hidden = (int(x) for x in spec.split(","))
    cfg = LlamaConfig(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 128 or 1,
        num_key_value_heads=max(hidden // 512, 1),
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval().requires_grad_(False)
    model.generation_config.eos_token_id = None  # decode the full length
    return model


def hf_generate(model, prompt, max_new_tokens, eos):
    t0 = time.perf_counter()
    out = model.generate(
        torch.tensor([prompt], device=model.device),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=eos if eos is not None else 0,
    )
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    return out[0, len(prompt) :].tolist(), time.perf_counter() - t0


def vllm_rows(args, prompts):
    """vLLM plain, with the head (chain K, exported to a temporary directory) and with n-gram drafting, on the
    same prompt tokens as the other rows."""
    import tempfile

    from engines import vllm_decode

    if args.random_llama:
        raise SystemExit("--vllm runs a real target: leave out --random-llama")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        configs = [("plain", None), ("n-gram", vllm_decode.speculative("ngram", None, args.chain))]
        if args.draft:
            head_dir, _ = vllm_decode.export_dir(args.draft, tmp)
            spec = vllm_decode.speculative(vllm_decode.export_method(head_dir), head_dir, args.chain)
            configs.insert(1, (f"head chain K={args.chain}", spec))
        for name, spec in configs:
            with vllm_decode.Decoder(args.target, spec, args.dtype) as engine:
                turns = [vllm_decode.turn_result(t) for t in engine.decode(prompts, args.max_new_tokens)]
            tps = sum(t.timed_tokens for t in turns) / sum(t.seconds for t in turns)
            al = sum(t.emitted for t in turns) / sum(t.forwards for t in turns) if spec else None
            rows.append((f"vLLM {engine.version} {engine.dtype} {name}", tps, al, [t.output_ids for t in turns]))
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--random-llama", default=None, metavar="LAYERS,HIDDEN", help="random-weight Llama instead")
    p.add_argument("--draft", default=None, help="head / checkpoint / export (default: a random head)")
    p.add_argument("--bench", default="mt_bench")
    p.add_argument("--num-prompts", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--chain", type=int, default=5)
    p.add_argument("--tree", default=None, metavar="DEPTH,TOPK,TOTAL")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: bfloat16 on CUDA, float32 on a CPU)")
    p.add_argument("--no-hf", action="store_true", help="skip HF generate")
    p.add_argument("--vllm", action="store_true", help="add vLLM's rows (needs vLLM: scripts/install_vllm.sh)")
    args = p.parse_args()

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    if args.random_llama:
        model = random_llama(args.random_llama, device, dtype)
        gen = torch.Generator().manual_seed(1)
        prompts = [torch.randint(0, 32000, (64 + 32 * i,), generator=gen).tolist() for i in range(args.num_prompts)]
        eos = None
    else:
        from eagle_train.target import load_target
        from inference.evaluate import chat_ids, load_bench

        model, tokenizer = load_target(args.target, dtype=dtype, device=device)
        questions = [q["turns"][0] for q in load_bench(args.bench, args.num_prompts)]
        prompts = [chat_ids(tokenizer, [{"role": "user", "content": q}]) for q in questions]
        eos = tokenizer.eos_token_id
    if args.draft:
        from eagle_train.checkpoint import load_draft_head

        head = load_draft_head(args.draft, model)
    else:
        torch.manual_seed(0)
        head = Eagle3Head.from_target(model, draft_vocab_size=min(DRAFT_VOCAB_SIZE, model.config.vocab_size))
    head.to(device=device, dtype=dtype).eval()
    shapes = [TreeShape.chain(args.chain)] + ([TreeShape.parse(args.tree)] if args.tree else [])
    eos_ids = [eos] if eos is not None else []

    rows = []
    if not args.no_hf:
        hf_generate(model, prompts[0], 8, eos)  # warm-up
        outs, secs = zip(*(hf_generate(model, q, args.max_new_tokens, eos) for q in prompts))
        rows.append(("HF generate", sum(map(len, outs)) / sum(secs), None, list(outs)))
    for graphs in [True, False] if device.type == "cuda" else [False]:
        tag = "graphs" if graphs else ("eager" if device.type == "cuda" else "cpu")
        for shape in shapes:
            runtime = Runtime(model, head, shape, eos_token_ids=eos_ids, cuda_graphs=graphs)
            drafting = f"tree {shape.depth},{shape.topk},{shape.total}" if shape.topk > 1 else f"chain K={shape.depth}"
            methods = [("speculative " + drafting, runtime.generate)]
            if shape is shapes[0]:
                methods.insert(0, ("plain", runtime.generate_plain))
            for name, fn in methods:
                fn(prompts[0], 8)  # warm-up (and graph capture)
                results = [fn(q, args.max_new_tokens) for q in prompts]
                outs = [r.output_ids for r in results]
                tps = sum(map(len, outs)) / sum(r.seconds for r in results)
                al = (
                    sum(sum(r.emitted) for r in results) / sum(r.forwards for r in results) if name != "plain" else None
                )
                rows.append((f"runtime {name} ({tag})", tps, al, outs))
    runtime_plain = next(row for row in rows if row[0].startswith("runtime plain"))  # on CUDA: with graphs
    compared = [(row, runtime_plain) for row in rows]  # each row and the plain decoding it is compared with
    if args.vllm:
        engine_rows = vllm_rows(args, prompts)
        compared += [(row, engine_rows[0]) for row in engine_rows]  # vLLM's own plain decoding comes first
    print(
        f"{args.random_llama and f'random Llama {args.random_llama}' or args.target}, {len(prompts)} prompts x "
        f"{args.max_new_tokens} new tokens, {device.type} {str(dtype).replace('torch.', '')}"
    )
    print(f"{'method':34s} {'tokens/s':>9s} {'vs plain':>9s} {'AL':>6s}  same tokens as plain")
    for (name, tps, al, outs), (_, plain_tps, _, reference) in compared:
        same = sum(o == r for o, r in zip(outs, reference))
        al_text = f"{al:6.2f}" if al is not None else "     -"
        print(f"{name:34s} {tps:9.1f} {tps / plain_tps:8.2f}x {al_text}  {same}/{len(outs)}")


if __name__ == "__main__":
    main()
