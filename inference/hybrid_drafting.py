"""Head + n-gram drafting, llama.cpp's rule for combined speculative types: each round drafts by n-gram lookup
where the lookup finds a draft, else by the head.

The head catches up after every verification whichever drafted the round (its cache must hold every committed
position), so a round the lookup drafts costs no head step but the catch-up the head pays anyway. Rounds are
verified as usual; a looked-up chain carries no draft distributions (`Runtime.accept` then takes each draft's q
as one-hot), so greedy and sampled decoding stay lossless.
"""

from inference.prompt_lookup import PromptLookup


class HybridDrafter:
    """A drafter for one generation: `lookup`'s chain where it proposes one, else `head`'s draft (a Drafter of the
    runtime's head, whose shape holds any chain of the lookup's K)."""

    def __init__(self, lookup: PromptLookup, head):
        if lookup.shape.depth > head.shape.depth:
            raise ValueError(f"head + n-gram drafts up to the head's K={head.shape.depth}, not {lookup.shape.depth}")
        self.lookup, self.head = lookup, head
        self.shape = head.shape

    def begin(self, prompt):
        if hasattr(self.head, "begin"):
            self.head.begin(prompt)

    def catch_up(self, aux, next_ids, start: int):
        self.lookup.catch_up(aux, next_ids, start)
        return self.head.catch_up(aux, next_ids, start)

    def catch_up_padded(self, aux, next_ids, start: int):
        self.lookup.catch_up(aux, next_ids, start)
        return self.head.catch_up_padded(aux, next_ids, start)

    def draft(self, root_token, h_root, logits_root, length: int):
        looked_up = self.lookup.draft(root_token, h_root, logits_root, length)
        if looked_up.tokens.shape[0] > 1:  # the root and at least one draft
            return looked_up
        return self.head.draft(root_token, h_root, logits_root, length)
