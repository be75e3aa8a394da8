"""Block drafting (DFlash, DSpark): all K chain drafts from one forward of the block head.

The head's caches hold the context keys and values of every committed position p (from the target's aux
state g_p), slot = position: the catch-up after a verification writes the accepted positions and drafts
nothing. A round then runs the block [x_L, mask, ..., mask] (x_L the pending token, L the committed length)
at positions and slots L..L+B-1 in one forward; the block's own entries sit in the slots the next catch-up
rewrites first, and the next block overwrites the rest, so they are never read as context. The first K
drafts of the block are laid out as a chain and verified exactly like an EAGLE-3 chain (`Drafter.select`).

Greedy drafts are the argmax per slot, DSpark's Markov bias reading the draft before (`greedy_drafts`); when
sampling each slot draws from its warped distribution, the Markov bias reading the sampled token before, and
that distribution is what the rejection sampler accepts against: draft j is drawn from a distribution that
depends only on the chain above it, so acceptance stays lossless.
"""

import torch

from eagle_train.methods import row
from inference.drafting import Drafter, DraftTree, TreeShape
from inference.graphs import GraphedStep


def check_block_drafts(cfg, k: int) -> None:
    """Refuse, in one line, K drafts a block of this head cannot give."""
    most = row(cfg.method).drafts(cfg)
    if not 1 <= k <= most:
        raise ValueError(
            f"a {row(cfg.method).title} head with block_size {cfg.block_size} drafts at most {most} "
            f"tokens a forward: use --parallel K with 1 <= K <= {most} (got K={k})"
        )


class BlockDrafter(Drafter):
    """A Drafter for block heads: `catch_up` writes context and returns (None, None); `draft` runs the
    block and lays out its first K drafts as the chain. With `graphed` the fixed-shape steps (the padded
    catch-up, the block) replay as CUDA graphs."""

    def __init__(self, head, shape: TreeShape, sampler, graphed: bool = False):
        if not shape.is_chain:
            raise ValueError("block heads (DFlash, DSpark) draft a chain (--parallel K); trees need an EAGLE-3 head")
        check_block_drafts(head.config, shape.depth)
        self.head, self.shape, self.sampler = head, shape, sampler
        self.context_fn = GraphedStep(self.write_context) if graphed else self.write_context
        self.step_fn = GraphedStep(self.block) if graphed else self.block  # the runtime resets it with its caches
        self.cache = None
        self.max_len = 0

    def setup_cache(self, max_len: int):
        size = max_len + self.head.config.block_size  # a block at the last committed length still fits
        if size > self.max_len:
            self.cache = self.head.new_cache(1, size)
            self.max_len = size
            for fn in (self.context_fn, self.step_fn):
                if isinstance(fn, GraphedStep):  # graphs of the old cache are of no more use
                    fn.reset()

    def write_context(self, aux, positions, cache):
        self.head.write_context(cache, aux, positions[None], positions)
        return ()

    def block(self, anchor, positions, mask, cache):
        """The block's pre-norm outputs at its first K draft slots [1, K, H]."""
        return (self.head.draft_block(cache, anchor, positions[None], positions, mask)[:, : self.shape.depth],)

    def catch_up(self, aux, next_ids, start: int):
        """Write the context of positions start..start+n-1 (aux [1, n, 3H]); nothing to draft from yet.
        Eager: after a prefill its length varies (graphs replay only `catch_up_padded`)."""
        self.write_context(aux, torch.arange(start, start + aux.shape[1], device=aux.device), self.cache)
        return None, None

    def catch_up_padded(self, aux, next_ids, start: int):
        """`catch_up` over a fixed K+1 rows, for CUDA graphs. The padding rows write into slots past the
        accepted ones, which the next block overwrites before it reads them."""
        pad = self.shape.depth + 1 - aux.shape[1]
        aux = torch.cat([aux, aux[:, -1:].expand(1, pad, aux.shape[-1])], dim=1)
        self.context_fn(aux, torch.arange(start, start + aux.shape[1], device=aux.device), self.cache)
        return None, None

    def drafts(self, h, root_token):
        """(draft ids [K], draft probabilities [K, Vd] or None) of the block's outputs h [1, K, H]."""
        head = self.head
        if self.sampler.greedy:  # the argmax per slot, each Markov bias reading the argmax before it
            _, logits, _ = head.greedy_drafts(h, root_token.reshape(1))
            return logits[0].argmax(-1), None
        if not head.config.markov_rank:  # no draft depends on a sampled one
            logits, _ = head.draft_logits(h[0], None)
            ids, _, probs = self.children(logits)
            return ids[:, 0], probs
        normed, unbiased = head.slot_logits(h)  # every slot at once: only the bias is sequential
        prev, ids, probs = root_token.reshape(1), [], []
        for j in range(h.shape[1]):
            logits, _ = head.with_bias(normed[:, j], unbiased[:, j], prev)
            draft, _, q = self.children(logits)
            prev = head.draft_to_target_ids(draft[:, 0])
            ids.append(draft[0, 0])
            probs.append(q[0])
        return torch.stack(ids), torch.stack(probs)

    def draft(self, root_token: torch.Tensor, h_root, logits_root, length: int) -> DraftTree:
        """The chain root -> d_1 -> ... -> d_K from one forward of the block anchored at the pending token
        `root_token` = x_L (L = `length`)."""
        size, dev = self.head.config.block_size, root_token.device
        positions = torch.arange(length, length + size, device=dev)
        mask = self.head.block_mask(positions[:1], self.max_len)
        (h,) = self.step_fn(root_token.reshape(1), positions, mask, self.cache)
        ids, probs = self.drafts(h, root_token)
        k = self.shape.depth
        scores = -torch.arange(1, k + 1, device=dev, dtype=torch.float64)  # every node below its parent
        parents = torch.arange(-1, k - 1, device=dev)
        own_dist = torch.cat([torch.arange(1, k, device=dev), torch.full((1,), -1, device=dev)])
        return self.select(ids, scores, parents, own_dist, root_token, probs)
