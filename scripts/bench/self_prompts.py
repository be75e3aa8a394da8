"""Prompts the target writes itself (Magpie, arXiv 2406.08464): a chat model given its template up to a user
turn's text writes a user turn, drawn from the instructions it was tuned on. Writes them as conversations
`eagle-prep distil --data` reads (user turn + a placeholder answer), so the target then answers its own prompts.

    python scripts/bench/self_prompts.py --num 900 --out runs/magpie/prompts.jsonl       # in the vLLM venv
    eagle-prep distil --data runs/magpie/prompts.jsonl --out runs/magpie/m600/store --limit 600 --engine vllm ...

Kept: turns that ended (not cut at --max-tokens), mostly ASCII (the benches are English), each text once.
"""

import argparse
import json
import sys
from types import SimpleNamespace

from eagle_train.target import SMOLLM2, end_of_turn_ids, load_generation_config, load_tokenizer
from engines.vllm_data import generate_batch


def user_turn_prefix(tokenizer) -> list[int]:
    """The chat template's tokens up to where a user turn's text begins (the default system prompt included)."""
    marker = "\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
    return tokenizer(text[: text.index(marker)], add_special_tokens=False)["input_ids"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=SMOLLM2)
    p.add_argument("--num", type=int, required=True, help="user turns sampled (fewer are kept)")
    p.add_argument("--out", required=True, help="conversations .jsonl")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--max-tokens", type=int, default=160, help="longest user turn")
    p.add_argument("--dtype", default="bfloat16")
    a = p.parse_args(argv)
    tokenizer = load_tokenizer(a.target)
    stop = end_of_turn_ids(SimpleNamespace(generation_config=load_generation_config(a.target)), tokenizer)
    sampling = {"temperature": a.temperature, "top_p": a.top_p, "stop_token_ids": sorted(stop)}
    prefix = user_turn_prefix(tokenizer)
    # 256 at once, vLLM's own default on a CPU: seeded sampling draws per batch, so this fixes the draw too
    run = generate_batch(a.target, [prefix] * a.num, a.max_tokens, max_num_seqs=256, dtype=a.dtype, sampling=sampling)
    kept = {}
    for ids in run.output_ids:
        if ids and ids[-1] in stop:  # the turn ended, not cut at --max-tokens
            text = tokenizer.decode(ids[:-1], skip_special_tokens=True).strip()
            if len(text) >= 10 and sum(c.isascii() for c in text) >= 0.9 * len(text):
                kept.setdefault(text, None)
    with open(a.out, "w") as f:
        for text in kept:
            turns = [{"role": "user", "content": text}, {"role": "assistant", "content": "-"}]
            f.write(json.dumps({"messages": turns}) + "\n")
    print(f"{len(kept)} of {a.num} user turns kept in {a.out}, sampled in {run.generate_seconds:.1f}s", file=sys.stderr)


if __name__ == "__main__":
    main()
