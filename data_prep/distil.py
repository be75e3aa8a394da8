"""Self-distilled hidden-state store in one pass: the target answers, and the same forwards are the capture.

Regenerating answers as text and then capturing them runs the target twice over every answer
token, and re-tokenizing the decoded text can give other tokens than the ones the target chose.
Here the target answers the user turns of each conversation greedily (the first, or the first N,
or all), batched, and the hidden states the head reads are kept from those very forwards: the
sample is the token sequence greedy decoding produces, each answer loss-masked with its
end-of-turn token.

Later turns are chained as tokens: the k-th prompt is the conversation so far (earlier prompts and
the target's own answers, as generated) followed by the tokens the chat template puts between an
answer's end-of-turn token and the next generation prompt. The k-th turns of a batch of
conversations are answered together, and the forwards of a conversation's last turn run over the
whole sequence, so they are its sample's hidden states.

Conversations are planned up front (sorted by length so a batch pads little), one batch per
shard, so a killed run resumes at the first missing shard and ends with the same store, and
several runs (`shard=(i, n)`) can each write every n-th shard of one store; the one that finds the
store whole finishes it.
"""

import contextlib
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import torch
import transformers
from tqdm import tqdm
from transformers import DynamicCache, StaticCache

from data_prep.capture import engine_dtype, finish_store, pending_shards, start_store
from data_prep.chat import MAX_LENGTH, with_system_prompt
from data_prep.readers import read_conversations
from data_prep.vocab import make_vocab_map
from eagle_train.hidden_states import TargetLogits, cache_argument, default_aux_layer_ids, layer_inputs
from eagle_train.store import (
    StoreWriter,
    chat_template_fingerprint,
    encode_checked,
    list_shards,
    target_fingerprint,
)
from eagle_train.target import end_of_turn_ids, files_fingerprint, load_generation_config, load_target_config
from eagle_train.vocab_map import DRAFT_VOCAB_SIZE

ENGINES = ("hf", "vllm")  # who answers and captures: transformers here, or vLLM (engines/vllm_data.py)
ANSWER = "\x00answer\x00"  # stands for an answer the target writes, when a chat template renders a conversation


def turn_prompts(messages: list[dict]) -> list[list[dict]]:
    """The prompt of each turn the target answers: the messages before each assistant message that has a user
    question since the previous answer (ShareGPT has turns that do not; such an assistant message is dropped),
    earlier answers replaced by `ANSWER`. A trailing question without an answer is not a turn."""
    prompts, history, asked = [], [], False
    for m in messages:
        if m["role"] != "assistant":
            history.append(m)
            asked |= m["role"] == "user" and bool(m["content"].strip())
        elif asked:
            prompts.append(list(history))
            history.append({"role": "assistant", "content": ANSWER})
            asked = False
    return prompts


def chained_end_of_turn(tokenizer, eos_ids) -> int:
    """The end-of-turn id after which the chat template continues a conversation: an answer that ends with it is
    followed by the next turn's tokens. One line when the template renders an earlier answer otherwise."""
    probe = [
        {"role": "user", "content": "Hi."},
        {"role": "assistant", "content": ANSWER},
        {"role": "user", "content": "?"},
    ]
    first, second = (render_prompt(tokenizer, probe[:n]) for n in (1, 3))
    for i in sorted(eos_ids):
        if second.startswith(first + ANSWER + tokenizer.decode([i])):
            return i
    raise ValueError(
        "this chat template does not render an earlier answer as the target wrote it, closed by one of its "
        f"end-of-turn tokens {sorted(eos_ids)}, so answers cannot be chained into later turns: use --turns 1, "
        "or regenerate + tokenize + capture (eagle-prep run with prep.distil.enabled=false)"
    )


def render_prompt(tokenizer, messages: list[dict]) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def turn_segments(tokenizer, prompts: list[list[dict]], end_text: str) -> tuple[list[list[int]], str | None]:
    """The ids each turn adds: the first prompt whole, then what follows the previous answer's end-of-turn token
    (`end_text`) up to the next generation prompt; and why the turns after those were left out (None: none
    were): the template refused to render a prompt, or rendered an earlier answer otherwise."""
    segments, before = [], None
    for prompt in prompts:
        try:
            text = render_prompt(tokenizer, prompt)
        except Exception as e:  # jinja raises its own errors, e.g. "roles must alternate"
            return segments, f"chat template error: {str(e).splitlines()[0][:80]}"
        cut = 0 if before is None else len(before + ANSWER + end_text)
        if before is not None and not text.startswith(before + ANSWER + end_text):
            return segments, "the chat template renders an earlier answer otherwise"
        segments.append(tokenizer(text[cut:], add_special_tokens=False)["input_ids"])
        before = text
    return segments, None


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


def plan_conversations(
    tokenizer, conversations, limit: int | None, max_length: int, max_new_tokens: int, system_prompt, turns, end_id
) -> tuple[list[tuple[int, list[list[int]]]], Counter]:
    """(sample id, turn segments) of up to `limit` conversations whose first prompt leaves room for an answer,
    shortest first; at most `turns` turns each (None: all), and only those that could still fit. Also how many
    conversations lost turns (or were left out) to their chat template, per reason.

    The sample id is the conversation's index among those read, so a store traces back to its source.
    """
    end_text = tokenizer.decode([end_id]) if end_id is not None else ""
    planned, cut = [], Counter()
    for index, conv in enumerate(conversations):
        if limit is not None and len(planned) >= limit:
            break
        prompts = turn_prompts(with_system_prompt(conv["messages"], system_prompt))[:turns]
        if not prompts:
            continue
        segments, reason = turn_segments(tokenizer, prompts, end_text)
        if reason is not None:
            cut[reason] += 1
        fit = [k for k in range(len(segments)) if sum(map(len, segments[: k + 1])) + max_new_tokens <= max_length]
        if fit and fit[0] == 0:
            planned.append((index, segments[: len(fit)]))
    return sorted(planned, key=lambda x: (sum(map(len, x[1])), x[0])), cut


def answer_turns(answer, conversations, max_new_tokens: int, max_length: int, end_id: int | None) -> list[dict]:
    """Answer each conversation's turns in order, the k-th turns of all in one call of `answer` (prompts ->
    samples of `input_ids`, `aux_hidden`, `final_hidden`). A conversation goes on while its answer ended with
    `end_id` and its next turn leaves room for an answer within `max_length`. Returns per conversation its last
    sample (the whole sequence) with `loss_mask` over every answer."""
    ids = [[] for _ in conversations]
    masks = [[] for _ in conversations]
    last = [None] * len(conversations)

    def asks(c: int, turn: int) -> bool:
        segments = conversations[c][1]
        if turn >= len(segments):
            return False
        return turn == 0 or (ids[c][-1] == end_id and len(ids[c]) + len(segments[turn]) + max_new_tokens <= max_length)

    for turn in range(max(len(segments) for _, segments in conversations)):
        asked = [c for c in range(len(conversations)) if asks(c, turn)]
        if not asked:
            break
        prompts = [ids[c] + conversations[c][1][turn] for c in asked]
        for c, prompt, sample in zip(asked, prompts, answer(prompts)):
            ids[c] = sample["input_ids"].tolist()
            masks[c] += [False] * len(conversations[c][1][turn]) + [True] * (len(ids[c]) - len(prompt))
            last[c] = sample
    return [{**sample, "loss_mask": torch.tensor(mask)} for sample, mask in zip(last, masks)]


def with_every_row(sample: dict) -> dict:
    """vLLM samples the last token without running it, so it has no hidden states: zeros, which training never
    reads (methods/eagle3/ttt.py supervises position p from rows <= T - 2; methods/peagle/batch.py likewise)."""
    t = len(sample["input_ids"])
    for key in ("aux_hidden", "final_hidden"):
        rows = sample[key]
        if len(rows) < t:
            sample[key] = torch.cat([rows, rows.new_zeros(t - len(rows), rows.shape[1])])
    return sample


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
    turns: int | None = 1,
    batch_size: int = 64,
    system_prompt: str | None = None,
    aux_layer_ids=None,
    dtype: str = "bfloat16",
    draft_vocab_size: int = DRAFT_VOCAB_SIZE,
    engine: str = "hf",
    engine_options: dict | None = None,
    shard: tuple[int, int] = (0, 1),
    progress: bool = True,
) -> tuple[dict | None, dict]:
    """Answer up to `limit` conversations of `data` with the target, `turns` user turns each (None: all), and
    store the answers' hidden states in `out`.

    Returns (the store's manifest, or None while shards of other runs are missing; {"conversations",
    "answers", "answer_tokens", "tokens", "seconds", "vocab_map", "engine_dtype"} of this run, "cut" (per
    reason, the conversations that lost turns to their chat template) and with vLLM "engine_start_seconds",
    included in "seconds").
    The store is the one `eagle-prep capture` writes (same format, vocab map included), so offline
    training reads it as is. A rerun with the same settings resumes; other settings are refused.

    `engine`: "hf" answers here with `model`, in its dtype, in batches of `batch_size` that wait for their
    longest answer; "vllm" has one vLLM engine (`engines.vllm_data.HiddenStatesServer`, `engine_options` passed to
    it; `model` unused, may be None) answer each turn of a shard's `batch_size` conversations with
    continuous batching, capturing while it generates. One store is made by one engine in one dtype: the plan
    records which. `shard=(i, n)`: this run answers shards i, i + n, ... of the plan; n runs with the same settings
    fill one store, and the run that finds every shard written finishes it.
    """
    if engine not in ENGINES:
        raise ValueError(f"engine {engine!r} is not one of {ENGINES}")
    index, runs = shard
    if not 0 <= index < runs:
        raise ValueError(f"shard {index}/{runs}: the index must be 0 .. {runs - 1}")
    if turns is not None and turns < 1:
        raise ValueError(f"turns={turns}: answer at least one turn (or all)")
    dtype_run = engine_dtype(engine, model, engine_options)
    if engine == "vllm":
        from engines.vllm_child import missing

        reason = missing()
        if reason:
            raise ValueError(f"--engine vllm: {reason}")
        engine_options = {**(engine_options or {}), "dtype": dtype_run}  # the dtype the plan records
    config = model.config if model is not None else load_target_config(target_name)
    ids = tuple(aux_layer_ids) if aux_layer_ids is not None else default_aux_layer_ids(config.num_hidden_layers)
    generation = model if model is not None else SimpleNamespace(generation_config=load_generation_config(target_name))
    eos_ids = end_of_turn_ids(generation, tokenizer)
    end_id = chained_end_of_turn(tokenizer, eos_ids) if turns != 1 else None
    conversations = read_conversations(data, split=split)
    planned, cut = plan_conversations(
        tokenizer, conversations, limit, max_length, max_new_tokens, system_prompt, turns, end_id
    )
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
            "distil": "greedy answers, turn after turn, captured while generated",
            "engine": engine,
            "engine_dtype": dtype_run,  # no resume mixes dtypes
            "turns": turns,
            "max_new_tokens": max_new_tokens,
            "batch_size": batch_size,
            "system_prompt": system_prompt,
            "num_shards": len(batches),
            "source_samples": len(planned),
        },
    }
    out = Path(out)
    fingerprint = target_fingerprint(model) if model is not None else files_fingerprint(target_name)
    header = start_store(out, header, config, fingerprint, target_name, ids, dtype, world_size=runs)
    todo = pending_shards(out, {k: [i for i, _ in batches[k]] for k in range(index, len(batches), runs)})
    stats = {"conversations": 0, "answers": 0, "answer_tokens": 0, "tokens": 0, "seconds": 0.0, "cut": dict(cut)}
    stats["engine_dtype"] = dtype_run
    start = time.perf_counter()
    bar = tqdm(total=sum(len(batches[k]) for k in todo), unit="conv", desc=f"distil ({engine})", disable=not progress)
    if engine == "vllm" and todo:
        from engines.vllm_data import HiddenStatesServer

        server = HiddenStatesServer(target_name, ids, {"max_num_seqs": batch_size, **engine_options})
        stats["engine_start_seconds"] = server.init_seconds

        def answer(prompts):
            return server.answer(prompts, max_new_tokens, eos_ids)
    else:
        server = contextlib.nullcontext()

        def answer(prompts):
            return generate_and_capture(model, prompts, max_new_tokens, ids, eos_ids, tokenizer.pad_token_id)

    def counted(prompts):
        stats["answers"] += len(prompts)
        return answer(prompts)

    with server, StoreWriter(out, dtype, rank=index) as writer:
        for k in todo:
            samples = answer_turns(counted, batches[k], max_new_tokens, max_length, end_id)
            for (i, _), sample in zip(batches[k], samples):
                where = f"the target's hidden states while answering conversation {i} of {data!r}"
                sample = with_every_row(sample)
                sample.update(encode_checked(sample.pop("aux_hidden"), sample.pop("final_hidden"), dtype, where))
            writer.add_shard(k, samples, [i for i, _ in batches[k]])
            stats["conversations"] += len(samples)
            stats["answer_tokens"] += sum(int(s["loss_mask"].sum()) for s in samples)
            stats["tokens"] += sum(len(s["input_ids"]) for s in samples)
            bar.update(len(samples))
            bar.set_postfix(answer_tok_s=f"{stats['answer_tokens'] / (time.perf_counter() - start):.0f}")
    bar.close()
    stats["seconds"] = time.perf_counter() - start
    if {k for k, _ in list_shards(out)} != set(range(len(batches))):
        return None, stats
    manifest = finish_store(out, header, len(batches))
    return manifest, {**stats, "vocab_map": make_vocab_map(out, config.vocab_size, draft_vocab_size)}
