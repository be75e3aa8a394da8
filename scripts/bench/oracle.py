"""The runtime's efficiency independent of any head: speculative decoding with an oracle drafter.

    python scripts/bench/oracle.py --ks 1 2 3 4 5 6 7 --p 0 0.3 0.6 [--widths 1 4 --num-prompts 5 --max-new-tokens 128]

The oracle drafts the target's own greedy continuation, taken from a plain run of the same prompt:
each round's K drafts are the plain output's next K tokens, each replaced with probability p by
another token (seeded), so the acceptance length is set by construction, not by a head. Drafting
costs nothing, so a round's speedup over plain decoding reaches AL only if verifying K+1 rows costs
one plain step and the runtime adds nothing around it: the table's speedup / AL is how close it comes
(1.0 = nothing beyond the target's verify forward). --widths W > 1 drafts a K x W tree instead: W
distinct candidates at each depth under the one carrying the continuation, which is among them with
probability 1 - p, so AL is a chain's at the cost of verifying K*W nodes (and of compacting the cache
when the accepted path leaves the first branch). "AL set" is the expected AL (the measured one falls
short of it by the last round's truncation). Tokens/s are over whole generate calls, prefill
included, after one warm-up of each; each row's turns are timed in pairs with plain decoding, one right after
the other (eagle-eval's loop), and its speedup is the pairs' Hodges-Lehmann centre with a 90% interval. Every row checks
that its tokens equal plain decoding's.

--drafters names what drafting costs: `free` (the oracle alone), or a head of a training method (eagle3,
peagle, dflash, dspark, draft_model) with random weights, shaped for the target as the method's shipped config shapes
one: the runtime's drafter for that head runs every forward it would (catch-up, the chain's steps, the
block), and its chain's tokens are then replaced by the oracle's. So speedup / AL at p = 0 is what a
perfect head of that shape would reach in this runtime, P-EAGLE's and the block drafters' one-pass chains
beside EAGLE-3's K sequential steps. A head drafts chains only (--widths 1).

--random-target llama-8b times a target of that shape with random weights instead (the prompts still come through
--target's tokenizer, and no token ends a turn early): its tokens are noise, its cost a real model's.
"""

import argparse
import itertools
import json
import random
from types import SimpleNamespace

import torch

from eagle_train.architectures import text_config
from eagle_train.config_files import config_file
from eagle_train.methods import METHODS
from eagle_train.target import load_target, load_tokenizer
from eagle_train.train_config import load_train_config
from eagle_train.vocab_map import top_k_vocab_map
from inference.drafting import DraftTree, TreeShape
from inference.evaluate import TurnEngine, TurnResult, add_drafter, chat_ids, load_bench, run_bench, summarise
from inference.generate import GenerationResult, Runtime
from inference.prompt_lookup import chain_tree
from inference.runtime_eval import turn_result
from inference.timing import span


class OracleDrafter:
    """Drafts a known continuation of one prompt through the runtime's drafter interface (as
    `PromptLookup` does: no head, no root state). Each depth of the draft holds `width` distinct
    candidates under the one before it that carries the continuation; with probability 1 - p the
    continuation's token is among them (at a random place), else all are wrong. Width 1 is a chain."""

    def __init__(self, prompt_len: int, continuation: list[int], k: int, p: float, vocab_size: int, rng, width=1):
        if not 1 <= width < vocab_size:
            raise ValueError(f"a tree width must be in 1..{vocab_size - 1} (the vocab less one), got {width}")
        self.shape = TreeShape(k, width, k * width)
        self.prompt_len = prompt_len  # continuation[i] is the token at position prompt_len + i
        self.continuation = continuation
        self.p, self.vocab_size, self.rng = p, vocab_size, rng

    def catch_up(self, aux, next_ids, start: int):
        return None, None

    catch_up_padded = catch_up

    def candidates(self, token: int) -> list[int]:
        """`width` distinct tokens, `token` among them with probability 1 - p (greedy verification
        rejects every other one)."""
        width = self.shape.topk
        wrong = [(token + 1 + i) % self.vocab_size for i in self.rng.sample(range(self.vocab_size - 1), width)]
        if self.rng.random() >= self.p:
            wrong[self.rng.randrange(width)] = token
        return wrong

    def draft(self, root_token: torch.Tensor, h_root, logits_root, length: int):
        # the root is x_length = continuation[length - prompt_len]; the drafts are the tokens after it
        nxt = length - self.prompt_len + 1
        tokens, parents, depths, spine = [], [0], [0], 0
        for depth, token in enumerate(self.continuation[nxt : nxt + self.shape.depth], start=1):
            row = self.candidates(token)
            first = len(tokens) + 1
            tokens += row
            parents += [spine] * len(row)
            depths += [depth] * len(row)
            spine = first + row.index(token) if token in row else first
        drafts = torch.tensor(tokens, dtype=torch.long, device=root_token.device)
        tokens = torch.cat([root_token.reshape(1), drafts])
        if self.shape.topk == 1:
            return chain_tree(tokens)
        ancestors = torch.eye(len(parents), dtype=torch.bool)
        for i in range(1, len(parents)):
            ancestors[i] |= ancestors[parents[i]]
        dev = root_token.device
        return DraftTree(
            tokens=tokens,
            parents=torch.tensor(parents, device=dev),
            depths=torch.tensor(depths, device=dev),
            ancestors=ancestors.to(dev),
            dist_index=torch.full((len(parents),), -1, device=dev),
            dists=None,
        )


RANDOM_TARGETS = {  # Llama-3-8B's shape
    "llama-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=8192,
        rope_theta=500000.0,
    ),
}


def random_target(shape: dict, dtype, device):
    """A Llama of `shape` with transformers' random initialisation, built on `device`, in eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**shape))
    return model.to(dtype).eval().requires_grad_(False)


class AtHeadCost:
    """The oracle's chain at a head's cost: the runtime's own drafter for its head catches up and drafts
    as it would (every forward it runs), then its chain's tokens are replaced by the oracle's (all but
    those past the continuation's end, which the round's emitted tokens never reach)."""

    def __init__(self, drafter, oracle: OracleDrafter):
        self.drafter, self.oracle, self.shape = drafter, oracle, drafter.shape
        self.catch_up, self.catch_up_padded = drafter.catch_up, drafter.catch_up_padded
        if hasattr(drafter, "begin"):  # a draft model's drafter reads the prompt's first token
            self.begin = drafter.begin

    def draft(self, root_token: torch.Tensor, h_root, logits_root, length: int):
        tree = self.drafter.draft(root_token, h_root, logits_root, length)
        tokens = self.oracle.draft(root_token, None, None, length).tokens
        tree.tokens = torch.cat([tokens, tree.tokens[len(tokens) :]])
        return tree


DRAFT_VOCAB_SIZE = 32000  # a random head's, unless the target has fewer ids


def random_head(method: str, model, target: str, draft_vocab_size: int = DRAFT_VOCAB_SIZE):
    """A head of `method` with random weights for `model`, built by the method's own builder from its shipped
    config (`{method}_smollm2`: its layers, block size, K), over the target's first `draft_vocab_size` ids (all
    of them when it has fewer)."""
    vocab_size = text_config(model.config).vocab_size
    draft_vocab_size = min(draft_vocab_size, vocab_size)
    overrides = [f"target={target}", "data_path=", "mask_token_id=0", f"draft_vocab_size={draft_vocab_size}"]
    overrides += ["draft_init=random"]  # a draft model's too: no weight read from the target's files
    cfg = load_train_config(config_file(f"{method}_smollm2"), overrides)
    vocab_map = top_k_vocab_map(torch.arange(vocab_size, 0, -1), draft_vocab_size)
    head = METHODS[method].build_head(cfg, model, vocab_map)
    return head.to(device=model.device, dtype=model.dtype).eval()


def oracle_runs(runtime: Runtime, prompts, plains, k: int, p: float, seed=0, width=1) -> list[GenerationResult]:
    """Speculative decoding of each prompt with the oracle over its plain output (one seeded rng for all);
    on a runtime with a head, at that head's cost (its drafter must draft a chain of `k`)."""
    rng = random.Random(seed)
    vocab_size = runtime.target.config.vocab_size
    head = runtime.drafter
    if head is not None and (head.shape.depth, head.shape.topk, width) != (k, 1, 1):
        raise ValueError(f"this runtime's head drafts {head.shape}, not a chain of K={k}: build it with that chain")

    def drafter(q, plain):
        oracle = OracleDrafter(len(q), plain.output_ids, k, p, vocab_size, rng, width)
        return oracle if head is None else AtHeadCost(head, oracle)

    return [runtime.generate(q, len(plain.output_ids), drafter(q, plain)) for q, plain in zip(prompts, plains)]


class OracleTurns(TurnEngine):
    """The bench loop's engine for the oracle: "plain" on the plain runtime, each row's name its oracle drafts
    (`rows[name]`: the runtime, K, p, width) over the prompt's plain output (`continuations`), so every row is
    timed in pairs with plain decoding (`add_drafter`)."""

    def __init__(self, runtime: Runtime, tokenizer, seed: int):
        self.plain, self.tokenizer, self.seed = runtime, tokenizer, seed
        self.drafters, self.rows, self.continuations = (), {}, {}

    def decode(self, name: str, prompts: list[list[int]], max_new_tokens: int) -> list[TurnResult]:
        if name == "plain":
            return [turn_result(self.plain.generate_plain(q, max_new_tokens), self.tokenizer) for q in prompts]
        runtime, k, p, width = self.rows[name]
        plains = [self.continuations[tuple(q)] for q in prompts]
        return [turn_result(r, self.tokenizer) for r in oracle_runs(runtime, prompts, plains, k, p, self.seed, width)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--random-target", choices=list(RANDOM_TARGETS), help="time a random-weight target of this shape")
    p.add_argument("--bench", default="mt_bench")
    p.add_argument("--num-prompts", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 7], help="chain lengths K")
    p.add_argument(
        "--widths", type=int, nargs="+", default=[1], help="candidates per depth: 1 = a chain, W > 1 = a K x W tree"
    )
    p.add_argument("--p", type=float, nargs="+", default=[0.0, 0.3, 0.6], help="probabilities of a wrong draft")
    p.add_argument(
        "--drafters",
        nargs="+",
        default=["free"],
        choices=["free", *METHODS],
        help="what drafting costs: free (the oracle alone) or a random head of that method (chains only)",
    )
    p.add_argument(
        "--draft-vocab-size", type=int, default=DRAFT_VOCAB_SIZE, help="a random head's (capped at the target's)"
    )
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default bf16 on CUDA, fp32 on a CPU")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--no-graphs", action="store_true", help="CUDA: decode without CUDA graphs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="also write the rows as JSON here")
    args = p.parse_args(argv)
    if any(not 0.0 <= x <= 1.0 for x in args.p):
        p.error(f"--p takes probabilities in [0, 1], got {args.p}")
    if args.widths != [1] and args.drafters != ["free"]:
        p.error("a head drafts chains: give --widths 1 with --drafters other than free")

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    name = args.random_target or args.target
    if args.random_target:
        model, tokenizer = random_target(RANDOM_TARGETS[args.random_target], dtype, device), load_tokenizer(args.target)
    else:
        model, tokenizer = load_target(args.target, dtype=dtype, device=device)
    first_turns = [{**q, "turns": q["turns"][:1]} for q in load_bench(args.bench, args.num_prompts)]
    prompts = [chat_ids(tokenizer, [{"role": "user", "content": q["turns"][0]}]) for q in first_turns]
    eos, use_graphs = ([] if args.random_target else [tokenizer.eos_token_id]), not args.no_graphs
    runtime = Runtime(model, eos_token_ids=eos, cuda_graphs=use_graphs)
    heads = {m: random_head(m, model, name, args.draft_vocab_size) for m in args.drafters if m != "free"}
    runtimes = {  # built before any timing: a K a head cannot draft is refused at once
        (m, k): runtime
        if m == "free"
        else Runtime(model, heads[m], TreeShape.chain(k), eos_token_ids=eos, cuda_graphs=use_graphs)
        for m in args.drafters
        for k in args.ks
    }

    runtime.generate_plain(prompts[0], 8)  # warm-up (and graph capture)
    engine = OracleTurns(runtime, tokenizer, args.seed)
    results = run_bench(engine, tokenizer, first_turns, args.max_new_tokens)  # plain: each prompt's continuation
    turns = [t for r in results for t in r["turns"]]
    engine.continuations = {tuple(t["prompt_ids"]): SimpleNamespace(output_ids=t["plain"]["output_ids"]) for t in turns}
    rows = []
    for drafter, k, width in itertools.product(args.drafters, args.ks, args.widths):
        spec = runtimes[drafter, k]
        oracle_runs(spec, prompts[:1], [runtime.generate_plain(prompts[0], 8)], k, 0.0, width=width)  # warm-up
        for prob in args.p:
            row = f"{drafter} K={k} W={width} p={prob:g}"
            engine.rows[row] = (spec, k, prob, width)
            add_drafter(results, engine, row, args.max_new_tokens)  # each turn timed beside plain decoding
            s = summarise(results, k, row)
            rows.append(
                dict(
                    drafter=drafter,
                    k=k,
                    width=width,
                    p=prob,
                    al_set=1 + sum((1 - prob) ** i for i in range(1, k + 1)),
                    al=s["acceptance_length"],
                    tokens_per_s=s["spec_tokens_per_s"],
                    plain_tokens_per_s=s["plain_tokens_per_s"],
                    speedup=s["speedup"],
                    speedup_interval=s["speedup_interval"],
                    speedup_per_al=s["speedup"] / s["acceptance_length"],
                    lossless=s["turns_identical_to_plain"] == s["turns"],
                )
            )

    graphs = "CUDA graphs" if runtime.use_graphs else "no graphs"
    print(
        f"{name} on {device.type} {str(dtype).replace('torch.', '')} ({graphs}), torch {torch.__version__}: "
        f"{args.bench}, {len(prompts)} prompts x {args.max_new_tokens} new tokens, oracle drafts\n"
    )
    print(
        "| drafter | K | W | p | AL set | AL | tokens/s spec | tokens/s plain | speedup | 90% interval | speedup / AL "
        "| lossless |"
    )
    print("|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|:-:|")
    for r in rows:
        interval = span(r["speedup_interval"])
        print(
            f"| {r['drafter']} | {r['k']} | {r['width']} | {r['p']:g} | {r['al_set']:.3f} | {r['al']:.3f} | "
            f"{r['tokens_per_s']:.1f} | {r['plain_tokens_per_s']:.1f} | {r['speedup']:.2f}x | {interval} | "
            f"{r['speedup_per_al']:.3f} | {'yes' if r['lossless'] else 'NO'} |"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(args=vars(args), torch=torch.__version__, rows=rows), f, indent=1)
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
