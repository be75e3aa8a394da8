"""`eagle-prep`: conversations -> tokenized dataset -> hidden-state store.

    eagle-prep tokenize   --target smollm2-135m --data sharegpt --limit 64 --out runs/x/tokenized
    eagle-prep show-mask  --target smollm2-135m --data sharegpt --index 0
    eagle-prep regenerate --target smollm2-135m --data sharegpt --limit 64 --out runs/x/regenerated.jsonl
    eagle-prep vocab      --data runs/x/tokenized --draft-vocab-size 32000
    eagle-prep capture    --target smollm2-135m --data runs/x/tokenized --out runs/x/store
    eagle-prep run        --config configs/smollm2_sharegpt.yaml [prep.num_conversations=200 ...]

`capture` runs under `accelerate launch` as is: each process captures its share of the shards.
"""

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import yaml


def _parse_layers(text):
    return tuple(int(x) for x in text.split(",")) if text else None


def _open_target(target, device=None):
    from eagle_train.target import load_target

    return load_target(target, device=device or ("cuda" if torch.cuda.is_available() else "cpu"))


def cmd_tokenize(a) -> dict:
    from data_prep.dataset import tokenize_dataset
    from data_prep.vocab import coverage_line

    start = time.perf_counter()
    manifest, report, vmap = tokenize_dataset(a.data, a.out, a.target, max_length=a.max_length, limit=a.limit,
                                              system_prompt=a.system_prompt, draft_vocab_size=a.draft_vocab_size,
                                              shard_tokens=a.shard_tokens, split=a.split,
                                              workers=getattr(a, "workers", 1))
    print(report.summary())
    print(coverage_line(vmap))
    print(f"tokenized {manifest['num_samples']} conversations, {manifest['num_tokens']} tokens "
          f"({int(vmap['counts'].sum())} loss-masked) in {time.perf_counter() - start:.1f}s -> {a.out}")
    return manifest


def cmd_show_mask(a) -> None:
    from data_prep.chat import SkipSample, show_mask, tokenize_conversation
    from data_prep.readers import ReadReport, read_conversations
    from eagle_train.target import load_tokenizer

    tokenizer = load_tokenizer(a.target)
    if a.template:
        tokenizer.chat_template = Path(a.template).read_text()
    report = ReadReport()
    convs = list(read_conversations(a.data, limit=a.index + 1, report=report, split=a.split))
    if len(convs) <= a.index:
        sys.exit(f"only {len(convs)} usable conversations in {a.data}\n{report.summary()}")
    try:
        s = tokenize_conversation(tokenizer, convs[a.index]["messages"], a.max_length, a.system_prompt)
    except SkipSample as e:
        sys.exit(f"conversation {convs[a.index]['id']} is skipped: {e}")
    color = sys.stdout.isatty() and not a.no_color
    print(show_mask(tokenizer, s["input_ids"], s["loss_mask"], color=color))
    print(f"\n-- conversation {convs[a.index]['id']}: {len(s['input_ids'])} tokens, "
          f"{int(s['loss_mask'].sum())} loss-masked ({'highlighted' if color else 'in [[ ]]'})")


def cmd_regenerate(a) -> dict:
    from tqdm import tqdm

    from data_prep.readers import ReadReport, read_conversations
    from data_prep.regenerate import regenerate

    if a.seed is not None:
        torch.manual_seed(a.seed)
    model, tokenizer = _open_target(a.target, a.device)
    report = ReadReport()
    convs = read_conversations(a.data, limit=a.limit, report=report, split=a.split)
    start = time.perf_counter()
    with tqdm(total=a.limit, unit="conv", desc="regenerate") as bar:
        counts = regenerate(model, tokenizer, convs, a.out, batch_size=a.batch_size, progress=bar,
                            max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_p=a.top_p,
                            max_length=a.max_length, system_prompt=a.system_prompt, max_turns=a.max_turns)
    print(report.summary())
    print(f"regenerated {counts['written']} conversations ({counts['skipped_done']} already done, "
          f"{counts['empty']} with no room to generate) in {time.perf_counter() - start:.1f}s -> {a.out}")
    return counts


def cmd_vocab(a) -> dict:
    from data_prep.vocab import coverage_line, make_vocab_map
    from eagle_train.store import read_manifest

    vocab_size = read_manifest(a.data)["target"]["vocab_size"]
    vmap = make_vocab_map(a.data, vocab_size, a.draft_vocab_size)
    print(coverage_line(vmap))
    print(f"wrote {Path(a.data) / 'vocab_map.safetensors'}")
    return vmap


def cmd_capture(a) -> dict | None:
    from accelerate import Accelerator

    from data_prep.capture import capture

    acc = Accelerator(cpu=not torch.cuda.is_available())
    dist = torch.distributed
    backend = dist.get_backend() if dist.is_available() and dist.is_initialized() else "none"
    world = dist.get_world_size() if backend != "none" else 1
    if acc.is_main_process:
        print(f"capture: {acc.num_processes} process(es), torch.distributed world size {world}, backend {backend}")
    model, tokenizer = _open_target(a.target, acc.device)
    manifest, stats = capture(model, a.data, a.out, target_name=a.target, aux_layer_ids=_parse_layers(a.aux_layers),
                              dtype=a.dtype, token_budget=a.token_budget, shard_tokens=a.shard_tokens,
                              rank=acc.process_index, world_size=acc.num_processes, barrier=acc.wait_for_everyone,
                              pad_id=tokenizer.pad_token_id, progress=not a.no_progress)
    rate = stats["tokens"] / stats["seconds"] if stats["seconds"] > 0 else 0.0
    print(f"rank {acc.process_index}: captured {stats['shards']} shards, {stats['tokens']} tokens "
          f"in {stats['seconds']:.1f}s ({rate:.0f} tok/s)")
    if manifest is not None:
        size = sum((Path(a.out) / s["file"]).stat().st_size for s in manifest["shards"])
        print(f"store {a.out}: {manifest['num_samples']} samples, {manifest['num_tokens']} tokens, "
              f"{len(manifest['shards'])} shards, {manifest['dtype']}, aux layers {manifest['aux_layer_ids']}, "
              f"{size / 1e6:.1f} MB ({size / max(manifest['num_tokens'], 1):.0f} bytes/token)")
    acc.end_training()
    return manifest


# Every key `eagle-prep run` reads (dotted paths into the YAML) and its default. Any other key, in
# the file or on the command line, is refused: a misspelt key must not silently fall back.
RUN_KEYS = {
    "target": "smollm2-135m", "data": "sharegpt", "out_dir": None,
    "prep.num_conversations": None, "prep.max_length": 2048, "prep.split": "train", "prep.system_prompt": None,
    "prep.draft_vocab_size": 32000, "prep.tokenized_shard_tokens": 1 << 20, "prep.workers": 1,
    "prep.regenerate.enabled": False, "prep.regenerate.batch_size": 8, "prep.regenerate.max_new_tokens": 256,
    "prep.regenerate.temperature": 0.0, "prep.regenerate.top_p": 1.0, "prep.regenerate.seed": 0,
    "prep.regenerate.max_turns": None,
    "prep.capture.enabled": True, "prep.capture.dtype": "bfloat16", "prep.capture.aux_layer_ids": None,
    "prep.capture.token_budget": 8192, "prep.capture.shard_tokens": 1 << 16,
}


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def load_run_config(path, overrides=()) -> dict:
    """The YAML config of `eagle-prep run` with `key=value` overrides (`prep.max_length=1024`), as
    dotted keys with their defaults filled in."""
    from eagle_train.train_config import parse_overrides

    values = _flatten(yaml.safe_load(Path(path).read_text()) or {})
    values.update(parse_overrides(list(overrides)))
    unknown = sorted(set(values) - set(RUN_KEYS))
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(unknown)} in {path} or the overrides; "
                         f"the keys are: {', '.join(RUN_KEYS)}")
    values = {**RUN_KEYS, **values}
    if not values["out_dir"]:
        raise ValueError(f"{path} sets no out_dir (where tokenized/ and store/ go)")
    return values


def cmd_run(a) -> None:
    """The whole pipeline from a YAML config: [regenerate] -> tokenize -> [capture]."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        sys.exit("`eagle-prep run` is one process; for several, run `accelerate launch -m data_prep.cli capture ...`")
    c = load_run_config(a.config, a.overrides)
    out = Path(c["out_dir"])
    common = {"target": c["target"], "split": c["prep.split"], "system_prompt": c["prep.system_prompt"],
              "max_length": c["prep.max_length"], "limit": c["prep.num_conversations"]}
    data = c["data"]
    if c["prep.regenerate.enabled"]:
        jsonl = out / "regenerated.jsonl"
        cmd_regenerate(argparse.Namespace(**common, data=data, out=jsonl, device=None, seed=c["prep.regenerate.seed"],
                                          batch_size=c["prep.regenerate.batch_size"],
                                          max_new_tokens=c["prep.regenerate.max_new_tokens"],
                                          temperature=c["prep.regenerate.temperature"],
                                          top_p=c["prep.regenerate.top_p"], max_turns=c["prep.regenerate.max_turns"]))
        data = str(jsonl)
        common["system_prompt"] = None  # already applied by regeneration
    tokenized = out / "tokenized"
    cmd_tokenize(argparse.Namespace(**common, data=data, out=tokenized, draft_vocab_size=c["prep.draft_vocab_size"],
                                    shard_tokens=c["prep.tokenized_shard_tokens"], workers=c["prep.workers"]))
    if c["prep.capture.enabled"]:
        layers = c["prep.capture.aux_layer_ids"]
        cmd_capture(argparse.Namespace(target=c["target"], data=tokenized, out=out / "store",
                                       aux_layers=",".join(map(str, layers)) if layers else None,
                                       dtype=c["prep.capture.dtype"], token_budget=c["prep.capture.token_budget"],
                                       shard_tokens=c["prep.capture.shard_tokens"], no_progress=False))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="eagle-prep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    def add(name, fn, help_):
        s = sub.add_parser(name, help=help_, description=help_)
        s.set_defaults(fn=fn)
        return s

    def source(s, out_help=None):
        s.add_argument("--target", default="smollm2-135m",
                       help="hub id, local HF dir, .gguf file or alias (smollm2-135m)")
        s.add_argument("--data", default="sharegpt",
                       help="'sharegpt', a .json/.jsonl/.parquet file, a saved datasets dir or a hub dataset")
        s.add_argument("--split", default="train", help="split for hub / DatasetDict sources")
        s.add_argument("--max-length", type=int, default=2048, help="truncate conversations to this many tokens")
        s.add_argument("--system-prompt", default=None, help="replace every conversation's system prompt with this")
        if out_help:
            s.add_argument("--out", required=True, help=out_help)

    s = add("tokenize", cmd_tokenize, "render conversations with the target's chat template, mask assistant tokens, "
                                      "write a tokenized dataset dir (input of capture and online training) "
                                      "and its vocab map")
    source(s, "output directory")
    s.add_argument("--limit", type=int, default=None, help="stop after this many usable conversations")
    s.add_argument("--draft-vocab-size", type=int, default=32000)
    s.add_argument("--shard-tokens", type=int, default=1 << 20, help="tokens per shard file")
    s.add_argument("--workers", type=int, default=1, help="processes that render and tokenize (same output)")

    s = add("show-mask", cmd_show_mask, "print one conversation with its loss-masked (trained) tokens highlighted; "
                                        "use it to check a new chat template")
    source(s)
    s.add_argument("--index", type=int, default=0, help="which usable conversation to show")
    s.add_argument("--template", default=None, help="a jinja chat template file to use instead of the tokenizer's")
    s.add_argument("--no-color", action="store_true", help="mark spans with [[ ]] instead of colour")

    s = add("regenerate", cmd_regenerate,
            "replace assistant turns with the target's own responses (JSONL out, resumable)")
    source(s, "output .jsonl (appended; ids already there are skipped)")
    s.add_argument("--limit", type=int, default=None)
    s.add_argument("--batch-size", type=int, default=8)
    s.add_argument("--max-new-tokens", type=int, default=256)
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--max-turns", type=int, default=None,
                   help="regenerate at most this many assistant turns per conversation (later turns are dropped)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--device", default=None, help="default: cuda if available, else cpu")

    s = add("vocab", cmd_vocab,
            "recount loss-masked tokens of a tokenized dataset or store and rewrite its draft vocab map")
    s.add_argument("--data", required=True, help="tokenized dataset or store directory")
    s.add_argument("--draft-vocab-size", type=int, default=32000)

    s = add("capture", cmd_capture, "run the target over a tokenized dataset and store its aux + final hidden states "
                                    "(resumable; run under `accelerate launch` for several processes)")
    s.add_argument("--target", default="smollm2-135m")
    s.add_argument("--data", required=True, help="tokenized dataset directory (from `tokenize`)")
    s.add_argument("--out", required=True, help="store directory")
    s.add_argument("--aux-layers", default=None, help="comma-separated hidden_states indices; default 2,N//2,N-3")
    s.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float8_e4m3fn", "float32"])
    s.add_argument("--token-budget", type=int, default=8192, help="padded tokens per forward")
    s.add_argument("--shard-tokens", type=int, default=1 << 16, help="tokens per shard (the unit of resume)")
    s.add_argument("--no-progress", action="store_true")

    s = add("run", cmd_run, "run the pipeline of a YAML config ([regenerate] -> tokenize -> capture)")
    s.add_argument("--config", required=True)
    s.add_argument("overrides", nargs="*", metavar="key=value",
                   help="override a config key by its dotted path, e.g. prep.num_conversations=200 "
                        "prep.capture.dtype=float8_e4m3fn out_dir=runs/x")
    return p


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.fn(args)
    except (ValueError, FileNotFoundError) as e:  # bad input: the message names the problem, no traceback
        raise SystemExit(f"eagle-prep {args.cmd}: error: {e}") from e


if __name__ == "__main__":
    main()
