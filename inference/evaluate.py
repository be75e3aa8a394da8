"""Evaluation on the bench prompt sets: acceptance length, per-position acceptance, speed.

Each prompt runs on the same runtime and the same prompt tokens: speculative decoding with the head,
prompt lookup (the free n-gram baseline the head has to beat, same K), then plain decoding (the
speedup's reference). Multi-turn prompts (MT-Bench) ask turn 2 after the model's own (speculative)
answer to turn 1. AL follows docs/design.md section 3: tokens emitted by
verification forwards / verification forwards, pooled over every turn of every prompt, prefill
and its token left out, so it can be recounted from the JSON as
sum(len(output_ids) - 1) / sum(forwards).
"""

import json
from importlib import resources
from pathlib import Path

from inference.divergence import TIE_STEPS, first_divergence, is_tie

BENCHES = ("mt_bench", "humaneval", "gsm8k")


def load_bench(name_or_file: str, num_prompts: int | None = None) -> list[dict]:
    """A packaged bench (mt_bench, humaneval, gsm8k) or a .jsonl file of {"turns": [...]} lines."""
    if name_or_file in BENCHES:
        text = resources.files("inference").joinpath(f"bench/{name_or_file}.jsonl").read_text()
        source = name_or_file
    else:
        path = Path(name_or_file)
        if not path.is_file():
            raise FileNotFoundError(
                f"bench {name_or_file!r} is neither one of {', '.join(BENCHES)} nor an existing .jsonl file"
            )
        text, source = path.read_text(), str(path)
    prompts = []
    for i, line in enumerate(text.splitlines()):
        if not line.strip():
            continue
        row = json.loads(line)
        turns = row.get("turns") or ([row["prompt"]] if "prompt" in row else None)
        if not turns or not all(isinstance(t, str) for t in turns):
            raise ValueError(f"{source} line {i + 1}: expected a 'turns' list of strings (or a 'prompt' string)")
        prompts.append({"question_id": row.get("question_id", i), "category": row.get("category", ""), "turns": turns})
    if num_prompts is not None:
        if num_prompts < 1:
            raise ValueError(f"--num-prompts must be >= 1, got {num_prompts}")
        prompts = prompts[:num_prompts]
    if not prompts:
        raise ValueError(f"{source} holds no prompts")
    return prompts


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The prompt tokens for `messages` through the target's own chat template."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        return list(ids)
    return tokenizer("\n\n".join(m["content"] for m in messages)).input_ids  # base models


def chat_text(tokenizer, messages: list[dict]) -> str:
    """The same prompt as text, byte for byte, for engines that tokenize it themselves (llama.cpp)."""
    return tokenizer.decode(chat_ids(tokenizer, messages), clean_up_tokenization_spaces=False)


def speculative_record(result) -> dict:
    """What a speculative decode leaves in the JSON: enough to recount AL and acceptance."""
    return {
        "output_ids": result.output_ids,
        "forwards": result.forwards,
        "emitted": result.emitted,
        "accepted": result.accepted,
        "seconds": result.seconds,
    }


def turn_record(prompt_tokens: int, spec: dict, plain: dict, answer: str, ngram: dict | None = None) -> dict:
    """One turn as `summarise` reads it, whichever engine decoded it: the head's ("spec") and prompt
    lookup's ("ngram", when run) speculative records beside plain decoding's."""
    turn = {
        "prompt_tokens": prompt_tokens,
        "spec": spec,
        "plain": plain,
        "identical": spec["output_ids"] == plain["output_ids"],
        "answer": answer,
    }
    if ngram is not None:
        turn["ngram"] = {**ngram, "identical": ngram["output_ids"] == plain["output_ids"]}
    return turn


def run_prompt(runtime, tokenizer, prompt: dict, max_new_tokens: int, ngram: int | None = None) -> dict:
    """Every turn of one prompt: speculative decoding ("spec"), prompt lookup with up to `ngram`
    drafts ("ngram"; None: skipped), then plain decoding. A runtime without a head speculates by
    prompt lookup itself ("spec"), which then needs `ngram`. The next turn follows spec's answer."""
    messages, turns, head = [], [], runtime.drafter is not None
    for text in prompt["turns"]:
        messages.append({"role": "user", "content": text})
        ids = chat_ids(tokenizer, messages)
        spec = runtime.generate(ids, max_new_tokens) if head else runtime.generate_lookup(ids, max_new_tokens, ngram)
        lookup = runtime.generate_lookup(ids, max_new_tokens, ngram) if head and ngram else None
        plain = runtime.generate_plain(ids, max_new_tokens)
        answer = tokenizer.decode(spec.output_ids, skip_special_tokens=True)
        messages.append({"role": "assistant", "content": answer})
        plain_record = {"output_ids": plain.output_ids, "forwards": plain.forwards, "seconds": plain.seconds}
        records = [speculative_record(r) for r in (spec, lookup) if r is not None]
        if runtime.sampler.greedy:  # where greedy decodes part from plain, and whether a rounding tie explains it
            for r in records:
                r["divergence"] = first_divergence(runtime, ids, plain.output_ids, r["output_ids"], max_new_tokens)
        turns.append(turn_record(len(ids), records[0], plain_record, answer, records[1] if lookup else None))
    return {"question_id": prompt["question_id"], "category": prompt["category"], "turns": turns}


def summarise(results: list[dict], depth: int, drafter: str = "spec") -> dict:
    """Pooled figures over every turn of every prompt, of the head ("spec") or of prompt lookup
    ("ngram")."""
    turns = [t for r in results for t in r["turns"]]
    runs = [t[drafter] for t in turns]
    forwards = sum(r["forwards"] for r in runs)
    emitted = sum(sum(r["emitted"]) for r in runs)
    accepted = [a for r in runs for a in r["accepted"]]
    reached = [sum(a >= i for a in accepted) for i in range(depth + 1)]  # reached[i]: rounds with >= i accepted
    spec_tokens = sum(len(r["output_ids"]) for r in runs)
    plain_tokens = sum(len(t["plain"]["output_ids"]) for t in turns)
    spec_s = sum(r["seconds"] for r in runs)
    plain_s = sum(t["plain"]["seconds"] for t in turns)
    per_forward = [e for r in runs for e in r["emitted"]]
    histogram = {str(k): per_forward.count(k) for k in range(1, max(per_forward, default=0) + 1)}
    spec_tps = spec_tokens / spec_s if spec_s else 0.0
    plain_tps = plain_tokens / plain_s if plain_s else 0.0
    return {
        "acceptance_length": emitted / forwards if forwards else 0.0,
        "verify_forwards": forwards,
        "tokens_from_verify_forwards": emitted,
        # share of verification forwards whose draft position i (1-based) was accepted ...
        "acceptance_per_position": [reached[i] / len(accepted) if accepted else 0.0 for i in range(1, depth + 1)],
        # ... and the same given that position i-1 was
        "acceptance_per_position_conditional": [
            reached[i] / reached[i - 1] if reached[i - 1] else 0.0 for i in range(1, depth + 1)
        ],
        "tokens_per_forward_histogram": histogram,
        "spec_tokens_per_s": spec_tps,
        "plain_tokens_per_s": plain_tps,
        "speedup": spec_tps / plain_tps if plain_tps else 0.0,
        "turns": len(turns),
        "turns_identical_to_plain": sum(r["output_ids"] == t["plain"]["output_ids"] for r, t in zip(runs, turns)),
        **divergence_counts(runs),
        "new_tokens_spec": spec_tokens,
        "new_tokens_plain": plain_tokens,
    }


def divergence_counts(runs: list[dict]) -> dict:
    """Of the turns that part from plain decoding, how many at a near tie of the target's argmax and how
    many not (a decoding bug), with the largest gap; nothing when the engine records no divergence."""
    if not any("divergence" in r for r in runs):
        return {}
    parted = [r["divergence"] for r in runs if r.get("divergence")]
    return {
        "turns_parting_at_ties": sum(map(is_tie, parted)),
        "turns_parting_unexplained": sum(not is_tie(d) for d in parted),
        "largest_gap_rounding_steps": max((abs(d["rounding_steps"]) for d in parted), default=0.0),
    }


def identical_note(summary: dict) -> str:
    """What the turns that part from plain decoding are, for the tables: rounding ties or a bug."""
    if summary.get("turns_parting_unexplained"):
        return (
            f" ({summary['turns_parting_unexplained']} part where the target's choice was clear: "
            f"up to {summary['largest_gap_rounding_steps']:.0f} rounding steps; a decoding bug)"
        )
    if summary.get("turns_parting_at_ties"):
        return f" (the rest part at near ties of the target's argmax, <= {TIE_STEPS} rounding steps)"
    return ""


def format_table(summary: dict, title: str) -> str:
    s = summary
    lines = [
        title,
        f"  acceptance length (AL)      {s['acceptance_length']:.3f}   "
        f"({s['tokens_from_verify_forwards']} tokens / {s['verify_forwards']} verification forwards)",
        "  acceptance per position     " + " ".join(f"{a:.2f}" for a in s["acceptance_per_position"]),
        "  ... conditional             " + " ".join(f"{a:.2f}" for a in s["acceptance_per_position_conditional"]),
        f"  tokens/s speculative        {s['spec_tokens_per_s']:.1f}",
        f"  tokens/s plain              {s['plain_tokens_per_s']:.1f}",
        f"  speedup                     {s['speedup']:.2f}x",
        f"  turns identical to plain    {s['turns_identical_to_plain']}/{s['turns']}" + identical_note(s),
    ]
    if "ngram" in s:
        lines.append(f"  {'drafter':<16}{'AL':>7}{'tokens/s':>10}{'speedup':>9}   identical to plain")
        for label, row in (("head", s), ("n-gram (free)", s["ngram"])):
            lines.append(
                f"  {label:<16}{row['acceptance_length']:>7.3f}{row['spec_tokens_per_s']:>10.1f}"
                f"{row['speedup']:>8.2f}x   {row['turns_identical_to_plain']}/{row['turns']}" + identical_note(row)
            )
        lines.append("  " + head_vs_ngram(s))
    return "\n".join(lines)


def summarise_drafters(results: list[dict], depth: int, ngram: int | None) -> dict:
    """`summarise` of the head, with prompt lookup's beside it (and the verdict) when it was run."""
    summary = summarise(results, depth)
    if ngram:
        summary["ngram"] = summarise(results, ngram, "ngram")
        summary["head_beats_ngram"] = head_beats_ngram(summary)
    return summary


def head_beats_ngram(summary: dict) -> bool:
    """Speed decides, not AL: a head's draft steps cost forwards that prompt lookup does not pay."""
    return summary["speedup"] > summary["ngram"]["speedup"]


def head_vs_ngram(summary: dict) -> str:
    """The one line that says whether training paid: the head against free drafting on the same prompts."""
    head, ngram = summary, summary["ngram"]
    line = (
        f"head vs n-gram (free): head AL {head['acceptance_length']:.2f} vs {ngram['acceptance_length']:.2f}, "
        f"speed {head['speedup']:.2f}x vs {ngram['speedup']:.2f}x: "
    )
    if head_beats_ngram(summary):
        return line + "the head pays"
    if head["acceptance_length"] > ngram["acceptance_length"]:
        return line + "the head does not beat free drafting (more tokens per forward, but drafting costs more)"
    return line + "the head does not beat free drafting"


def format_engines(summaries: dict[str, dict], title: str) -> str:
    """One row per engine and drafter: the same prompts, each engine against its own plain decoding."""
    lines = [
        title,
        f"  {'engine':<9}{'drafter':<15}{'AL':>7}  {'acceptance per position':<25}{'tok/s plain':>12}"
        f"{'tok/s spec':>11}{'speedup':>9}   identical",
    ]
    for engine, s in summaries.items():
        for label, row in (("head", s), ("n-gram (free)", s.get("ngram"))):
            if row is None:
                continue
            positions = " ".join(f"{a:.2f}" for a in row["acceptance_per_position"])
            lines.append(
                f"  {engine:<9}{label:<15}{row['acceptance_length']:>7.3f}  {positions:<25}"
                f"{row['plain_tokens_per_s']:>12.1f}{row['spec_tokens_per_s']:>11.1f}{row['speedup']:>8.2f}x"
                f"   {row['turns_identical_to_plain']}/{row['turns']}"
            )
    return "\n".join(lines)


def plot_engines(summaries: dict[str, dict], path, title: str) -> bool:
    """Acceptance per draft position of the head in each engine, side by side (one engine: `plot`)."""
    if len(summaries) == 1:
        return plot(next(iter(summaries.values())), path, title)
    try:
        import matplotlib
    except ImportError:
        print(f"plot skipped: matplotlib is not installed (pip install 'eagle-train[plot]' to get {path})")
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(summaries)
    for i, (engine, s) in enumerate(summaries.items()):
        acc = s["acceptance_per_position"]
        xs = [p + 1 + (i - (len(summaries) - 1) / 2) * width for p in range(len(acc))]
        ax.bar(xs, acc, width, label=f"{engine}: AL {s['acceptance_length']:.2f}, {s['speedup']:.2f}x")
    ax.set(xlabel="draft position", ylabel="accepted (share of forwards)", ylim=(0, 1.05), title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def plot(summary: dict, path, title: str) -> bool:
    """Acceptance per draft position and the distribution of tokens per verification forward.
    matplotlib is optional: without it the finished evaluation says how to get the plot and goes on."""
    try:
        import matplotlib
    except ImportError:
        print(f"plot skipped: matplotlib is not installed (pip install 'eagle-train[plot]' to get {path})")
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    acc = summary["acceptance_per_position"]
    positions = list(range(1, len(acc) + 1))
    left.bar(positions, acc, label="accepted (share of forwards)")
    left.plot(
        positions, summary["acceptance_per_position_conditional"], "o-", color="C1", label="given previous accepted"
    )
    left.set(
        xlabel="draft position", ylabel="acceptance", ylim=(0, 1.05), xticks=positions, title="acceptance per position"
    )
    left.legend()
    hist = summary["tokens_per_forward_histogram"]
    right.bar([int(k) for k in hist], list(hist.values()))
    right.set(
        xlabel="tokens per verification forward",
        ylabel="forwards",
        xticks=[int(k) for k in hist],
        title=f"AL = {summary['acceptance_length']:.2f}",
    )
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
