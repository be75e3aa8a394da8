"""Prompt-lookup drafting: the free baseline a trained head has to beat.

No head and no forward: the drafts are the tokens that followed the most recent earlier occurrence
of the longest suffix n-gram of the history (prompt and output so far), n from 4 down to 2, as
vLLM's n-gram proposer and llama.cpp's ngram-simple do. `PromptLookup` speaks the runtime's drafter
interface (catch_up records the committed tokens, draft lays the proposal out as a chain), so the
head's verification, acceptance and counters serve it unchanged. An empty proposal leaves the
root alone: the round is a plain decoding step.
"""

import torch

from inference.drafting import DraftTree, TreeShape

MAX_N, MIN_N = 4, 2


def propose(history: list[int], k: int, max_n: int = MAX_N, min_n: int = MIN_N) -> list[int]:
    """Up to k tokens after the most recent earlier occurrence of the longest suffix n-gram of
    `history` (min_n <= n <= max_n); [] when no such n-gram occurred before. Occurrences may
    overlap the suffix; the proposal stops where the history does."""
    end = len(history)
    best_n, best_next = 0, 0
    for last in range(end - 2, -1, -1):  # an earlier occurrence ending at `last`, newest first
        n = 0
        while n < max_n and n <= last and history[last - n] == history[end - 1 - n]:
            n += 1
        if n > best_n:  # ties keep the newer occurrence
            best_n, best_next = n, last + 1
            if n == max_n:
                break
    return history[best_next : best_next + k] if best_n >= min_n else []


def chain_tree(tokens: torch.Tensor) -> DraftTree:
    """The chain root -> tokens[1] -> ... as a DraftTree without draft distributions (the drafts
    are deterministic: `Runtime.accept` then treats each draft's q as one-hot)."""
    n, dev = tokens.shape[0], tokens.device
    index = torch.arange(n, device=dev)
    return DraftTree(
        tokens=tokens,
        parents=(index - 1).clamp(min=0),
        depths=index,
        ancestors=index[None, :] <= index[:, None],
        dist_index=torch.full((n,), -1, device=dev),
        dists=None,
    )


class PromptLookup:
    """A drafter for one generation from `prompt_ids`: chains of up to k looked-up tokens."""

    def __init__(self, prompt_ids, k: int):
        self.shape = TreeShape.chain(k)  # the most the runtime verifies per round
        self.history = [int(t) for t in prompt_ids]

    def catch_up(self, aux, next_ids, start: int):
        """Record the tokens x_{start+1}.. just committed (the runtime's catch-up call); the lookup
        reads no hidden states and has no root state."""
        del self.history[start + 1 :]
        self.history += next_ids[0].tolist()
        return None, None

    catch_up_padded = catch_up

    def draft(self, root_token: torch.Tensor, h_root, logits_root, length: int) -> DraftTree:
        drafts = torch.tensor(propose(self.history, self.shape.depth), dtype=torch.long, device=root_token.device)
        return chain_tree(torch.cat([root_token.reshape(1), drafts]))
