"""Self-distilled hidden-state store in one pass: the target answers, and the same forwards are the capture.

Regenerating answers as text and then capturing them runs the target twice over every answer
token, and re-tokenizing the decoded text can give other tokens than the ones the target chose.
Here the target answers the first user turn of each conversation greedily, batched with a KV
cache, and the hidden states the head reads are kept from those very forwards: the sample is the
prompt's ids plus the generated ids (loss-masked, the end-of-turn token included), exactly the
sequence greedy decoding produces.

Prompts are planned up front (sorted by length so a batch pads little), one batch per shard, so a
killed run resumes at the first missing shard and ends with the same store.
"""

import time
from pathlib import Path
from types import SimpleNamespace

import torch
import transformers
from tqdm import tqdm
from transformers import DynamicCache, StaticCache

from data_prep.capture import finish_store, pending_shards, start_store
from data_prep.chat import MAX_LENGTH, with_system_prompt
from data_prep.readers import read_conversations
from data_prep.vocab import make_vocab_map
from eagle_train.hidden_states import TargetLogits, cache_argument, default_aux_layer_ids, layer_inputs
from eagle_train.store import StoreWriter, chat_template_fingerprint, encode_checked, target_fingerprint
from eagle_train.target import end_of_turn_ids, files_fingerprint, load_generation_config, load_target_config
from eagle_train.vocab_map import DRAFT_VOCAB_SIZE

ENGINES = ("hf", "vllm")  # who answers and captures: transformers here, or vLLM (engines/vllm.py)


def first_turn_prompt(messages: list[dict]) -> list[dict] | None:
    """The messages before the first assistant turn, if they ask something (ShareGPT has turns that do not)."""
    head = []
    for m in messages:
        if m["role"] == "assistant":
            break
        head.append(m)
    return head if any(m["role"] == "user" and m["content"].strip() for m in head) else None


def generation_cache(config, max_len: int):
    """transformers' static cache (a growing one copies every layer's keys and values at every step), but its
    growing one for multi-head latent attention before transformers 5, whose static layers give the values the
    keys' width, which MLA's keys exceed."""
    latent = getattr(config, "qk_rope_head_dim", None) and getattr(config, "v_head_dim", None)
    if latent and int(transformers.__version__.split(".")[0]) < 5:
        return DynamicCache()
    return StaticCache(config=config, max_cache_len=max_len)


@torch.no_grad()
def generate_and_capture(model, prompts: list[list[int]], max_new_tokens: int, aux_layer_ids, eos_ids, pad_id: int):
    """Greedy answers to a batch of prompts with the hidden states of every position.

    Returns per prompt a dict of `input_ids` [T], `loss_mask` [T] (the answer), `aux_hidden`
    [T, 3H] and `final_hidden` [T, H] in the model's dtype, T = prompt + answer (up to and with the
    first end-of-turn id, at most `max_new_tokens`). Prompts are left-padded; every position's
    hidden states come from the forward that ran it, so the last generated token gets one more
    forward of its own.
    """
    device = next(model.parameters()).device
    base, target_logits = model.model, TargetLogits.of(model)
    b, longest = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((b, longest), pad_id, dtype=torch.int64)
    mask = torch.zeros((b, longest), dtype=torch.int64)
    for i, p in enumerate(prompts):
        ids[i, longest - len(p) :] = torch.tensor(p)
        mask[i, longest - len(p) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = generation_cache(model.config, longest + max_new_tokens + 1)
    slots = torch.arange(longest, device=device)
    finals, answers = [], []
    eos = torch.tensor(sorted(eos_ids), device=device)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    step_ids = ids
    with layer_inputs(model, aux_layer_ids) as captured:
        while True:
            out = base(
                input_ids=step_ids,
                attention_mask=mask,
                position_ids=positions,
                **cache_argument(base, cache),
                cache_position=slots,
                use_cache=True,
            )
            finals.append(out.last_hidden_state)
            if len(answers) == max_new_tokens or bool(done.all()):
                break
            token = target_logits(out.last_hidden_state[:, -1]).argmax(-1)
            answers.append(token)
            done |= torch.isin(token, eos)
            step_ids = token[:, None]
            positions = positions[:, -1:] + 1
            slots = slots[-1:] + 1
            mask = torch.cat([mask, torch.ones((b, 1), dtype=mask.dtype, device=device)], dim=-1)
    aux = torch.cat([torch.cat(captured[i], dim=1) for i in aux_layer_ids], dim=-1)
    final = torch.cat(finals, dim=1)
    answer = torch.stack(answers, dim=1).cpu()
    samples = []
    for i, p in enumerate(prompts):
        a = answer[i].tolist()
        n = next((k + 1 for k, t in enumerate(a) if t in eos_ids), len(a))
        start, end = longest - len(p), longest + n
        samples.append(
            {
                "input_ids": torch.tensor(p + a[:n], dtype=torch.int64),
                "loss_mask": torch.arange(len(p) + n) >= len(p),
                "aux_hidden": aux[i, start:end],
                "final_hidden": final[i, start:end],
            }
        )
    return samples


def plan_prompts(tokenizer, conversations, limit: int | None, max_length: int, max_new_tokens: int, system_prompt):
    """(sample ids, prompt ids) of up to `limit` first turns that leave room for an answer, shortest first.

    The sample id is the conversation's index among those read, so a store traces back to its source.
    """
    planned = []
    for index, conv in enumerate(conversations):
        if limit is not None and len(planned) >= limit:
            break
        head = first_turn_prompt(with_system_prompt(conv["messages"], system_prompt))
        if head is None:
            continue
        text = tokenizer.apply_chat_template(head, tokenize=False, add_generation_prompt=True)
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(prompt) + max_new_tokens <= max_length:
            planned.append((index, prompt))
    return sorted(planned, key=lambda x: (len(x[1]), x[0]))


def distil(
    model,
    tokenizer,
    data: str,
    out: str | Path,
    *,
    target_name: str,
    limit: int | None = None,
    split: str = "train",
    max_length: int = MAX_LENGTH,
    max_new_tokens: int = 256,
    batch_size: int = 64,
    system_prompt: str | None = None,
    aux_layer_ids=None,
    dtype: str = "bfloat16",
    draft_vocab_size: int = DRAFT_VOCAB_SIZE,
    engine: str = "hf",
    engine_options: dict | None = None,
    progress: bool = True,
) -> tuple[dict, dict]:
    """Answer up to `limit` first turns of `data` with the target and store the answers' hidden states in `out`.

    Returns (the store's manifest, {"prompts", "answer_tokens", "tokens", "seconds"} of this run, and with
    vLLM "engine_start_seconds", included in "seconds").
    The store is the one `eagle-prep capture` writes (same format, vocab map included), so offline
    training reads it as is. A rerun with the same settings resumes; other settings are refused.

    `engine`: "hf" answers here with `model`, in batches of `batch_size` that wait for their longest
    answer; "vllm" has vLLM answer each shard of `batch_size` prompts with continuous batching and
    capture while it generates (`engines.vllm.distil`, `engine_options` passed to it; `model` unused,
    may be None). One store is made by one engine: the plan records which.
    """
    if engine not in ENGINES:
        raise ValueError(f"engine {engine!r} is not one of {ENGINES}")
    if engine == "vllm":
        from engines.vllm import missing

        reason = missing()
        if reason:
            raise ValueError(f"--engine vllm: {reason}")
    config = model.config if model is not None else load_target_config(target_name)
    ids = tuple(aux_layer_ids) if aux_layer_ids is not None else default_aux_layer_ids(config.num_hidden_layers)
    conversations = read_conversations(data, split=split)
    planned = plan_prompts(tokenizer, conversations, limit, max_length, max_new_tokens, system_prompt)
    if not planned:
        raise ValueError(
            f"no first turn of {data!r} leaves room for {max_new_tokens} new tokens within max_length={max_length}: "
            "raise max_length or lower max_new_tokens"
        )
    batches = [planned[k : k + batch_size] for k in range(0, len(planned), batch_size)]
    header = {
        "tokenizer": target_name,
        "chat_template_fingerprint": chat_template_fingerprint(tokenizer.chat_template),
        "max_length": max_length,
        "source": str(data),
        "plan": {
            "distil": "greedy first-turn answers, captured while generated",
            "engine": engine,
            "max_new_tokens": max_new_tokens,
            "batch_size": batch_size,
            "system_prompt": system_prompt,
            "num_shards": len(batches),
            "source_samples": len(planned),
        },
    }
    out = Path(out)
    fingerprint = target_fingerprint(model) if model is not None else files_fingerprint(target_name)
    header = start_store(out, header, config, fingerprint, target_name, ids, dtype)
    todo = pending_shards(out, {k: [i for i, _ in batch] for k, batch in enumerate(batches)})
    stats = {"prompts": 0, "answer_tokens": 0, "tokens": 0, "seconds": 0.0}
    start = time.perf_counter()
    bar = tqdm(total=sum(len(batches[k]) for k in todo), unit="prompt", desc=f"distil ({engine})", disable=not progress)

    def shown(prompts: int, answer_tokens: int, tokens: int) -> None:
        stats["prompts"] += prompts
        stats["answer_tokens"] += answer_tokens
        stats["tokens"] += tokens
        bar.update(prompts)
        bar.set_postfix(answer_tok_s=f"{stats['answer_tokens'] / (time.perf_counter() - start):.0f}")

    if engine == "vllm":
        from engines import vllm

        eos_ids = end_of_turn_ids(SimpleNamespace(generation_config=load_generation_config(target_name)), tokenizer)
        started = vllm.distil(
            target_name,
            {k: batches[k] for k in todo},
            out,
            max_new_tokens=max_new_tokens,
            aux_layer_ids=ids,
            dtype=dtype,
            stop_ids=eos_ids,
            engine_options={"max_num_seqs": batch_size, **(engine_options or {})},
            progress=shown,
        )
        stats["engine_start_seconds"] = started["init_seconds"]
    else:
        eos_ids = end_of_turn_ids(model, tokenizer)
        with StoreWriter(out, dtype) as writer:
            for k in todo:
                samples = generate_and_capture(
                    model, [p for _, p in batches[k]], max_new_tokens, ids, eos_ids, tokenizer.pad_token_id
                )
                for i, s in zip((i for i, _ in batches[k]), samples):
                    where = f"the target's hidden states while answering prompt {i} of {data!r}"
                    s.update(encode_checked(s.pop("aux_hidden"), s.pop("final_hidden"), dtype, where))
                writer.add_shard(k, samples, [i for i, _ in batches[k]])
                answer_tokens = sum(int(s["loss_mask"].sum()) for s in samples)
                shown(len(samples), answer_tokens, sum(len(s["input_ids"]) for s in samples))
    bar.close()
    stats["seconds"] = time.perf_counter() - start
    manifest = finish_store(out, header, len(batches))
    vmap = make_vocab_map(out, config.vocab_size, draft_vocab_size)
    return manifest, {**stats, "vocab_map": vmap}
