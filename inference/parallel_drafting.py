"""P-EAGLE drafting: all K chain drafts from the same forward that catches the head up.

The head's cache holds, like EAGLE-3's, the depth-0 entry of every committed position p (from the
target's g_p and the token x_{p+1}), slot = position. The catch-up step after a verification
writes the accepted positions and, in the same forward, K-1 mask slots at the positions after
the last one (fc(mask_hidden), embed(mask_token_id)); the last accepted row's logits are draft 1
and the mask rows' logits drafts 2..K. The mask entries sit in the slots the next catch-up
rewrites first, so they are never read as context. Drafting itself then runs no forward at all:
the chain is laid out from those K distributions and verified exactly like an EAGLE-3 chain
(`Drafter.select`, the runtime's tree verification and acceptance).
"""

import torch

from inference.drafting import Drafter, DraftTree, TreeShape


class ParallelDrafter(Drafter):
    """A Drafter for P-EAGLE heads: `catch_up` returns (None, draft logits [K, Vd]), and `draft`
    turns those into the chain (greedy: argmax per slot; sampling: one draw per slot)."""

    def __init__(self, head, shape: TreeShape, sampler, graphed: bool = False):
        if not shape.is_chain:
            raise ValueError("P-EAGLE drafts a chain (--parallel K); tree drafting needs an EAGLE-3 head")
        trained = head.config.num_depths
        if shape.depth > trained:
            raise ValueError(
                f"--parallel {shape.depth} asks for more drafts than the head was trained "
                f"for (num_depths K={trained}): use --parallel <= {trained}"
            )
        super().__init__(head, shape, sampler, graphed)

    def cache_size(self, max_len: int) -> int:
        return max_len + 2 * self.shape.depth  # catch-up rows (<= K+1), mask rows (K-1), padding

    def visible_slots(self, keys, pos, last: int):
        """bool [n, S]: the slots `keys` [S] each row at `pos` [n] attends to, by training's rule (`head.visible`,
        the head's sliding window included): slot p holds element (p, 0) up to the last accepted position `last`,
        and the mask row (last, p - last) after it, and so does row p."""

        def element(p):
            anchor = p.clamp(max=last)
            return anchor, p - anchor

        (q_anchor, q_depth), (k_anchor, k_depth) = element(pos[:, None]), element(keys[None, :])
        return self.head.visible(q_anchor, q_depth, k_anchor, k_depth)

    def step_rows(self, aux, next_ids, start: int, size: int | None = None):
        """One forward over the n catch-up rows, the K-1 mask rows and (for a fixed `size`) padding
        rows that see slot 0 only and write past the mask slots. Returns draft logits [K, Vd]."""
        head, k = self.head, self.shape.depth
        n, dev = next_ids.shape[1], next_ids.device
        mask_hidden, mask_ids = head.mask_inputs(1, k - 1, dev)
        rows = n + k - 1
        pad = 0 if size is None else size - rows
        hidden = torch.cat([head.fuse(aux), mask_hidden.to(aux.dtype), mask_hidden[:, :1].expand(1, pad, -1)], dim=1)
        ids = torch.cat([next_ids, mask_ids, mask_ids[:, :1].expand(1, pad)], dim=1)
        pos = torch.arange(start, start + rows + pad, device=dev)
        keys = torch.arange(self.max_len, device=dev)
        mask = self.visible_slots(keys, pos, start + n - 1)
        mask[rows:] = keys == 0
        drafts = torch.arange(n - 1, rows, device=dev)  # the last accepted row and the mask rows
        _, logits = self.step_fn(hidden, ids, pos[None], self.cache, pos, mask[None, None], drafts)
        return logits[0]

    def catch_up(self, aux, next_ids, start: int):
        return None, self.step_rows(aux, next_ids, start)

    def catch_up_padded(self, aux, next_ids, start: int):
        """`catch_up` over a fixed 2K rows (at most K+1 accepted, K-1 mask rows), for CUDA graphs."""
        return None, self.step_rows(aux, next_ids, start, size=2 * self.shape.depth)

    def draft(self, root_token: torch.Tensor, h_root, logits_root, length: int) -> DraftTree:
        """The chain root -> d_1 -> ... -> d_K from the K slot distributions `logits_root` [K, Vd]."""
        k, dev = self.shape.depth, logits_root.device
        ids, _, probs = self.children(logits_root)  # [K, 1] (top-k 1), probs [K, Vd] when sampling
        scores = -torch.arange(1, k + 1, device=dev, dtype=torch.float64)  # every node below its parent
        parents = torch.arange(-1, k - 1, device=dev)
        own_dist = torch.cat([torch.arange(1, k, device=dev), torch.full((1,), -1, device=dev)])
        return self.select(ids[:, 0], scores, parents, own_dist, root_token, probs)
