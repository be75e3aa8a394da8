"""Render conversations with the tokenizer's own chat template and mark the assistant tokens.

The loss mask covers exactly each assistant message's content tokens plus the end-of-turn token
that closes it. Nothing here knows any template's separators: the conversation is rendered, each
assistant message is located in the rendered text (after the rendering of the conversation up to
that turn with the generation prompt, which every template emits right before the content), and
character offsets are mapped to tokens. The end-of-turn token is the first non-blank token after
the content, inside the text the template adds for that turn.
"""

import torch

MAX_LENGTH = 2048  # tokens a conversation is cut to (tokenize) and must leave room within (regenerate)

ANSI_MASK = "\x1b[42;30m"  # black on green
ANSI_RESET = "\x1b[0m"


class SkipSample(ValueError):
    """A conversation that cannot become a training sample; the message is the reported reason."""


def with_system_prompt(messages: list[dict], system_prompt: str | None) -> list[dict]:
    """Replace the conversation's system messages with `system_prompt` (None keeps them)."""
    if system_prompt is None:
        return messages
    return [{"role": "system", "content": system_prompt}] + [m for m in messages if m["role"] != "system"]


def _render(tokenizer, messages, add_generation_prompt=False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def render(tokenizer, messages: list[dict]) -> str:
    try:
        return _render(tokenizer, messages)
    except Exception as e:  # jinja raises its own errors, e.g. "roles must alternate"
        raise SkipSample(f"chat template error: {str(e).splitlines()[0][:80]}") from e


def assistant_char_spans(tokenizer, messages: list[dict], text: str, char_limit: int | None = None):
    """Per assistant turn of the rendered `text`: (content start, content end, turn end) in characters.

    Turns starting at or after `char_limit` (where truncation cuts) are not searched.
    """
    spans, cursor = [], 0
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if char_limit is not None and cursor >= char_limit:
            break
        if not message["content"].strip():
            continue
        head = _prefix(tokenizer, messages[:k], add_generation_prompt=True)
        lo = max(len(head) if head is not None and text.startswith(head) else 0, cursor)
        # the content as given, else trimmed (many templates trim it)
        for content in (message["content"], message["content"].strip()):
            start = text.find(content, lo)
            if start >= 0:
                break
        else:
            raise SkipSample("chat template changes the assistant text (cannot locate it to mask)")
        end = start + len(content)
        turn = _prefix(tokenizer, messages[: k + 1])
        turn_end = len(turn) if turn is not None and text.startswith(turn) else len(text)
        spans.append((start, end, max(turn_end, end)))
        cursor = end
    return spans


def _prefix(tokenizer, messages, add_generation_prompt=False):
    if not messages:
        return None
    try:
        return _render(tokenizer, messages, add_generation_prompt)
    except Exception:  # a partial conversation some templates reject; fall back to searching
        return None


def tokenize_conversation(
    tokenizer, messages: list[dict], max_length: int | None = None, system_prompt: str | None = None
) -> dict[str, torch.Tensor]:
    """Return `input_ids` int64 [T] and `loss_mask` bool [T]; raise SkipSample with the reason if unusable."""
    messages = with_system_prompt(messages, system_prompt)
    text = render(tokenizer, messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    char_limit = offsets[max_length][0] if max_length is not None and len(ids) > max_length else None
    spans = assistant_char_spans(tokenizer, messages, text, char_limit)
    mask = [False] * len(ids)
    t = 0
    for start, end, turn_end in spans:
        while t < len(ids) and offsets[t][1] <= start:
            t += 1
        while t < len(ids) and offsets[t][0] < end:
            mask[t] = True
            t += 1
        # the end-of-turn token: first non-blank token the template put after the content
        while t < len(ids) and offsets[t][0] < turn_end and not text[offsets[t][0] : offsets[t][1]].strip():
            t += 1
        if t < len(ids) and offsets[t][0] < turn_end:
            mask[t] = True
            t += 1
    if max_length is not None:
        ids, mask = ids[:max_length], mask[:max_length]
    if not any(mask):
        raise SkipSample("no assistant tokens within max_length" if spans else "no assistant turn")
    return {"input_ids": torch.tensor(ids, dtype=torch.int64), "loss_mask": torch.tensor(mask, dtype=torch.bool)}


def masked_spans(tokenizer, input_ids, loss_mask) -> list[str]:
    """Decoded text of each contiguous run of loss-masked tokens."""
    spans, run = [], []
    for tok, m in zip(list(input_ids), list(loss_mask)):
        if m:
            run.append(int(tok))
        elif run:
            spans.append(tokenizer.decode(run))
            run = []
    if run:
        spans.append(tokenizer.decode(run))
    return spans


def show_mask(tokenizer, input_ids, loss_mask, color: bool = True) -> str:
    """The sample's text with loss-masked spans highlighted (ANSI colour) or wrapped in [[ ]]."""
    open_, close = (ANSI_MASK, ANSI_RESET) if color else ("[[", "]]")
    out, run, state = [], [], None
    for tok, m in zip(list(input_ids), list(loss_mask)):
        if state is not None and bool(m) != state:
            text = tokenizer.decode(run)
            out.append(f"{open_}{text}{close}" if state else text)
            run = []
        run.append(int(tok))
        state = bool(m)
    if run:
        text = tokenizer.decode(run)
        out.append(f"{open_}{text}{close}" if state else text)
    return "".join(out)
