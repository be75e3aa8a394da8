"""vLLM as the distillation engine: exactness of its hidden states and its throughput on first turns.

    python scripts/bench/vllm_distil.py --check 8                 # vLLM's hidden states and answers against HF's
    python scripts/bench/vllm_distil.py --bench 128 --max-new-tokens 192 --kv-cache-gib 6

--check N: vLLM answers N ShareGPT first turns (chat-templated, shortest first, as `eagle-prep distil` plans
them) greedily (fp32 unless --dtype says otherwise) and captures the hidden states while generating; HF runs
`target_hidden_states` on the same token ids (each position but the last, which vLLM never runs) and answers the
same prompts with `generate_and_capture`. Prints, per aux layer and for the final hidden state, the largest
absolute difference, that over the largest HF value, and the worst token's ||vLLM - HF|| / ||HF||; and which
answers differ from HF greedy decoding and where.

--bench N: on the same N prompts, one engine each: plain generation; generation with the hidden states
captured while generating; a prefill-only pass with hidden states over plain generation's prompt + answer.
Prints prompts/s, answer tokens/s and, for the prefill pass, tokens/s, in the data engine's dtype (bf16 where
the machine multiplies it fast, else fp32) unless --dtype says otherwise.
"""

import argparse
import json
import os

import torch

from data_prep.distil import generate_and_capture, plan_conversations
from data_prep.readers import read_conversations
from eagle_train.hidden_states import default_aux_layer_ids, target_hidden_states
from eagle_train.target import SMOLLM2, end_of_turn_ids, load_target, load_target_config, load_tokenizer
from engines.vllm_data import generate_batch


def first_turns(target: str, n: int, max_length: int, max_new_tokens: int) -> list[list[int]]:
    tokenizer = load_tokenizer(target)
    planned, _ = plan_conversations(
        tokenizer, read_conversations("sharegpt"), n, max_length, max_new_tokens, None, 1, None
    )
    return [segments[0] for _, segments in planned]


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def check(target: str, prompts: list[list[int]], max_new_tokens: int, dtype: str | None) -> dict:
    aux_ids = default_aux_layer_ids(load_target_config(target).num_hidden_layers)
    run = generate_batch(target, prompts, max_new_tokens, aux_ids, dtype=dtype or "float32")
    model, tokenizer = load_target(target, dtype=torch.float32)
    names = [f"aux layer {i}" for i in aux_ids] + ["final"]
    worst = {name: {"abs": 0.0, "rel": 0.0, "token_rel": 0.0} for name in names}
    for sample in run.samples:
        ids = sample["input_ids"][None, :-1]
        aux, final = target_hidden_states(model, ids, aux_layer_ids=aux_ids)
        h = model.config.hidden_size
        want = [aux[0, :, k * h : (k + 1) * h] for k in range(len(aux_ids))] + [final[0]]
        got = [sample["aux_hidden"][:, k * h : (k + 1) * h] for k in range(len(aux_ids))] + [sample["final_hidden"]]
        for name, g, w in zip(names, got, want):
            diff = (g - w).abs().max().item()
            worst[name]["abs"] = max(worst[name]["abs"], diff)
            worst[name]["rel"] = max(worst[name]["rel"], diff / w.abs().max().item())
            token_rel = ((g - w).norm(dim=-1) / w.norm(dim=-1)).max().item()
            worst[name]["token_rel"] = max(worst[name]["token_rel"], token_rel)
    hf = generate_and_capture(
        model, prompts, max_new_tokens, aux_ids, end_of_turn_ids(model, tokenizer), tokenizer.pad_token_id
    )
    answers = []
    for i, (p, out, s) in enumerate(zip(prompts, run.output_ids, hf)):
        theirs = s["input_ids"][len(p) :].tolist()
        at = first_difference(out, theirs)
        if at is not None:
            answers.append(
                {
                    "prompt": i,
                    "at": at,
                    "vllm": tokenizer.decode(out[max(at - 3, 0) : at + 3]),
                    "hf": tokenizer.decode(theirs[max(at - 3, 0) : at + 3]),
                    "lengths": [len(out), len(theirs)],
                }
            )
    return {
        "prompts": len(prompts),
        "tokens_compared": sum(len(s["input_ids"]) - 1 for s in run.samples),
        "max_difference": worst,
        "answers_equal": len(prompts) - len(answers),
        "answers_differing": answers,
    }


def bench(target: str, prompts: list[list[int]], max_new_tokens: int, max_num_seqs: int, dtype: str | None) -> dict:
    aux_ids = default_aux_layer_ids(load_target_config(target).num_hidden_layers)

    def rates(run, seconds, tokens=None) -> dict:
        answer_tokens = sum(len(o) for o in run.output_ids)
        out = {
            "seconds": round(seconds, 1),
            "init_seconds": round(run.init_seconds, 1),
            "prompts_per_s": round(len(prompts) / seconds, 2),
            "answer_tokens": answer_tokens,
            "answer_tokens_per_s": round(answer_tokens / seconds, 1),
        }
        return out if tokens is None else {**out, "tokens": tokens, "tokens_per_s": round(tokens / seconds, 1)}

    plain = generate_batch(target, prompts, max_new_tokens, max_num_seqs=max_num_seqs, dtype=dtype)
    captured = generate_batch(target, prompts, max_new_tokens, aux_ids, max_num_seqs=max_num_seqs, dtype=dtype)
    sequences = [p + o for p, o in zip(prompts, plain.output_ids)]
    prefill = generate_batch(target, sequences, 1, aux_ids, max_num_seqs=max_num_seqs, dtype=dtype)
    return {
        "plain": rates(plain, plain.generate_seconds),
        "hidden_states_while_generating": rates(captured, captured.generate_seconds),
        "same_answers_as_plain": sum(a == b for a, b in zip(plain.output_ids, captured.output_ids)),
        "prefill_pass": rates(prefill, prefill.generate_seconds, sum(len(s) for s in sequences)),
        "plain_then_prefill_answer_tokens_per_s": round(
            sum(len(o) for o in plain.output_ids) / (plain.generate_seconds + prefill.generate_seconds), 1
        ),
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=SMOLLM2)
    p.add_argument("--check", type=int, default=0, help="compare vLLM with HF on this many prompts")
    p.add_argument("--bench", type=int, default=0, help="time vLLM on this many prompts")
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument("--max-length", type=int, default=640)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="vLLM's (see above)")
    p.add_argument(
        "--kv-cache-gib",
        type=float,
        default=None,
        help="vLLM's CPU KV cache (VLLM_CPU_KVCACHE_SPACE; default 2, with hidden states 6): too small for the batch, "
        "vLLM preempts and recomputes, and the hidden-state cache shares it",
    )
    a = p.parse_args(argv)
    if a.kv_cache_gib is not None:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(a.kv_cache_gib)
    report = {}
    if a.check:
        report["check"] = check(
            a.target, first_turns(a.target, a.check, a.max_length, a.max_new_tokens), a.max_new_tokens, a.dtype
        )
    if a.bench:
        prompts = first_turns(a.target, a.bench, a.max_length, a.max_new_tokens)
        report["bench"] = bench(a.target, prompts, a.max_new_tokens, a.max_num_seqs, a.dtype)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
