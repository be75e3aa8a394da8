"""Several time-to-quality runs on one chart: acceptance length against minutes of compute.

    python scripts/bench/quality_compare.py runs/quality/today runs/quality/distil --out runs/quality/compare.png

Each argument is a `scripts/bench/quality.py --out` directory. Prints every point of every run (compute minutes,
training tokens, AL and speedup per bench and drafting) and draws, per drafting the runs share, each run's AL per
bench against minutes (the dashed line: that run's data ready). --table prints the points as one Markdown table
instead: per point, each drafting's AL per bench, the first's speedup and acceptance per position on the first
bench, and the greedy chain walk.
"""

import argparse
import json
from pathlib import Path


def load(run: str) -> dict:
    path = Path(run) / "quality.json"
    if not path.is_file():
        raise SystemExit(f"{run} holds no quality.json: give directories that scripts/bench/quality.py wrote")
    return json.loads(path.read_text())


def print_points(record: dict) -> None:
    print(
        f"{record['name']}: data {record['data_minutes']:.2f} min, target top-1 p {record['target_top1_probability']}"
    )
    for p in record["points"]:
        for name, results in p["results"].items():
            cells = "  ".join(
                f"{bench} {r['acceptance_length']:.3f} ({r['speedup']:.2f}x, "
                f"{r['turns_identical_to_plain']}/{r['turns']} identical)"
                for bench, r in results.items()
            )
            print(
                f"  {p['compute_minutes']:6.2f} min  step {p['step']:5d}  {p['tokens_seen']:8d} tok  {name:12s} {cells}"
            )
        if p.get("walk"):  # runs before the walk have none
            walk = record["eval"]["walk"]
            cells = "  ".join(
                f"{bench} {w['acceptance_length']:.3f} ({w['rounds']} rounds)" for bench, w in p["walk"].items()
            )
            print(
                f"{'':38s}chain K={walk['chain']} walk, {walk['prompts']} prompts x {walk['max_new_tokens']}: {cells}"
            )


def shared_draftings(records: list[dict]) -> list[str]:
    """The draftings (chain K=3, a tree...) every run evaluated, in the first run's order."""
    return [n for n in records[0]["eval"]["drafting"] if all(n in r["eval"]["drafting"] for r in records)]


def table(records: list[dict]) -> str:
    """The runs' points as one Markdown table, a row per point (the first run's benches, the draftings all share)."""
    benches, names = records[0]["eval"]["benches"], shared_draftings(records)
    first = names[0]
    head = ["run", "recipe", "step", "compute min", *(f"{n} AL" for n in names), f"{first} speedup"]
    head += [f"{first} acceptance per position ({benches[0]})", "chain walk"]
    rows = [head, ["---"] * len(head)]
    for record in records:
        for p in record["points"]:
            res = p["results"]
            cells = [record["name"], record.get("recipe", "-"), str(p["step"]), f"{p['compute_minutes']:.2f}"]
            cells += [" / ".join(f"{res[n][b]['acceptance_length']:.3f}" for b in benches) for n in names]
            cells.append(" / ".join(f"{res[first][b]['speedup']:.2f}x" for b in benches))
            cells.append(" ".join(f"{a:.3f}" for a in res[first][benches[0]]["acceptance_per_position"]))
            walk = p.get("walk")  # runs before the walk have none
            cells.append(" / ".join(f"{walk[b]['acceptance_length']:.4f}" for b in benches) if walk else "-")
            rows.append(cells)
    return "\n".join("| " + " | ".join(r) + " |" for r in rows)


def plot(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = shared_draftings(records)
    benches = records[0]["eval"]["benches"]
    styles = ("o-", "s--", "^:")
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4.5), squeeze=False, sharey=True)
    colors = plt.get_cmap("tab10" if len(records) <= 10 else "tab20")
    for ax, name in zip(axes[0], names):
        for k, record in enumerate(records):
            color = colors(k % colors.N)
            x = [p["compute_minutes"] for p in record["points"]]
            for j, (bench, style) in enumerate(zip(benches, styles)):
                y = [p["results"][name][bench]["acceptance_length"] for p in record["points"]]
                ax.plot(x, y, style, color=color, lw=1, label=record["name"] if j == 0 else None)
            ax.axvline(record["data_minutes"], color=color, ls="--", lw=0.8)
        marks = ", ".join(f"{style[0]} {bench}" for bench, style in zip(benches, styles))
        ax.set(title=f"{name} ({marks})", xlabel="minutes of compute (data + training)", ylabel="acceptance length")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))  # outside: no point hidden; a run a line
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"plot: {path}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="scripts/bench/quality.py output directories")
    p.add_argument("--out", default=None, help="PNG to draw (needs matplotlib); omit to print only")
    p.add_argument("--table", action="store_true", help="print the points as one Markdown table")
    args = p.parse_args(argv)
    records = [load(r) for r in args.runs]
    if args.table:
        print(table(records))
    else:
        for record in records:
            print_points(record)
    if args.out:
        plot(records, Path(args.out))


if __name__ == "__main__":
    main()
