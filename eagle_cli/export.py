"""eagle-export: write a trained head in an engine's layout (or as a llama.cpp GGUF), check a
directory against the engines' loaders, or import an engine-layout directory as a training checkpoint."""

import argparse
import json
import sys
from pathlib import Path

from eagle_train.checkpoint import load_draft_head
from eagle_train.export import LAYOUTS, export_head, ships_target_embedding
from eagle_train.export.gguf import OUTTYPES, spec_type
from eagle_train.export.layouts import verifier_for, verifier_notice
from eagle_train.target import load_input_embedding, load_target_config
from eagle_train.train_checkpoint import checkpoint_step, read_state
from engines import DIRECTORY_ENGINES, ENGINES, check_directory
from engines.llamacpp import draft_gguf
from engines.llamacpp_run import hybrid_flags

LIVE_ENGINES = tuple(name for name, e in ENGINES.items() if e.decodes_live)

EPILOG = """examples:
  eagle-export runs/eagle3/checkpoint-2000 --format eagle3 --out smollm2-eagle3 --target smollm2-135m
  eagle-export runs/eagle3/checkpoint-2000 --format eagle3 --out smollm2-eagle3 --engine vllm
  eagle-export runs/eagle3/checkpoint-2000 --format speculators --out smollm2-spec --eval-results eval.json
  eagle-export runs/eagle3/checkpoint-2000 --format gguf --out smollm2-eagle3.gguf --target smollm2-135m
  eagle-export runs/dflash/final --format dflash --out smollm2-dflash --target smollm2-135m
  eagle-export --check smollm2-dflash --engine vllm --target smollm2-135m
  eagle-export --check smollm2-eagle3 --engine all --target smollm2-135m
  eagle-export --check smollm2-eagle3.gguf --engine llamacpp --target smollm2-135m --source runs/eagle3/final
  eagle-export --import yuhuili/EAGLE3-LLaMA3.1-Instruct-8B-local --out ckpt --target meta-llama/Llama-3.1-8B-Instruct

formats: eagle3 = the EAGLE reference layout SGLang, TensorRT-LLM, vLLM and SafeAILab EAGLE load; speculators
= vLLM's own format (`vllm serve DIR` needs no other flag; P-EAGLE heads too); peagle = a P-EAGLE head for
vLLM's parallel drafting; dflash = z-lab's DFlash layout (vLLM's DFlashDraftModel, llama.cpp's converter);
dspark = DeepSpec's DSpark layout (Qwen3DSparkModel; a head with a learnt mask needs --target: it ships the
target's embed_tokens with the mask token's row learnt, which vLLM embeds the mask slots by); both ship the learnt
mask embedding as mask_embedding.pt, and speculators writes them too (speculators_model_type dflash / dspark, K =
the drafts a block gives; a head trained with block_mask: target, since speculators embeds the mask slots by the
verifier's row); gguf = one file for llama.cpp (`llama-server -m TARGET.gguf -md HEAD.gguf --spec-type
draft-eagle3`, or draft-dflash / draft-dspark for block heads), which needs --target as the target's GGUF (or
an alias shipping one) for its tokenizer. An export is then checked like --check, for --engine alone when
given (a layer choice TensorRT-LLM cannot read from config.json fails no vLLM export). --check exits 1 when an
engine would fail to load the directory or would load it and silently draft worse (missing d2t, short context,
wrong aux layers, RoPE or sizes that disagree with the weights or the target, ...). --engine llamacpp checks a
head (exported first) or a .gguf live: the file against the target's GGUF and --source, then 4 MT-Bench first
turns decoded in llama.cpp and in the built-in runtime; it exits 1 when llama.cpp accepts far fewer drafts,
and 3 (SKIPPED, never a pass) without a llama.cpp build (`eagle-llamacpp build`). --engine vllm with --target
runs a DFlash head in vLLM (method dflash) beside the built-in runtime the same way; vLLM on a CPU has no
DSpark, and says so in one line."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="eagle-export", description=__doc__, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "checkpoint",
        nargs="?",
        help="training checkpoint (checkpoint-N/ with head/), head dir, or an engine-layout dir to convert",
    )
    p.add_argument("--format", choices=[*sorted(LAYOUTS), "gguf"], help="layout to write")
    p.add_argument(
        "--out", help="output (export: the layout dir, or the .gguf file for gguf; --import: the checkpoint dir)"
    )
    p.add_argument(
        "--dtype",
        choices=["bf16", "fp16", "fp32"],
        default="bf16",
        help="weights dtype (default bf16; d2t stays int64, t2d bool)",
    )
    p.add_argument(
        "--outtype",
        choices=list(OUTTYPES),
        help="gguf only: type of the matmul weights (default f32; norms stay f32, d2t int64)",
    )
    p.add_argument(
        "--target",
        help="the target (alias, HF dir, hub id or .gguf): compare context, RoPE and sizes, "
        "and resolve default aux layers of directories that do not state them; "
        "for --format gguf the target's .gguf (or an alias), whose tokenizer the head copies",
    )
    p.add_argument("--eval-results", help="eagle-eval JSON to put the measured acceptance length in the model card")
    p.add_argument("--data", help="training data to name in the model card (default: from the checkpoint)")
    p.add_argument("--steps", type=int, help="training steps for the model card (default: from checkpoint-N)")
    p.add_argument(
        "--speculative-tokens",
        type=int,
        default=3,
        help="draft tokens per step vLLM uses for a speculators export (default 3; a DFlash / DSpark head: "
        "the drafts its block gives)",
    )
    p.add_argument(
        "--verifier",
        help="the target as speculators' loader and `vllm serve DIR` should load it, for a speculators export, "
        "written as given (default: what this machine loads --target or the head's target by: a local directory's "
        "absolute path, an alias's converted directory, else the hub id; a known hub id is kept beside it)",
    )
    p.add_argument(
        "--check",
        metavar="PATH",
        help="report what each engine would do with PATH (a directory; llamacpp: a head or a .gguf)",
    )
    p.add_argument(
        "--engine",
        choices=[*DIRECTORY_ENGINES, "all", *(name for name in ENGINES if name not in DIRECTORY_ENGINES)],
        help="engine for --check, and the engine an export is checked for (default: the engines the "
        "directory's layout is meant for; all = the three that read directories). With --check, llamacpp, "
        "and vllm given --target, also run the head in the engine and compare its acceptance with the "
        "built-in runtime's (vllm without vLLM installed: the rule check, the live part reported as skipped)",
    )
    p.add_argument("--source", help="live checks of an exported file: the head it should have been exported from")
    p.add_argument("--threads", type=int, help="--engine llamacpp: llama.cpp's CPU threads (default: its choice)")
    p.add_argument(
        "--import",
        dest="import_dir",
        metavar="DIR",
        help="engine-layout dir to turn into a training checkpoint at --out",
    )
    args = p.parse_args(argv)
    modes = [m for m in (args.checkpoint, args.check, args.import_dir) if m]
    if len(modes) != 1:
        p.error("give exactly one of CHECKPOINT (export), --check DIR or --import DIR")
    if args.checkpoint and not (args.format and args.out):
        p.error("export needs --format and --out")
    if args.format == "gguf" and not args.target:
        p.error("--format gguf needs --target TARGET.gguf (the target's GGUF, whose tokenizer the head copies)")
    if args.outtype and args.format != "gguf":
        p.error("--outtype is for --format gguf (other formats take --dtype)")
    if args.import_dir and not args.out:
        p.error("--import needs --out CHECKPOINT")
    if args.checkpoint and args.engine and (args.format == "gguf" or args.engine not in (*DIRECTORY_ENGINES, "all")):
        p.error(f"an export is checked for --engine {'|'.join((*DIRECTORY_ENGINES, 'all'))} (not with --format gguf)")
    refusal = ENGINES[args.engine].check_refusal(args.target, args.threads) if args.engine in ENGINES else ""
    if refusal:
        p.error(refusal)
    if args.source and not (args.engine in LIVE_ENGINES and args.target):
        p.error(f"--source is for the live checks: --check PATH --engine {'|'.join(LIVE_ENGINES)} --target TARGET")
    if args.threads is not None and args.engine not in LIVE_ENGINES:  # those that take them, given a target
        takers = [name for name in LIVE_ENGINES if not ENGINES[name].check_refusal("TARGET", args.threads)]
        p.error(f"--threads is for --check PATH --engine {'|'.join(takers)}")
    return args


def checkpoint_provenance(path: Path) -> dict:
    """Steps and data of a training checkpoint: its trainer state (step, config.data_path), else
    the step in a `checkpoint-N` directory name."""
    found = {}
    step = checkpoint_step(path.resolve())
    if step is not None:
        found["steps"] = step
    state = read_state(path) or {}
    if "step" in state:
        found["steps"] = state["step"]
    if (state.get("config") or {}).get("data_path"):
        found["data"] = state["config"]["data_path"]
    return found


def target_config(name):
    if not name:
        return None
    return load_target_config(name)


def engines_asked(engine: str | None) -> list[str] | None:
    """The engines `--engine` names (all: every directory engine); None: those the layout is meant for."""
    return list(DIRECTORY_ENGINES) if engine == "all" else [engine] if engine else None


def print_reports(reports) -> int:
    for report in reports.values():
        print(report.render())
    bad = [r.engine for r in reports.values() if not r.ok]
    good = [r.engine for r in reports.values() if r.ok]
    if not bad:
        print("\nall engines OK")
    elif good:  # exit 1 is then for some engines only: say how to be judged for the one served
        print(f"\nproblems for: {', '.join(bad)}; OK for {', '.join(good)} (--engine NAME judges only that one)")
    else:
        print(f"\nproblems for: {', '.join(bad)}")
    return 1 if bad else 0


def run_gguf(args) -> int:
    outtype = args.outtype or "f32"
    head = load_draft_head(Path(args.checkpoint))
    out = draft_gguf(head, args.out, args.target, outtype)
    combined = " ".join(map(str, hybrid_flags(out, 3)))  # llama.cpp's own rule for the flags, at K=3
    print(
        f"wrote {out} (gguf, {outtype}); serve with: llama-server -m TARGET.gguf -md {out} "
        f"--spec-type {spec_type(head.config)}\n"
        f"or with n-gram lookup first and the head where it finds nothing: llama-server -m TARGET.gguf {combined} "
        "(eagle-eval --engine llamacpp says which pays on your machine)"
    )
    return 0


def run_live_check(args) -> int:
    report = ENGINES[args.engine].check_live(args.check, args.target, args.source, args.threads)
    print(report.render())
    return report.exit_code


def target_embedding_for(args, head):
    """The token embedding of --target, else of the target the head was trained on, for a layout that ships it
    (speculators' EAGLE-3 heads, a DSpark head with a learnt mask): read from the target's files."""
    target = args.target or head.config.target
    why = "its export ships the target's token embedding, which the layout's reader never takes from the target"
    if not target:
        raise ValueError(f"--format {args.format} needs --target TARGET for this head: {why}")
    try:
        return load_input_embedding(target)
    except (OSError, ValueError) as e:
        if args.target:
            raise
        raise ValueError(
            f"--format {args.format} needs --target DIR (a local copy of {target}) for this head: {why}, and its "
            f"target cannot be read here ({e})"
        ) from e


def run(args) -> int:
    if args.checkpoint and args.format == "gguf":  # reads the target GGUF itself: no HF conversion
        return run_gguf(args)
    if args.check and args.engine in LIVE_ENGINES and args.target:
        return run_live_check(args)
    tcfg = target_config(args.target)
    if args.check:
        return print_reports(check_directory(args.check, engines_asked(args.engine), tcfg))
    if args.import_dir:
        out = Path(args.out)
        load_draft_head(args.import_dir, target_config=tcfg).save_pretrained(out / "head")
        print(f"imported {args.import_dir} -> {out}/head (load with eagle_train.checkpoint.load_draft_head)")
        return 0
    source = Path(args.checkpoint)
    head = load_draft_head(source)
    if tcfg is not None and not head.config.target:
        head.config.target = args.target
    provenance = checkpoint_provenance(source)
    provenance.update({k: v for k, v in (("data", args.data), ("steps", args.steps)) if v is not None})
    if args.format == "speculators":
        provenance["speculative_tokens"] = args.speculative_tokens
        if args.verifier:
            provenance["verifier"] = args.verifier
        elif args.target:
            provenance.update(verifier_for(args.target, head.config.target))
    if args.eval_results:
        provenance["eval_results"] = args.eval_results
    embedding = target_embedding_for(args, head) if ships_target_embedding(args.format, head) else None
    out = export_head(head, args.out, args.format, dtype=args.dtype, target_embedding=embedding, **provenance)
    written = ", ".join(sorted(p.name for p in out.iterdir() if p.is_file()))
    print(f"wrote {out}/: {written} ({args.format}, {args.dtype})")
    notices = [LAYOUTS[args.format].notice(head.config), verifier_notice(json.loads((out / "config.json").read_text()))]
    print("".join(f"{line}\n" for line in notices if line))
    return print_reports(check_directory(out, engines_asked(args.engine), tcfg))


def main(argv=None):
    args = parse_args(argv)
    try:
        sys.exit(run(args))
    except (ValueError, OSError, NotImplementedError) as e:
        print(f"eagle-export: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
