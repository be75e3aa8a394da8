"""Drafting with a draft model: a chain of K tokens, each a step of the draft over its own cache.

The draft runs through the runtime's view of a causal LM (`hf_target.target_view`: the fast Llama forward where it is
exact, else the model's own modules over a slot cache), slot = position, and holds every committed token x_0..x_L,
the pending one included. A round drafts d_1 from the catch-up's last row, then runs d_1..d_{K-1} at L+1..L+K-1 for
the rest; the catch-up after verification writes the accepted drafts and the bonus token at the positions after L,
over the speculative entries. Chains only: a draft model's step is a whole model, and a tree multiplies them.
Sampled drafts are drawn from the warped draft distribution, which the rejection sampler accepts against.
"""

import torch

from inference.drafting import DraftTree, TreeShape
from inference.hf_target import target_view


class ModelDrafter:
    """The runtime's drafter of a `DraftModel` (the `model` family). No CUDA graphs: its steps run eagerly."""

    def __init__(self, head, shape: TreeShape, sampler, graphed: bool = False):
        if not shape.is_chain:
            raise ValueError("a draft model drafts a chain (--chain K); trees need an EAGLE-3 head")
        self.head, self.shape, self.sampler = head, shape, sampler
        self.draft_model = target_view(head.lm, (0,))
        self.max_len = 0
        self.first = None

    def setup_cache(self, max_len: int):
        size = max_len + self.shape.depth
        if size > self.max_len:
            self.draft_model.setup_cache(size)
            self.max_len = size

    def begin(self, prompt):
        """A new generation: the prompt's first token, which the prefill's catch-up does not carry."""
        self.first = prompt[:, :1]

    def run(self, ids, start: int):
        """The draft over `ids` [1, n] at positions and slots start..start+n-1: its logits [n, V]."""
        pos = torch.arange(start, start + ids.shape[1], device=ids.device)
        keys = torch.arange(start + ids.shape[1], device=ids.device)
        final, _ = self.draft_model.forward(ids, pos[None], pos, (keys[None, :] <= pos[:, None])[None, None])
        return self.draft_model.logits(final[0])

    def catch_up(self, aux, next_ids, start: int):
        """Write the tokens x_{start+1}.. (`next_ids` [1, n]; from x_0 at the prefill, start 0) and return (None, the
        logits of the token after the last), the next round's first draft."""
        if start == 0:
            return None, self.run(torch.cat([self.first, next_ids], dim=1), 0)[-1]
        return None, self.run(next_ids, start + 1)[-1]

    catch_up_padded = catch_up

    def choose(self, logits):
        """(token, its draft distribution or None when greedy) from one row of draft logits [V]."""
        if self.sampler.greedy:
            return logits.argmax(-1), None
        q = self.sampler.probs(logits)
        return torch.multinomial(q, 1)[0], q

    def draft(self, root_token, h_root, logits_root, length: int) -> DraftTree:
        """The chain of K drafts after the pending token x_L (L = `length`), laid out as a tree of one branch."""
        k, dev = self.shape.depth, logits_root.device
        token, q = self.choose(logits_root)
        tokens, dists = [token], [q]
        for i in range(1, k):
            token, q = self.choose(self.run(token.reshape(1, 1), length + i)[-1])
            tokens.append(token)
            dists.append(q)
        n = k + 1
        sampled = not self.sampler.greedy
        return DraftTree(
            tokens=torch.cat([root_token.reshape(1), torch.stack(tokens)]),
            parents=torch.cat([torch.zeros(1, dtype=torch.long, device=dev), torch.arange(k, device=dev)]),
            depths=torch.arange(n, device=dev),
            ancestors=torch.ones(n, n, dtype=torch.bool, device=dev).tril(),
            dist_index=torch.cat([torch.arange(k, device=dev), torch.full((1,), -1, device=dev)])
            if sampled
            else torch.full((n,), -1, device=dev),
            dists=torch.stack(dists) if sampled else None,
        )
