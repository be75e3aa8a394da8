"""Expected acceptance under sampling, without sampling: heads compared on the held-out answers of a store.

    python scripts/bench/sampled_acceptance.py --store runs/q/data/store --head runs/a/final runs/b/final \\
        --temperature 0 0.7 1.0

A draft sampled from the head's q at temperature T is accepted by speculative sampling with probability
sum_v min(p(v), q(v)) = 1 - TV(p, q), p the target's distribution at T over its whole vocabulary (a draft
vocabulary that misses p's mass loses it). Per TTT step i, this prints that probability averaged over the
held-out answer positions (T = 0: the greedy draft equals the target's argmax). Step 0 is the exact chance
that a round's first draft is accepted, given the target's own text so far; a later step i reads the stored
tokens as the earlier drafts, so it is that chance given the earlier drafts matched the stored text.
The runtime's sampled AL (`eagle-eval --temperature T`) measures the same thing with sampling noise.

Held-out answers: the samples the trainer held out (`trainer.split_indices` with --eval-fraction and --seed,
the train YAML's), so none of them was trained on; with --all-samples every sample of a store no head trained
on, e.g. the target's answers to a bench's prompts (`eagle-prep distil`; docs/performance.md). At T = 0 the
line ends with the greedy chain walk's AL (`ttt.chain_walk`, the trainer's chain_al): what greedy chain decoding
with K = --steps drafts gets on that text, round by round. --by-token splits the greedy first draft's acceptance by
the class of the token it had to match (`token_class`): where a head fails, and whether a larger vocabulary or more
data would reach it.
"""

import argparse

import torch

from eagle_train.checkpoint import load_draft_head, locate_head
from eagle_train.hidden_states import TargetLogits
from eagle_train.methods import row
from eagle_train.methods.eagle3.head import Eagle3Head
from eagle_train.methods.eagle3.ttt import chain_walk
from eagle_train.store import ShardedSamples, read_manifest
from eagle_train.target import load_target
from eagle_train.trainer import split_indices
from eagle_train.training_parts import shift_left, simulated_acceptance_length


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--store", required=True, help="the hidden-state store the heads trained on")
    p.add_argument("--head", nargs="+", required=True, help="EAGLE-3 heads or checkpoints to compare")
    p.add_argument("--temperature", nargs="+", type=float, default=[0.0, 0.7, 1.0])
    p.add_argument("--steps", type=int, default=3, help="TTT steps, K of a chain (default 3)")
    p.add_argument("--eval-fraction", type=float, default=0.05, help="the train YAML's (default 0.05)")
    p.add_argument("--seed", type=int, default=0, help="the train YAML's (default 0)")
    p.add_argument("--all-samples", action="store_true", help="score every sample: a store no head trained on")
    p.add_argument(
        "--by-token", action="store_true", help="the greedy first draft's acceptance per class of the target's token"
    )
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu (fp32 on either)")
    args = p.parse_args(argv)
    if any(temp < 0 for temp in args.temperature):
        p.error(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    return args


TOKEN_CLASSES = ("outside the draft vocabulary", "digits", "punctuation or space", "repeats an earlier token", "other")


def token_class(text: str, in_draft: bool, seen_earlier: bool) -> str:
    """The first of `TOKEN_CLASSES` a target token (decoded `text`) falls in: no draft can be accepted outside
    the draft vocabulary; digits are arithmetic; a token already in the text (prompt or answer) is a copy, what
    n-gram drafting drafts."""
    text = text.strip()
    if not in_draft:
        return TOKEN_CLASSES[0]
    if text.isdigit():
        return TOKEN_CLASSES[1]
    if not any(c.isalnum() for c in text):
        return TOKEN_CLASSES[2]
    return TOKEN_CLASSES[3] if seen_earlier else TOKEN_CLASSES[4]


@torch.no_grad()
def acceptance(head, draft_ids, target_logits, sample, temperatures, steps):
    """Per temperature, per step: (sum of acceptance probabilities, positions) over one sample's answers; the
    greedy chain walk's (tokens, rounds) there; and per answer position the greedy first draft reaches, (position,
    the target's token, accepted). draft_ids [Vd]: the target id of each draft id."""
    sample = {k: v.to(draft_ids.device) for k, v in sample.items() if torch.is_tensor(v)}
    ids, mask = sample["input_ids"][None], sample["loss_mask"][None]
    t = ids.shape[1]
    p_logits = target_logits(sample["final_hidden"][None].float()).float()  # [1, T, V]
    positions = torch.arange(t, device=ids.device)[None]
    hidden, past = head.fuse(sample["aux_hidden"][None].float()), []
    out = {temp: [[0.0, 0] for _ in range(steps)] for temp in temperatures}
    first = []
    correct = torch.zeros(1, steps, t, dtype=torch.bool)
    for i in range(steps):
        hidden = head.ttt_step(hidden, shift_left(ids, i + 1), positions + i, past)
        rows = mask[0, i + 2 :].nonzero()[:, 0]  # anchors whose step-i draft is an answer token
        if rows.numel() == 0:
            continue
        q_logits = head.logits(hidden[0, rows]).float()  # [N, Vd]
        p = p_logits[0, rows + i + 1]  # [N, V]: the target at t+i+1 predicts x_{t+i+2}
        correct[0, i, rows.cpu()] = (draft_ids[q_logits.argmax(-1)] == p.argmax(-1)).cpu()
        if i == 0:
            first = list(zip((rows + 2).tolist(), p.argmax(-1).tolist(), correct[0, 0, rows.cpu()].tolist()))
        for temp in temperatures:
            if temp == 0:
                accepted = correct[0, i, rows.cpu()].float()
            else:
                p_t = torch.softmax(p / temp, -1)[:, draft_ids]
                q_t = torch.softmax(q_logits / temp, -1)
                accepted = torch.minimum(p_t, q_t).sum(-1)
            out[temp][i][0] += float(accepted.sum())
            out[temp][i][1] += rows.numel()
    return out, chain_walk(head, [sample], target_logits, steps), first


def by_token_class(first, input_ids, in_draft, decode) -> dict[str, list[int]]:
    """Class -> [accepted, positions] over one sample's `acceptance` first drafts; `in_draft` bool [V]."""
    counts = {c: [0, 0] for c in TOKEN_CLASSES}
    ids = input_ids.tolist()
    for position, token, accepted in first:
        cls = token_class(decode([token]), bool(in_draft[token]), token in ids[:position])
        counts[cls][0] += int(accepted)
        counts[cls][1] += 1
    return counts


def main(argv=None):
    args = parse_args(argv)
    store = ShardedSamples(args.store)
    if not store.has_hidden:
        raise SystemExit(f"{args.store} holds tokens only: give a hidden-state store (eagle-prep run or capture)")
    for path in args.head:  # before the target loads: a mistyped or rotated-away checkpoint, in one line
        try:
            locate_head(path)
        except (FileNotFoundError, ValueError) as err:
            raise SystemExit(
                f"{err}: give a head directory (a run's final/, a checkpoint-<step>/ or an export)"
            ) from None
    made_by = read_manifest(args.store)["target"]
    target = made_by.get("given") or made_by["name"]
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model, tokenizer = load_target(target, dtype=torch.float32, device=device)
    target_logits = TargetLogits.of(model)
    scored = range(len(store)) if args.all_samples else split_indices(len(store), args.eval_fraction, args.seed)[1]
    which = "" if args.all_samples else "held-out "
    print(f"{len(scored)} {which}samples of {len(store)} in {args.store}; target {target}")
    print(
        "head | T | per step: expected acceptance of the draft | chain AL of a K-step chain (1 + sum of products)"
        " [| T = 0: the greedy chain walk's AL]"
    )
    for path in args.head:
        head = load_draft_head(path, model).to(device).eval()
        if not isinstance(head, Eagle3Head):
            title = row(head.config.method).title
            raise SystemExit(f"{path} holds a {title} head: this script unrolls EAGLE-3's TTT steps (Eagle3Head)")
        draft_ids = head.draft_to_target_ids(torch.arange(head.lm_head.weight.shape[0], device=device))
        totals = {temp: [[0.0, 0] for _ in range(args.steps)] for temp in args.temperature}
        walk, classes = [0, 0], {c: [0, 0] for c in TOKEN_CLASSES}
        for k in scored:
            sample = store[k]
            per_temp, (tokens, rounds), first = acceptance(
                head, draft_ids, target_logits, sample, args.temperature, args.steps
            )
            walk = [walk[0] + tokens, walk[1] + rounds]
            if args.by_token:
                for c, (a, n) in by_token_class(first, sample["input_ids"], head.t2d, tokenizer.decode).items():
                    classes[c] = [classes[c][0] + a, classes[c][1] + n]
            for temp, per_step in per_temp.items():
                for i, (s, n) in enumerate(per_step):
                    totals[temp][i][0] += s
                    totals[temp][i][1] += n
        for temp, per_step in totals.items():
            rates = [s / max(n, 1) for s, n in per_step]
            al = simulated_acceptance_length(rates)
            greedy = f" | walk {walk[0] / max(walk[1], 1):.4f} ({walk[1]} rounds)" if temp == 0 else ""
            print(f"{path} | {temp:g} | {' '.join(f'{r:.4f}' for r in rates)} | {al:.4f}{greedy}")
        if args.by_token:
            total = max(sum(n for _, n in classes.values()), 1)
            parts = [f"{c} {a / max(n, 1):.3f} ({100 * n / total:.1f}%)" for c, (a, n) in classes.items()]
            print(f"{path} | T = 0, first draft by the target's token (share) | {' | '.join(parts)}")


if __name__ == "__main__":
    main()
