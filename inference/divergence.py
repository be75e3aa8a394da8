"""Where greedy speculative decoding parts from plain decoding, and whether rounding explains it.

Greedy speculative decoding emits the target's argmax at every position, so its tokens are plain
decoding's in exact arithmetic. A verification forward runs several positions at once and rounds
differently from plain decoding's one-token steps: in bf16 or fp16, where the target's two best
tokens are nearly tied, the argmax can flip, and from there the two texts part. A flip is harmless;
a part where the target clearly preferred plain's token is a decoding bug. The measure that tells
them apart is the gap between the two tokens' logits at the first differing position, from one
more forward over the shared prefix, counted in the dtype's rounding steps at the logits' size.
"""

import math

import torch

# A gap of at most this many rounding steps is a near tie; a larger one is reported as a bug: rounding
# accumulated over a deep target's layers moves its logits by a few steps, a wrong token by many.
TIE_STEPS = 8


def first_divergence(runtime, prompt_ids, plain_ids: list[int], other_ids: list[int], max_new_tokens: int):
    """None when `other_ids` is `plain_ids`, else where they first differ and the target's logit gap there
    (plain's token minus the other's; a tie flipped by rounding is near 0, either sign)."""
    p = next((i for i, (a, b) in enumerate(zip(plain_ids, other_ids)) if a != b), None)
    if p is None:
        return None
    logits = runtime.next_token_logits(prompt_ids, plain_ids[:p], max_new_tokens)
    plain_logit, other_logit = logits[plain_ids[p]].item(), logits[other_ids[p]].item()
    size = max(abs(plain_logit), abs(other_logit), torch.finfo(logits.dtype).tiny)
    step = torch.finfo(logits.dtype).eps * 2.0 ** math.floor(math.log2(size))
    gap = plain_logit - other_logit
    return {
        "position": p,
        "plain_token": plain_ids[p],
        "other_token": other_ids[p],
        "logit_gap": gap,
        "rounding_steps": gap / step,
        "dtype": str(logits.dtype).replace("torch.", ""),
    }


def is_tie(divergence: dict) -> bool:
    return abs(divergence["rounding_steps"]) <= TIE_STEPS
