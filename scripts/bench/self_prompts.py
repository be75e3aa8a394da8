"""Prompts the target writes itself (Magpie, arXiv 2406.08464): a chat model given its template up to a user
turn's text writes a user turn, drawn from the instructions it was tuned on. Writes them as conversations
`eagle-prep distil --data` reads (user turn + a placeholder answer), so the target then answers its own prompts.

    python scripts/bench/self_prompts.py --num 900 --out runs/magpie/prompts.jsonl       # in the vLLM venv
    eagle-prep distil --data runs/magpie/prompts.jsonl --out runs/magpie/m600/store --limit 600 --engine vllm ...

Kept: turns that ended (not cut at --max-tokens), mostly ASCII (the benches are English), each text once.
"""

import argparse
import json
import os
import sys
import time

from eagle_train.target import SMOLLM2, load_tokenizer, resolve_target


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
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    tokenizer = load_tokenizer(a.target)
    prefix = TokensPrompt(prompt_token_ids=user_turn_prefix(tokenizer))
    llm = LLM(model=resolve_target(a.target), dtype=a.dtype, enforce_eager=True, seed=0, max_model_len=640)
    start = time.perf_counter()
    params = SamplingParams(
        temperature=a.temperature, top_p=a.top_p, max_tokens=a.max_tokens, stop_token_ids=[tokenizer.eos_token_id]
    )
    outputs = llm.generate([prefix] * a.num, params)
    seconds = time.perf_counter() - start
    kept = {}
    for output in outputs:
        text = output.outputs[0].text.strip()
        ended = output.outputs[0].finish_reason == "stop"
        if ended and len(text) >= 10 and sum(c.isascii() for c in text) >= 0.9 * len(text):
            kept.setdefault(text, None)
    with open(a.out, "w") as f:
        for text in kept:
            turns = [{"role": "user", "content": text}, {"role": "assistant", "content": "-"}]
            f.write(json.dumps({"messages": turns}) + "\n")
    print(f"{len(kept)} of {a.num} user turns kept in {a.out}, sampled in {seconds:.1f}s", file=sys.stderr)


if __name__ == "__main__":
    main()
