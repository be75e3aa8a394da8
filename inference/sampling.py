"""Token choice and draft acceptance: greedy, and lossless speculative (rejection) sampling.

Temperature, top-k and top-p warp the target's and the draft's logits in exactly the same way,
so the draft distribution q and the target distribution p are the ones plain sampling would use.
The draft distribution lives on the draft vocabulary; `DraftDist` places it on the target
vocabulary (through d2t) with zero mass elsewhere.

Trees use recursive rejection sampling: the children of a node were drawn from q *without
replacement* (in that order), child i is accepted with probability min(1, p_i(x_i) / q_i(x_i));
on rejection p_{i+1} = norm(max(p_i - q_i, 0)) and q_{i+1} = q_i with x_i removed, renormalised.
When no child is accepted the token is drawn from the last residual p. This emits exactly p at
every node (a chain is the one-child case: standard speculative sampling).
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampler:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def warp(self, logits: torch.Tensor) -> torch.Tensor:
        """Temperature, then top-k, then top-p (Hugging Face's order); removed tokens get -inf."""
        logits = logits.float() / (self.temperature if self.temperature > 0 else 1.0)
        if self.top_k and self.top_k < logits.shape[-1]:
            kth = torch.topk(logits, self.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p < 1:
            sorted_logits, order = torch.sort(logits, dim=-1)
            cum = sorted_logits.softmax(-1).cumsum(-1)
            remove = cum <= 1 - self.top_p
            remove[..., -1] = False  # always keep the most likely token
            logits = logits.masked_fill(remove.scatter(-1, order, remove), float("-inf"))
        return logits

    def log_probs(self, logits):
        return torch.log_softmax(self.warp(logits), dim=-1)

    def probs(self, logits):
        return torch.softmax(self.warp(logits), dim=-1)

    def sample(self, logits: torch.Tensor) -> torch.Tensor:
        """One token per row of `logits` [..., V]: argmax when greedy, else a draw from the warped p."""
        if self.greedy:
            return logits.argmax(-1)
        p = self.probs(logits)
        return torch.multinomial(p.reshape(-1, p.shape[-1]), 1).reshape(p.shape[:-1])


def normalise(x):
    s = x.sum()
    return x / s if s > 0 else x


def accept_greedy(tree_tokens: list[int], children: list[list[int]], target_argmax: list[int]):
    """Walk the tree from the root (node 0) while a child carries the target's argmax.
    Returns (accepted node indices, bonus token)."""
    path, node = [], 0
    while True:
        nxt = next((c for c in children[node] if tree_tokens[c] == target_argmax[node]), None)
        if nxt is None:
            return path, target_argmax[node]
        path.append(nxt)
        node = nxt


def accept_sampling(
    tree_tokens: list[int],
    children: list[list[int]],
    p: torch.Tensor,
    draft_q,
    generator: torch.Generator | None = None,
):
    """Recursive rejection sampling over a tree. p [N, V]: the target's warped distributions at
    the tree nodes; draft_q(node) -> the draft distribution [V] its children were drawn from.
    Returns (accepted node indices, bonus token); the emitted tokens are distributed exactly as p."""
    path, node = [], 0
    while True:
        p_cur = p[node]
        accepted = None
        if children[node]:
            q_cur = draft_q(node).clone()
            for child in children[node]:
                x = tree_tokens[child]
                qx = q_cur[x]
                if qx <= 0:  # the draft could not have proposed it: neither can any later sibling
                    break
                u = torch.rand((), device=p.device, generator=generator)
                if u * qx < p_cur[x]:
                    accepted = child
                    break
                p_cur = normalise(torch.clamp(p_cur - q_cur, min=0))
                q_cur[x] = 0
                q_cur = normalise(q_cur)
        if accepted is None:
            bonus = torch.multinomial(p_cur, 1, generator=generator).item()
            return path, bonus
        path.append(accepted)
        node = accepted
