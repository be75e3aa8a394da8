"""Replace assistant turns with the target's own responses (self-distillation data).

A draft trained on what the target actually says accepts more tokens than one trained on
another model's answers. Conversations are processed in batches, turn by turn: the k-th
assistant turn of every conversation in the batch is generated in one left-padded `generate`
call, conditioned on the regenerated turns before it. Finished conversations are appended to a
JSONL file as they complete; a rerun skips the ids already there, so a killed run resumes.
"""

import json
from pathlib import Path

import torch

from data_prep.chat import MAX_LENGTH, with_system_prompt


def done_ids(path: Path) -> set[str]:
    """Ids already written (a torn last line from a kill is ignored and rewritten)."""
    ids = set()
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                ids.add(json.loads(line)["id"])
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
    return ids


def _generate(model, tokenizer, prompts: list[str], max_new_tokens: int, temperature: float, top_p: float) -> list[str]:
    enc = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    enc = enc.to(next(model.parameters()).device)
    kwargs = {"do_sample": False}
    if temperature > 0:
        kwargs = {"do_sample": True, "temperature": temperature, "top_p": top_p}
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id, **kwargs)
    return [t.strip() for t in tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)]


def regenerate_batch(
    model,
    tokenizer,
    conversations: list[dict],
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    max_length: int = MAX_LENGTH,
    system_prompt: str | None = None,
    max_turns: int | None = None,
) -> list[dict]:
    """Return the conversations with every assistant turn replaced by the target's response.

    An assistant turn before any user turn is dropped (there is nothing to answer). A
    conversation stops at the first turn whose prompt leaves no room for `max_new_tokens`
    within `max_length`, or after `max_turns` regenerated turns (the cost of a conversation grows
    with every turn); one with no turn regenerated comes back with no messages.
    """
    convs = [
        {"id": c["id"], "source": with_system_prompt(c["messages"], system_prompt), "messages": []}
        for c in conversations
    ]
    cursors = [0] * len(convs)
    active = list(range(len(convs)))
    while active:
        prompts, owners = [], []
        for c in list(active):
            src, msgs = convs[c]["source"], convs[c]["messages"]
            while cursors[c] < len(src) and src[cursors[c]]["role"] != "assistant":
                msgs.append(src[cursors[c]])
                cursors[c] += 1
            answered = sum(m["role"] == "assistant" for m in msgs)
            if cursors[c] == len(src) or (max_turns is not None and answered >= max_turns):
                active.remove(c)
                continue
            if not any(m["role"] == "user" for m in msgs):  # nothing asked yet (ShareGPT has such turns)
                cursors[c] += 1
                continue
            prompt = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            if len(tokenizer(prompt, add_special_tokens=False)["input_ids"]) + max_new_tokens > max_length:
                active.remove(c)
                continue
            prompts.append(prompt)
            owners.append(c)
        if prompts:
            for c, reply in zip(owners, _generate(model, tokenizer, prompts, max_new_tokens, temperature, top_p)):
                convs[c]["messages"].append({"role": "assistant", "content": reply})
                cursors[c] += 1
    out = []
    for c in convs:
        msgs = c["messages"]
        while msgs and msgs[-1]["role"] != "assistant":  # drop a trailing unanswered prompt
            msgs.pop()
        out.append({"id": c["id"], "messages": msgs})
    return out


def regenerate(model, tokenizer, conversations, out: str | Path, batch_size: int = 8, progress=None, **kwargs) -> dict:
    """Regenerate an iterable of conversations into the JSONL file `out`, skipping ids already there.

    Returns counts: written, skipped_done (already in the file), empty (nothing could be generated).
    """
    if kwargs.get("max_turns") is not None and kwargs["max_turns"] < 1:
        raise ValueError(f"max_turns must be >= 1 (or None for every turn), got {kwargs['max_turns']}")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = done_ids(out)
    counts = {"written": 0, "skipped_done": 0, "empty": 0}
    batch = []

    def flush():
        with out.open("a", encoding="utf-8") as f:
            for conv in regenerate_batch(model, tokenizer, batch, **kwargs):
                if conv["messages"]:
                    f.write(json.dumps(conv, ensure_ascii=False) + "\n")
                    counts["written"] += 1
                else:
                    counts["empty"] += 1
        if progress is not None:
            progress.update(len(batch))
        batch.clear()

    _repair_tail(out)
    for conv in conversations:
        if conv["id"] in done:
            counts["skipped_done"] += 1
            continue
        batch.append(conv)
        if len(batch) == batch_size:
            flush()
    if batch:
        flush()
    return counts


def _repair_tail(path: Path) -> None:
    """Cut a torn last line left by a kill, so appended records start on a line of their own."""
    if not path.is_file():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        path.write_bytes(data[: data.rfind(b"\n") + 1])
