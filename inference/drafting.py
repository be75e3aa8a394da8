"""Drafting with an EAGLE-3 head: a chain of K tokens or an EAGLE-2 style dynamic tree.

The head keeps its own KV cache. Slot p holds the step-0 entry of position p, computed from the
target's aux states g_p (through `head.fc`) and the token x_{p+1}: after every verification the
accepted positions are (re)written this way ("catch-up"), which replaces the speculative entries
drafted for them. Tree nodes of the current round live in the slots after the committed length L
and are visible only to their own descendants, exactly like the diagonal keys of training-time test.

A chain of K drafts is the tree (depth K, top-k 1, total K), so one code path does both. The tree
(EAGLE-2): the root's top-k children form depth 1; at each further depth the k best nodes so far
(by cumulative log-probability) are run through the head in one batched step and each proposes its
top-k children; finally the best `total` of all proposed nodes are kept. When sampling, children
are drawn from the warped draft distribution without replacement (Gumbel top-k) instead of taken
greedily, and the scores make siblings rank in draw order, so every node keeps a prefix of its
draws: what the recursive rejection sampler in `sampling.py` needs to be lossless.
Everything here has static shapes and stays on the device (no host syncs).
"""

from dataclasses import dataclass

import torch

from inference.graphs import GraphedStep
from inference.sampling import Sampler

# Scores are cumulative log-probs with tiny per-rank penalties that make every node rank strictly
# below its parent and its earlier siblings, so the best `total` form a tree of sibling prefixes.
FLOOR, EPS = -1e4, 1e-6


@dataclass(frozen=True)
class TreeShape:
    depth: int
    topk: int
    total: int

    def __post_init__(self):
        if self.depth < 1 or self.topk < 1 or self.total < 1:
            raise ValueError(
                f"draft tree depth, top-k and total must be >= 1 (got {self.depth},{self.topk},{self.total}); "
                "a chain needs K >= 1 drafts"
            )
        if self.total > self.num_candidates:
            raise ValueError(
                f"a tree of depth {self.depth} with top-k {self.topk} proposes only {self.num_candidates} "
                f"tokens, fewer than total={self.total}: lower total or raise depth/top-k"
            )

    @classmethod
    def chain(cls, k: int) -> "TreeShape":
        if k < 1:
            raise ValueError(f"chain drafting needs K >= 1 draft tokens, got K={k}")
        return cls(k, 1, k)

    @classmethod
    def parse(cls, text: str) -> "TreeShape":
        """'depth,topk,total' as given on the command line."""
        try:
            depth, topk, total = (int(x) for x in text.split(","))
        except ValueError:
            raise ValueError(f"--tree expects depth,topk,total (three integers, e.g. 6,8,60), got {text!r}") from None
        return cls(depth, topk, total)

    @property
    def is_chain(self) -> bool:
        return self.topk == 1

    @property
    def num_candidates(self) -> int:
        return self.topk + (self.depth - 1) * self.topk * self.topk

    @property
    def spec_slots(self) -> int:
        """Draft-cache slots used beyond the committed length (the expanded nodes, and the
        padding of the fixed-size catch-up step)."""
        return max((self.depth - 1) * self.topk, self.depth + 1)


@dataclass
class DraftTree:
    """A round's tree, root (the last committed token) at index 0, nodes 1..total in an order
    where parents precede children and siblings keep their draw order."""

    tokens: torch.Tensor  # [total+1] target ids (index 0: the root's token)
    parents: torch.Tensor  # [total+1] index of the parent (root: 0)
    depths: torch.Tensor  # [total+1] root 0
    ancestors: torch.Tensor  # [total+1, total+1] bool, ancestor-or-self
    dist_index: torch.Tensor  # [total+1] row in `dists` of the node's own draft distribution (-1: leaf)
    dists: torch.Tensor | None  # [1 + (depth-1)*topk, Vd] draft probabilities (sampling only)


class Drafter:
    """The head's cache and steps. The head attends over its whole cache (masks are full width),
    which for one layer costs little and keeps every step's shape fixed."""

    def __init__(self, head, shape: TreeShape, sampler: Sampler, graphed: bool = False):
        self.head, self.shape, self.sampler = head, shape, sampler
        self.step_fn = GraphedStep(head.step) if graphed else head.step  # graphed: replayed as CUDA graphs
        self.layer_fn = GraphedStep(self.layer_step) if graphed else self.layer_step
        self.cache = None
        self.max_len = 0

    def layer_step(self, hidden, input_ids, position_ids, cache, slots, mask):
        """`head.step` without the lm_head: a catch-up needs the logits of its last row only."""
        return (self.head.layer(hidden, input_ids, position_ids, cache, slots, mask),)

    def visible(self, keys, pos):
        """bool [n, S]: the context slots (slot p holds position p) each of the positions `pos` [n] attends to: those
        up to it, within the head's sliding window when it has one."""
        seen = keys[None, :] <= pos[:, None]
        window = self.head.config.sliding_window
        return seen & (keys[None, :] > pos[:, None] - window) if window else seen

    def cache_size(self, max_len: int) -> int:
        """Slots for `max_len` committed positions and a round's speculative entries."""
        return max_len + self.shape.spec_slots

    def setup_cache(self, max_len: int):
        size = self.cache_size(max_len)
        if size > self.max_len:
            self.cache = self.head.new_cache(1, size)
            self.max_len = size
            for fn in (self.step_fn, self.layer_fn):
                if isinstance(fn, GraphedStep):  # graphs of the old cache are of no more use
                    fn.reset()

    def catch_up(self, aux, next_ids, start: int):
        """Write the step-0 entries of positions start..start+n-1 (aux [1,n,3H], next_ids [1,n] the
        tokens x_{p+1}) and return the last row's (pre-norm h [1,H], logits [Vd]), the tree root."""
        n = next_ids.shape[1]
        dev = next_ids.device
        pos = torch.arange(start, start + n, device=dev)
        keys = torch.arange(self.max_len, device=dev)
        mask = self.visible(keys, pos)[None, None]
        # eager: after a prefill its length varies (graphs replay only `catch_up_padded`)
        (h,) = self.layer_step(self.head.fuse(aux), next_ids, pos[None], self.cache, pos, mask)
        return h[0, -1], self.head.logits(h[0, -1])

    def catch_up_padded(self, aux, next_ids, start: int):
        """`catch_up` over a fixed number of rows (depth + 1), so a CUDA graph can replay it.
        The padding rows see slot 0 only and write into the speculative slots, which the tree
        overwrites before anyone reads them."""
        n, size = next_ids.shape[1], self.shape.depth + 1
        dev = next_ids.device
        pad = size - n
        aux = torch.cat([aux, aux[:, -1:].expand(1, pad, aux.shape[-1])], dim=1)
        ids = torch.cat([next_ids, next_ids[:, -1:].expand(1, pad)], dim=1)
        pos = torch.arange(start, start + size, device=dev)
        keys = torch.arange(self.max_len, device=dev)
        mask = self.visible(keys, pos)
        mask[n:] = keys == 0
        (h,) = self.layer_fn(self.head.fuse(aux), ids, pos[None], self.cache, pos, mask[None, None])
        return h[0, n - 1], self.head.logits(h[0, n - 1])

    def children(self, logits):
        """Top-k children of each row of draft logits [r, Vd]: (draft ids [r,k], score steps [r,k],
        probabilities [r, Vd] or None). Greedy: the k most likely; sampling: k draws without
        replacement (Gumbel top-k), in draw order."""
        k = self.shape.topk
        logp = self.sampler.log_probs(logits) if not self.sampler.greedy else torch.log_softmax(logits.float(), -1)
        keys = logp
        if not self.sampler.greedy:
            gumbel = -torch.log(-torch.log(torch.rand_like(logp).clamp_(1e-20, 1.0)))
            keys = logp + gumbel
        ids = torch.topk(keys, k, dim=-1).indices
        steps = logp.gather(-1, ids).double().clamp(min=FLOOR).cummin(-1).values
        steps = steps - EPS * torch.arange(1, k + 1, device=logits.device, dtype=steps.dtype)
        return ids, steps, (logp.exp() if not self.sampler.greedy else None)

    def draft(self, root_token: torch.Tensor, h_root, logits_root, length: int) -> DraftTree:
        """Grow the round's tree below the root (the pending token x_L, read by the catch-up row of
        position L-1 that gave h_root / logits_root; L = `length`) and keep the best `total` nodes."""
        s, k = self.shape, self.shape.topk
        head, dev = self.head, h_root.device
        ids, scores, probs = self.children(logits_root[None])
        cand_ids, cand_scores = [ids[0]], [scores[0]]
        cand_parent = [torch.full((k,), -1, device=dev)]
        own_dist = torch.full((s.num_candidates,), -1, device=dev)
        dists = [probs] if probs is not None else []
        frontier = torch.arange(k, device=dev)  # candidate indices being expanded
        frontier_scores = scores[0]
        hidden = h_root[None].expand(k, -1)
        n_spec = (s.depth - 1) * k
        keys = torch.arange(self.max_len, device=dev)
        # every node sees the context its root's row sees: training-time test's step i at anchor t reads step 0's keys
        # as the row of t does
        context = self.visible(keys, torch.full((k,), length - 1, device=dev))
        seen = torch.zeros(k, n_spec, dtype=torch.bool, device=dev)  # frontier's visible spec slots
        for depth in range(1, s.depth):
            slots = length + (depth - 1) * k + torch.arange(k, device=dev)
            own_dist[frontier] = 1 + (depth - 1) * k + torch.arange(k, device=dev)
            seen[:, (depth - 1) * k : depth * k] |= torch.eye(k, dtype=torch.bool, device=dev)
            mask = context.clone()
            mask[:, length : length + n_spec] = seen
            tokens = head.draft_to_target_ids(torch.cat(cand_ids)[frontier])
            pos = torch.full((1, k), length - 1 + depth, device=dev)
            h, logits = self.step_fn(hidden[None], tokens[None], pos, self.cache, slots, mask[None, None])
            ids, steps, probs = self.children(logits[0])
            if probs is not None:
                dists.append(probs)
            total_scores = frontier_scores[:, None] + steps  # [k, k]
            base = sum(c.numel() for c in cand_ids)
            cand_ids.append(ids.reshape(-1))
            cand_scores.append(total_scores.reshape(-1))
            cand_parent.append(frontier[:, None].expand(k, k).reshape(-1))
            best = torch.topk(total_scores.reshape(-1), k).indices
            rows = best // k
            frontier = base + best
            frontier_scores = total_scores.reshape(-1)[best]
            hidden = h[0, rows]
            seen = seen[rows]
        return self.select(
            torch.cat(cand_ids),
            torch.cat(cand_scores),
            torch.cat(cand_parent),
            own_dist,
            root_token,
            torch.cat(dists) if dists else None,
        )

    def select(self, cand_ids, cand_scores, cand_parent, own_dist, root_token, dists) -> DraftTree:
        """Keep the best `total` candidates (a tree: every node scores below its ancestors) in
        candidate order (parents before children, siblings in draw order) and lay out the tree."""
        s, dev = self.shape, cand_ids.device
        keep = torch.topk(cand_scores, s.total).indices.sort().values
        where = torch.full((cand_ids.numel() + 1,), 0, device=dev)  # candidate -> tree index (root 0)
        where[keep] = torch.arange(1, s.total + 1, device=dev)
        zero = torch.zeros(1, dtype=torch.long, device=dev)
        parents = torch.cat([zero, where[cand_parent[keep]]])  # -1 (root) indexes the last entry = 0
        tokens = torch.cat([root_token.reshape(1), self.head.draft_to_target_ids(cand_ids[keep])])
        n = s.total + 1
        eye = torch.eye(n, dtype=torch.bool, device=dev)
        ancestors, depths = eye.clone(), torch.zeros(n, dtype=torch.long, device=dev)
        for _ in range(s.depth):
            ancestors = eye | ancestors[parents]
            depths = torch.cat([zero, depths[parents[1:]] + 1])
        dist_index = torch.cat([zero, own_dist[keep]]) if dists is not None else torch.full((n,), -1, device=dev)
        return DraftTree(tokens, parents, depths, ancestors, dist_index, dists)
