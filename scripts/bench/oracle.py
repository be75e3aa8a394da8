"""The runtime's efficiency independent of any head: speculative decoding with an oracle drafter.

    python scripts/bench/oracle.py --ks 1 2 3 4 5 6 7 --p 0 0.3 0.6 [--num-prompts 5 --max-new-tokens 128]

The oracle drafts the target's own greedy continuation, taken from a plain run of the same prompt:
each round's K drafts are the plain output's next K tokens, each replaced with probability p by
another token (seeded), so the acceptance length is set by construction, not by a head. Drafting
costs nothing, so a round's speedup over plain decoding reaches AL only if verifying K+1 rows costs
one plain step and the runtime adds nothing around it: the table's speedup / AL is how close it comes
(1.0 = nothing beyond the target's verify forward). "AL set" is the expected AL of a K-chain whose
drafts each survive with probability 1 - p (the measured AL falls short of it by the last round's
truncation). Tokens/s are over whole generate calls, prefill included, after one warm-up of each.
Chains only: the runtime's trees come from a head's top-k, which an oracle has no analogue of.
Every row checks that its tokens equal plain decoding's.
"""

import argparse
import json
import random

import torch

from eagle_train.target import load_target
from inference.drafting import TreeShape
from inference.evaluate import chat_ids, load_bench
from inference.generate import GenerationResult, Runtime
from inference.prompt_lookup import chain_tree


class OracleDrafter:
    """Drafts a known continuation of one prompt through the runtime's drafter interface (as
    `PromptLookup` does: no head, no root state), each draft corrupted with probability p."""

    def __init__(self, prompt_len: int, continuation: list[int], k: int, p: float, vocab_size: int, rng):
        self.shape = TreeShape.chain(k)
        self.prompt_len = prompt_len  # continuation[i] is the token at position prompt_len + i
        self.continuation = continuation
        self.p, self.vocab_size, self.rng = p, vocab_size, rng

    def catch_up(self, aux, next_ids, start: int):
        return None, None

    catch_up_padded = catch_up

    def wrong_or(self, token: int) -> int:
        """`token`, or with probability p any other token (which the greedy target then rejects)."""
        if self.rng.random() < self.p:
            return (token + 1 + self.rng.randrange(self.vocab_size - 1)) % self.vocab_size
        return token

    def draft(self, root_token: torch.Tensor, h_root, logits_root, length: int):
        # the root is x_length = continuation[length - prompt_len]; the drafts are the tokens after it
        nxt = length - self.prompt_len + 1
        drafts = [self.wrong_or(t) for t in self.continuation[nxt : nxt + self.shape.depth]]
        drafts = torch.tensor(drafts, dtype=torch.long, device=root_token.device)
        return chain_tree(torch.cat([root_token.reshape(1), drafts]))


def oracle_runs(runtime: Runtime, prompts, plains, k: int, p: float, seed: int = 0) -> list[GenerationResult]:
    """Speculative decoding of each prompt with the oracle over its plain output (one seeded rng for all)."""
    rng = random.Random(seed)
    vocab_size = runtime.target.config.vocab_size
    return [
        runtime.generate(q, len(plain.output_ids), OracleDrafter(len(q), plain.output_ids, k, p, vocab_size, rng))
        for q, plain in zip(prompts, plains)
    ]


def tokens_per_s(results: list[GenerationResult]) -> float:
    return sum(len(r.output_ids) for r in results) / sum(r.seconds for r in results)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--bench", default="mt_bench")
    p.add_argument("--num-prompts", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 7], help="chain lengths K")
    p.add_argument("--p", type=float, nargs="+", default=[0.0, 0.3, 0.6], help="probabilities of a wrong draft")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default bf16 on CUDA, fp32 on a CPU")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--no-graphs", action="store_true", help="CUDA: decode without CUDA graphs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="also write the rows as JSON here")
    args = p.parse_args(argv)
    if any(not 0.0 <= x <= 1.0 for x in args.p):
        p.error(f"--p takes probabilities in [0, 1], got {args.p}")

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    model, tokenizer = load_target(args.target, dtype=dtype, device=device)
    prompts = [
        chat_ids(tokenizer, [{"role": "user", "content": q["turns"][0]}])
        for q in load_bench(args.bench, args.num_prompts)
    ]
    runtime = Runtime(model, eos_token_ids=[tokenizer.eos_token_id], cuda_graphs=not args.no_graphs)

    runtime.generate_plain(prompts[0], 8)  # warm-up (and graph capture)
    plains = [runtime.generate_plain(q, args.max_new_tokens) for q in prompts]
    plain_tps = tokens_per_s(plains)
    rows = []
    for k in args.ks:
        oracle_runs(runtime, prompts[:1], [runtime.generate_plain(prompts[0], 8)], k, 0.0)  # warm-up
        for prob in args.p:
            results = oracle_runs(runtime, prompts, plains, k, prob, args.seed)
            forwards = sum(r.forwards for r in results)
            al = sum(sum(r.emitted) for r in results) / forwards
            tps = tokens_per_s(results)
            rows.append(
                dict(
                    k=k,
                    p=prob,
                    al_set=1 + sum((1 - prob) ** i for i in range(1, k + 1)),
                    al=al,
                    tokens_per_s=tps,
                    plain_tokens_per_s=plain_tps,
                    speedup=tps / plain_tps,
                    speedup_per_al=tps / plain_tps / al,
                    lossless=all(r.output_ids == q.output_ids for r, q in zip(results, plains)),
                )
            )

    graphs = "CUDA graphs" if runtime.use_graphs else "no graphs"
    print(
        f"{args.target} on {device.type} {str(dtype).replace('torch.', '')} ({graphs}), torch {torch.__version__}: "
        f"{args.bench}, {len(prompts)} prompts x {args.max_new_tokens} new tokens, oracle chain drafts\n"
    )
    print("| K | p | AL set | AL | tokens/s spec | tokens/s plain | speedup | speedup / AL | lossless |")
    print("|--:|--:|--:|--:|--:|--:|--:|--:|:-:|")
    for r in rows:
        print(
            f"| {r['k']} | {r['p']:g} | {r['al_set']:.3f} | {r['al']:.3f} | {r['tokens_per_s']:.1f} | "
            f"{r['plain_tokens_per_s']:.1f} | {r['speedup']:.2f}x | {r['speedup_per_al']:.3f} | "
            f"{'yes' if r['lossless'] else 'NO'} |"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(args=vars(args), torch=torch.__version__, rows=rows), f, indent=1)
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
