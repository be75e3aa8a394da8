"""The generation loop at batch 1: prefill, draft, verify, accept, compact; and plain decoding.

State between rounds: the target cache holds the committed tokens x_0..x_{L-1} in slots 0..L-1,
the draft cache holds their step-0 entries, and `pending` = x_L has been emitted but not yet run
through the target. A round verifies [x_L, tree nodes] in one target forward (tree mask over
slots L..L+total), accepts a path, emits it plus one bonus/correction token, moves the path's
cache entries to consecutive slots, and lets the drafter catch up on the accepted positions.

Block heads (DFlash, DSpark; `BlockDrafter`) draft the round's chain in one forward from the pending token.

Prompt lookup (`PromptLookup`, no head) goes through the same rounds: its drafts are a chain of
up to K looked-up tokens, one-hot as draft distributions, and its catch-up only records tokens.
Head + n-gram (`HybridDrafter`) drafts each round by lookup where it finds a draft, else by the head.

Counters follow docs/design.md section 3: the prefill forward and the token it emits are not counted;
each verification forward counts the tokens it emitted (after eos / max-token truncation).
"""

import time
from dataclasses import dataclass, field

import torch

from eagle_train.methods import FAMILIES, row
from inference.drafting import TreeShape
from inference.graphs import GraphedStep
from inference.hf_target import target_view
from inference.hybrid_drafting import HybridDrafter
from inference.llama import use_few_row_linears
from inference.prompt_lookup import PromptLookup
from inference.sampling import Sampler, accept_greedy, accept_sampling


@dataclass
class GenerationResult:
    output_ids: list[int]  # new tokens, the prefill's first token included
    forwards: int  # target forwards after prefill (verification forwards, or plain decode steps)
    emitted: list[int] = field(default_factory=list)  # tokens emitted by each of those forwards
    accepted: list[int] = field(default_factory=list)  # draft tokens accepted by each verification
    seconds: float = 0.0  # the whole decode, prefill included ...
    prefill_seconds: float = 0.0  # ... of which the prefill and its token

    @property
    def acceptance_length(self) -> float:
        return sum(self.emitted) / max(self.forwards, 1)


class Runtime:
    """A target (and optionally a draft head) ready to generate; caches and graphs are reused."""

    def __init__(
        self,
        hf_model,
        head=None,
        shape: TreeShape | None = None,
        sampler: Sampler = Sampler(),
        eos_token_ids=(),
        cuda_graphs: bool = True,
        seed: int | None = None,
    ):
        aux_ids = head.config.aux_layer_ids if head is not None else None
        self.target = target_view(hf_model, aux_ids)
        self.device = self.target.device
        self.use_graphs = cuda_graphs and self.device.type == "cuda" and self.target.graphable
        self.sampler = sampler
        self.eos = set(int(e) for e in eos_token_ids)
        if seed is not None:
            torch.manual_seed(seed)
        target_step = self.target.forward
        self.target_step = GraphedStep(target_step) if self.use_graphs else target_step
        self.drafter = None
        if head is not None:
            use_few_row_linears(head)  # the head's 1 to K+1 rows, like the target's, on the CPU
            method = row(head.config.method)
            shape = shape or TreeShape.chain(method.drafts(head.config) if method.drafts else 5)
            self.drafter = FAMILIES[method.family].drafter(head, shape, sampler, graphed=self.use_graphs)

    # ---- helpers --------------------------------------------------------------------------------

    def width(self, needed: int) -> int:
        """Attention width: the whole cache under CUDA graphs (fixed shapes), else what is needed."""
        return self.target.max_len if self.use_graphs else needed

    def setup(self, prompt_len: int, max_new_tokens: int, drafter=None):
        # room for the head's trees and `drafter`'s, whichever decodes: one cache size serves both
        extra = max((d.shape.total for d in (self.drafter, drafter) if d), default=0) + 1
        max_len = prompt_len + max_new_tokens + extra + 1
        if self.use_graphs:  # round up so graphs captured for one prompt serve the next ones
            max_len = -(-max_len // 256) * 256
        before = self.target.max_len
        self.target.setup_cache(max_len)
        if self.drafter:
            self.drafter.setup_cache(self.target.max_len)
        if self.use_graphs and self.target.max_len != before:  # new buffers: recapture (a drafter resets its own)
            self.target_step.reset()

    def causal_forward(self, ids: torch.Tensor):
        """The target over `ids` [1, n] from slot 0, each position attending to those before it."""
        pos = torch.arange(ids.shape[1], device=self.device)
        return self.target.forward(ids, pos[None], pos, (pos[None, :] <= pos[:, None])[None, None])

    def prefill(self, prompt: torch.Tensor):
        final, aux = self.causal_forward(prompt)
        first = self.sampler.sample(self.target.logits(final[:, -1]))  # [1]
        return first, aux

    @torch.inference_mode()
    def next_token_logits(self, prompt_ids, new_ids, max_new_tokens: int) -> torch.Tensor:
        """The target's logits [V] for the token after prompt + new_ids, from one forward over them all, in
        the runtime's dtype. The cache keeps the size a decode of `max_new_tokens` gave it (no recapture)."""
        self.setup(len(prompt_ids), max_new_tokens)
        final, _ = self.causal_forward(self.check_prompt(list(prompt_ids) + list(new_ids)))
        return self.target.logits(final[0, -1])

    @staticmethod
    def finish(out: list[int], new: list[int], eos: set, max_new: int) -> tuple[list[int], bool]:
        """Append `new` up to eos / max_new; returns (what was appended, whether to stop)."""
        kept = []
        for t in new:
            if len(out) + len(kept) >= max_new:
                return kept, True
            kept.append(t)
            if t in eos:
                return kept, True
        return kept, len(out) + len(kept) >= max_new

    def check_prompt(self, prompt_ids):
        prompt = torch.as_tensor(prompt_ids, dtype=torch.long, device=self.device).reshape(1, -1)
        if prompt.shape[1] == 0:
            raise ValueError("empty prompt: give at least one token")
        return prompt

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    # ---- decoding -------------------------------------------------------------------------------

    @torch.inference_mode()
    def generate_plain(self, prompt_ids, max_new_tokens: int) -> GenerationResult:
        """Plain autoregressive decoding on the same runtime (the speedup's reference)."""
        prompt = self.check_prompt(prompt_ids)
        n = prompt.shape[1]
        self.setup(n, max_new_tokens)
        self.sync()
        t0 = time.perf_counter()
        token, _ = self.prefill(prompt)
        out, stop = self.finish([], [int(token.item())], self.eos, max_new_tokens)
        result = GenerationResult(out, 0, prefill_seconds=time.perf_counter() - t0)
        length = n
        keys = torch.arange(self.target.max_len, device=self.device)
        while not stop:
            pos = torch.tensor([length], device=self.device)
            mask = (keys[: self.width(length + 1)] <= length)[None, None, None]
            final, _ = self.target_step(token.reshape(1, 1), pos[None], pos, mask)
            token = self.sampler.sample(self.target.logits(final[:, -1]))
            kept, stop = self.finish(out, [int(token.item())], self.eos, max_new_tokens)
            out += kept
            result.forwards += 1
            result.emitted.append(len(kept))
            length += 1
        self.sync()
        result.seconds = time.perf_counter() - t0
        return result

    def generate_lookup(self, prompt_ids, max_new_tokens: int, k: int) -> GenerationResult:
        """Speculative decoding with prompt lookup (no head), up to k drafts a round."""
        return self.generate(prompt_ids, max_new_tokens, PromptLookup(prompt_ids, k))

    def generate_hybrid(self, prompt_ids, max_new_tokens: int, k: int) -> GenerationResult:
        """Speculative decoding by head + n-gram (`HybridDrafter`): up to k looked-up drafts where the lookup finds
        them, else the head's."""
        if self.drafter is None:
            raise ValueError("head + n-gram drafting needs a head; use generate_lookup for n-gram alone")
        return self.generate(prompt_ids, max_new_tokens, HybridDrafter(PromptLookup(prompt_ids, k), self.drafter))

    @torch.inference_mode()
    def generate(self, prompt_ids, max_new_tokens: int, drafter=None) -> GenerationResult:
        """Speculative decoding with the draft head, or with `drafter` (a PromptLookup or a HybridDrafter)."""
        drafter = drafter or self.drafter
        if drafter is None:
            raise ValueError("this runtime has no draft head; use generate_plain or generate_lookup")
        target = self.target
        prompt = self.check_prompt(prompt_ids)
        n = prompt.shape[1]
        self.setup(n, max_new_tokens, drafter)
        self.sync()
        t0 = time.perf_counter()
        if hasattr(drafter, "begin"):  # a drafter that reads the tokens from the first (a draft model) sees x_0
            drafter.begin(prompt)
        pending, aux = self.prefill(prompt)
        out, stop = self.finish([], [int(pending.item())], self.eos, max_new_tokens)
        next_ids = torch.cat([prompt[:, 1:], pending.reshape(1, 1)], dim=1)
        h_root, logits_root = drafter.catch_up(aux, next_ids, 0)  # the drafter's prefill
        self.sync()
        result = GenerationResult(out, 0, prefill_seconds=time.perf_counter() - t0)
        length = n  # committed tokens (in both caches); `pending` is x_length
        keys = torch.arange(target.max_len, device=self.device)
        catch_up = drafter.catch_up_padded if self.use_graphs else drafter.catch_up  # graphs: fixed rows
        while not stop:
            tree = drafter.draft(pending.reshape(()), h_root, logits_root, length)
            # verify [x_L, nodes] at positions L + depth, slots L..L+total (a lookup's chain: <= K nodes)
            size = tree.tokens.shape[0]
            slots = length + keys[:size]
            mask = (keys[: self.width(length + size)] < length)[None].expand(size, -1).clone()
            mask[:, length : length + size] = tree.ancestors
            final, aux = self.target_step(tree.tokens[None], (length + tree.depths)[None], slots, mask[None, None])
            logits = target.logits(final[0])
            path, bonus, tokens_of = self.accept(tree, logits)
            result.forwards += 1
            result.accepted.append(len(path))
            new = [tokens_of[i] for i in path] + [bonus]
            kept, stop = self.finish(out, new, self.eos, max_new_tokens)
            out += kept
            result.emitted.append(len(kept))
            if stop:
                break
            rows = torch.tensor([0] + path, device=self.device)
            if path != list(range(1, len(path) + 1)):  # off the first branch: compact the cache
                target.compact(length + rows[1:], length + 1 + torch.arange(len(path), device=self.device))
            pending = torch.tensor(bonus, device=self.device)
            next_ids = torch.tensor([new], device=self.device)
            h_root, logits_root = catch_up(aux[:, rows], next_ids, length)
            length += len(path) + 1
        self.sync()
        result.seconds = time.perf_counter() - t0
        return result

    def accept(self, tree, logits):
        """The round's accept decision (the one host sync): (accepted tree indices, bonus token,
        the tree's tokens as a list)."""
        greedy = self.sampler.greedy
        rows = [tree.parents, tree.tokens] + ([logits.argmax(-1)] if greedy else [])
        parents, tokens, *argmax = torch.stack(rows).tolist()
        children = [[] for _ in parents]
        for i, p in enumerate(parents[1:], start=1):
            children[p].append(i)
        if greedy:
            return *accept_greedy(tokens, children, argmax[0]), tokens
        p = self.sampler.probs(logits)
        if tree.dists is None:  # deterministic drafts (prompt lookup): q is one-hot on the node's one child

            def draft_q(node):
                return torch.nn.functional.one_hot(torch.tensor(tokens[children[node][0]]), p.shape[-1]).to(p)

            return *accept_sampling(tokens, children, p, draft_q), tokens
        head = self.drafter.head

        def draft_q(node):
            q = torch.zeros(p.shape[-1], device=p.device)
            return q.index_add_(
                0,
                head.draft_to_target_ids(torch.arange(tree.dists.shape[-1], device=p.device)),
                tree.dists[tree.dist_index[node]].float(),
            )

        return *accept_sampling(tokens, children, p, draft_q), tokens
