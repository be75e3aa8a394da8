"""`eagle-prep`: conversations -> tokenized dataset -> hidden-state store.

    eagle-prep tokenize   --target smollm2-135m --data sharegpt --limit 64 --out runs/x/tokenized
    eagle-prep show-mask  --target smollm2-135m --data sharegpt --index 0
    eagle-prep regenerate --target smollm2-135m --data sharegpt --limit 64 --out runs/x/regenerated.jsonl
    eagle-prep vocab      --data runs/x/tokenized --draft-vocab-size 32000 [--fill-from sharegpt]
    eagle-prep capture    --target smollm2-135m --data runs/x/tokenized --out runs/x/store
    eagle-prep distil     --target smollm2-135m --data sharegpt --limit 500 --out runs/x/store
    eagle-prep run        --config smollm2_sharegpt [prep.num_conversations=200 ...]

Each subcommand is a function of keyword arguments: a library call and the summary it prints;
`run` calls them in turn with a YAML config's values. Each knob is declared once (`data_prep.knobs`):
a subcommand's flags and `run`'s YAML keys are the same fields, with the library function's default.
`capture` runs under `accelerate launch` as is: each process captures its share of the shards.
"""

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

import torch
import yaml
from tqdm import tqdm

from data_prep.capture import capture
from data_prep.chat import SkipSample, show_mask, tokenize_conversation
from data_prep.dataset import tokenize_dataset
from data_prep.distil import distil
from data_prep.knobs import (
    RUN_KEYS,
    Capture,
    Conversations,
    Count,
    Distil,
    Engine,
    Regenerate,
    Steps,
    Store,
    Target,
    Tokenize,
    Vocab,
    VocabFill,
    add_flags,
    from_run,
    knobs,
)
from data_prep.readers import ReadReport, read_conversations
from data_prep.regenerate import regenerate
from data_prep.vocab import count_answer_tokens, coverage_line, kept_fill_counts, make_vocab_map, write_fill_counts
from eagle_train.architectures import check_supported
from eagle_train.bf16 import data_engine_dtype
from eagle_train.config_files import config_file
from eagle_train.store import read_manifest
from eagle_train.target import load_target, load_target_config, load_tokenizer
from eagle_train.train_config import parse_overrides
from engines import EngineError


def check_trainable(target) -> None:
    """Refuse, from its config alone, a target training cannot take: what these commands write is
    training's input, so they refuse before loading weights or reading data, not hours later."""
    check_supported(load_target_config(target), "training")


def _open_target(target, device=None, dtype=None):
    return load_target(target, dtype, device=device or ("cuda" if torch.cuda.is_available() else "cpu"))


def tokenize(target, data, out, **options) -> dict:
    """`tokenize_dataset(data, out, target, **options)` and its summary."""
    check_trainable(target)
    start = time.perf_counter()
    manifest, report, vmap = tokenize_dataset(data, out, target, **options)
    print(report.summary())
    print(coverage_line(vmap))
    print(
        f"tokenized {manifest['num_samples']} conversations, {manifest['num_tokens']} tokens "
        f"({int(vmap['counts'].sum())} loss-masked) in {time.perf_counter() - start:.1f}s -> {out}"
    )
    return manifest


def print_mask(target, data, index, template, color, split, max_length, system_prompt) -> None:
    """Print conversation `index` of `data` with its loss-masked tokens marked."""
    tokenizer = load_tokenizer(target)
    if template:
        tokenizer.chat_template = Path(template).read_text()
    report = ReadReport()
    convs = list(read_conversations(data, limit=index + 1, report=report, split=split))
    if len(convs) <= index:
        sys.exit(f"only {len(convs)} usable conversations in {data}\n{report.summary()}")
    try:
        s = tokenize_conversation(tokenizer, convs[index]["messages"], max_length, system_prompt)
    except SkipSample as e:
        sys.exit(f"conversation {convs[index]['id']} is skipped: {e}")
    color = color and sys.stdout.isatty()
    print(show_mask(tokenizer, s["input_ids"], s["loss_mask"], color=color))
    print(
        f"\n-- conversation {convs[index]['id']}: {len(s['input_ids'])} tokens, "
        f"{int(s['loss_mask'].sum())} loss-masked ({'highlighted' if color else 'in [[ ]]'})"
    )


def regenerate_answers(target, data, out, *, limit, split, seed, device=None, engine_dtype=None, **options) -> dict:
    """`regenerate(**options)` of up to `limit` conversations of `data` by the target, loaded in the data engines'
    dtype (`data_engine_dtype`), into the JSONL `out`, and its counts."""
    check_trainable(target)
    if seed is not None:
        torch.manual_seed(seed)
    model, tokenizer = _open_target(target, device, data_engine_dtype({"dtype": engine_dtype}))
    report = ReadReport()
    convs = read_conversations(data, limit=limit, report=report, split=split)
    start = time.perf_counter()
    with tqdm(total=limit, unit="conv", desc="regenerate") as bar:
        counts = regenerate(model, tokenizer, convs, out, progress=bar, **options)
    print(report.summary())
    print(
        f"regenerated {counts['written']} conversations ({counts['skipped_done']} already done, "
        f"{counts['empty']} with no room to generate) in {time.perf_counter() - start:.1f}s, "
        f"{str(model.dtype).removeprefix('torch.')} -> {out}"
    )
    return counts


ENGINE_SETTINGS = {  # the options of distil and capture that configure the engine: `vllm.LLM`'s names, but the KV cache
    "cpu_kv_cache_gib": "--cpu-kv-cache-gib",
    "tensor_parallel_size": "--tensor-parallel-size",
    "pipeline_parallel_size": "--pipeline-parallel-size",
    "gpu_memory_utilization": "--gpu-memory-utilization",
    "dtype": "--engine-dtype",
}


def parse_shard(text: str) -> tuple[int, int]:
    """`--shard i/n`: this run's part of n runs over one store."""
    i, _, n = text.partition("/")
    if not (i.isdigit() and n.isdigit()) or not 0 <= int(i) < int(n):
        raise argparse.ArgumentTypeError(f"{text!r}: i/n with 0 <= i < n, e.g. 0/8")
    return int(i), int(n)


def settings_of(engine: str, given: dict | None) -> dict:
    """The engine settings given on the command line, with the data engines' dtype (`data_engine_dtype`) unless
    one is given; vLLM's own settings are refused, in one line, for hf."""
    given = {k: v for k, v in (given or {}).items() if v is not None}
    if set(given) - {"dtype"} and engine != "vllm":
        vllms = [ENGINE_SETTINGS[k] for k in given if k != "dtype"]
        raise ValueError(f"{', '.join(vllms)}: vLLM's settings; add --engine vllm")
    return {**given, "dtype": data_engine_dtype(given)}


def distil_store(target, data, out, *, limit, split, device=None, engine="hf", engine_settings=None, **options):
    """`distil(**options)`: the target answers up to `limit` conversations of `data`, captured into the store `out`
    (engine hf: loaded here; vllm: in vLLM), with `engine_settings` (`ENGINE_SETTINGS`' keys)."""
    check_trainable(target)
    options["engine_options"] = settings_of(engine, engine_settings)
    if engine == "vllm":
        model, tokenizer = None, load_tokenizer(target)
    else:
        model, tokenizer = _open_target(target, device, options["engine_options"]["dtype"])
    manifest, stats = distil(
        model, tokenizer, data, out, target_name=target, limit=limit, split=split, engine=engine, **options
    )
    seconds = max(stats["seconds"], 1e-9)
    print(
        f"distilled {stats['conversations']} conversations this run ({stats['answers']} answers): "
        f"{stats['answer_tokens']} answer tokens ({stats['tokens']} with prompts) in {stats['seconds']:.1f}s "
        f"({stats['conversations'] / seconds:.2f} conversations/s, {stats['answer_tokens'] / seconds:.0f} answer tok/s"
        + f"; {engine} in {stats['engine_dtype']}"
        + (f", started in {stats['engine_start_seconds']:.1f}s)" if "engine_start_seconds" in stats else ")")
    )
    for reason, count in stats["cut"].items():
        print(f"{count} conversations answered fewer turns than asked, or none: {reason}")
    if manifest is None:
        i, n = options.get("shard", (0, 1))
        print(
            f"shard {i}/{n} of {out} is written; the store is finished by the last of the {n} runs to end "
            "(a run killed before its end resumes when run again)"
        )
        return None
    print(coverage_line(stats["vocab_map"]))
    print_store_line(out, manifest)
    return manifest


def check_fill_conversations(n) -> None:
    if n < 1:
        raise ValueError(f"fill_conversations must be >= 1 (the conversations whose answers fill the map), got {n}")


def rewrite_vocab_map(data, draft_vocab_size, fill_from, fill_conversations, keep_fill=False) -> dict:
    """Recount the loss-masked tokens of a tokenized dataset or store and rewrite its vocab map; with
    `fill_from`, ids the data uses equally often (never, most of all) go by the answers of that source's first
    `fill_conversations` conversations (`keep_fill`: as counted before, when they were)."""
    check_fill_conversations(fill_conversations)
    manifest = read_manifest(data)
    vocab_size = manifest["target"]["vocab_size"]
    fill = None
    if fill_from:
        fill = fill_counts(data, manifest, fill_from, fill_conversations, keep_fill)
    vmap = make_vocab_map(data, vocab_size, draft_vocab_size, fill)
    print(coverage_line(vmap))
    if fill is not None:
        filled = int((vmap["t2d"] & (vmap["counts"] == 0)).sum())
        print(f"{filled} draft ids the data never uses, chosen by {int(fill.sum())} answer tokens of {fill_from}")
    print(f"wrote {Path(data) / 'vocab_map.safetensors'}")
    return vmap


def fill_counts(data, manifest: dict, source: str, conversations: int, keep: bool) -> torch.Tensor:
    """`count_answer_tokens` of `source` by the data's tokenizer, kept beside its vocab map; with `keep`, the counts
    kept there by an earlier count of the same, since recounting 20,000 conversations takes a minute."""
    record = {"source": str(source), "conversations": str(conversations), "tokenizer": str(manifest["tokenizer"])}
    fill = kept_fill_counts(data, record) if keep else None
    if fill is not None:
        print(f"vocab fill: kept the counts of {conversations} conversations of {source} (`eagle-prep vocab` recounts)")
        return fill
    tokenizer = load_tokenizer(manifest["tokenizer"])
    fill = count_answer_tokens(source, tokenizer, manifest["target"]["vocab_size"], conversations)
    write_fill_counts(data, fill, record)
    return fill


def capture_store(target, data, out, *, engine="hf", shard=(0, 1), engine_settings=None, **options) -> dict | None:
    """`capture(**options)` of this process's share of the shards (all of them in one process) and its summary:
    the processes of one `accelerate launch`, or independent runs (`shard` = (i, n), or a vLLM engine)."""
    check_trainable(target)
    settings = settings_of(engine, engine_settings)
    if engine == "vllm" or shard != (0, 1):
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ValueError("--shard and --engine vllm run one process each: launch them without accelerate")
        model, pad_id = None, 0
        if engine == "hf":
            model, tokenizer = _open_target(target, dtype=settings["dtype"])
            pad_id = tokenizer.pad_token_id
        (rank, world), barrier, ends = shard, None, None
    else:
        from accelerate import Accelerator

        acc = Accelerator(cpu=not torch.cuda.is_available())
        dist = torch.distributed
        backend = dist.get_backend() if dist.is_available() and dist.is_initialized() else "none"
        world = dist.get_world_size() if backend != "none" else 1
        if acc.is_main_process:
            print(f"capture: {acc.num_processes} process(es), torch.distributed world size {world}, backend {backend}")
        model, tokenizer = _open_target(target, acc.device, settings["dtype"])
        pad_id, rank, world = tokenizer.pad_token_id, acc.process_index, acc.num_processes
        barrier, ends = acc.wait_for_everyone, acc.end_training
    manifest, stats = capture(
        model,
        data,
        out,
        target_name=target,
        rank=rank,
        world_size=world,
        barrier=barrier,
        pad_id=pad_id,
        engine=engine,
        engine_options=settings,
        **options,
    )
    rate = stats["tokens"] / stats["seconds"] if stats["seconds"] > 0 else 0.0
    print(
        f"rank {rank}: captured {stats['shards']} shards, {stats['tokens']} tokens "
        f"in {stats['seconds']:.1f}s ({rate:.0f} tok/s)"
    )
    if manifest is not None:
        print_store_line(out, manifest)
    elif barrier is None:
        print(f"shard {rank}/{world} of {out} is written; the last of the {world} runs to end finishes the store")
    if ends is not None:
        ends()
    return manifest


def print_store_line(out, manifest: dict) -> None:
    size = sum((Path(out) / s["file"]).stat().st_size for s in manifest["shards"])
    print(
        f"store {out}: {manifest['num_samples']} samples, {manifest['num_tokens']} tokens, "
        f"{len(manifest['shards'])} shards, {manifest['dtype']}, aux layers {manifest['aux_layer_ids']}, "
        f"{size / 1e6:.1f} MB ({size / max(manifest['num_tokens'], 1):.0f} bytes/token)"
    )


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
    values = _flatten(yaml.safe_load(config_file(path).read_text()) or {})
    values.update(parse_overrides(list(overrides)))
    unknown = sorted(set(values) - set(RUN_KEYS))
    if unknown:
        raise ValueError(
            f"unknown key(s) {', '.join(unknown)} in {path} or the overrides; the keys are: {', '.join(RUN_KEYS)}"
        )
    values = {**RUN_KEYS, **values}
    if not values["out_dir"]:
        raise ValueError(f"{path} sets no out_dir (where tokenized/ and store/ go)")
    return values


def run(config, overrides) -> None:
    """The whole pipeline from a YAML config: distil, or [regenerate] -> tokenize -> [capture]."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        sys.exit("`eagle-prep run` is one process; for several, run `accelerate launch -m data_prep.cli capture ...`")
    values = load_run_config(config, overrides)
    steps, target, conversations = (from_run(section, values) for section in (Steps, Target, Conversations))
    count, vocab, fill, store = (from_run(section, values) for section in (Count, Vocab, VocabFill, Store))
    check_fill_conversations(fill.fill_conversations)  # before hours of data, not after
    out = Path(steps.out_dir)
    if steps.distil:
        distil_store(
            **knobs(target, conversations, count, vocab, store, from_run(Distil, values), from_run(Engine, values)),
            out=out / "store",
        )
        fill_vocab_map(out / "store", vocab, fill)
        return
    if steps.regenerate:
        regenerated = out / "regenerated.jsonl"
        regenerate_answers(**knobs(target, conversations, count, from_run(Regenerate, values)), out=regenerated)
        # the regenerated conversations hold the system prompt
        conversations = dataclasses.replace(conversations, data=str(regenerated), system_prompt=None)
    tokenize(**knobs(target, conversations, count, vocab, from_run(Tokenize, values)), out=out / "tokenized")
    fill_vocab_map(out / "tokenized", vocab, fill)  # capture copies it into the store
    if steps.capture:
        capture_store(**knobs(target, store, from_run(Capture, values)), data=out / "tokenized", out=out / "store")


def fill_vocab_map(data: Path, vocab: Vocab, fill: VocabFill) -> None:
    """`eagle-prep vocab --fill-from` on the data `run` just wrote, when its config names a source, keeping the
    counts of an earlier run's fill."""
    if fill.fill_from:
        rewrite_vocab_map(data, **knobs(vocab, fill), keep_fill=True)


def engine_dtype_argument(s, note: str = "") -> None:
    """--engine-dtype, of every command that runs the target to make data."""
    s.add_argument(
        "--engine-dtype",
        choices=["float32", "bfloat16", "float16"],
        help=f"the target's dtype (default bfloat16 on CUDA and on CPUs with bf16 instructions, else float32{note})",
    )


def engine_arguments(s) -> None:
    """--engine, --shard and vLLM's settings, of the commands a serving engine can run (distil, capture)."""
    add_flags(s, Engine)
    s.add_argument(
        "--shard",
        type=parse_shard,
        default=(0, 1),
        metavar="I/N",
        help="do only shards I, I+N, ... of the plan: N runs with the same settings (one per GPU group or "
        "node, on a shared directory) fill one store, and the last to end finishes it (default 0/1)",
    )
    engine_dtype_argument(s, "; vllm in float32 is exact against hf in float32")
    group = s.add_argument_group("vLLM's settings (--engine vllm)")
    group.add_argument(
        "--cpu-kv-cache-gib",
        type=int,
        help="on a CPU: GiB of KV cache (each sequence's KV and captured states live there; default 6)",
    )
    group.add_argument("--tensor-parallel-size", type=int, help="GPUs one engine splits each layer over")
    group.add_argument("--pipeline-parallel-size", type=int, help="GPUs one engine splits the layers over")
    group.add_argument("--gpu-memory-utilization", type=float, help="share of each GPU's memory vLLM takes")


def build_parser() -> argparse.ArgumentParser:
    """Each subcommand: its knobs' flags (`data_prep.knobs`), then the flags only it has."""
    p = argparse.ArgumentParser(
        prog="eagle-prep", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True)

    def add(name, fn, help_, *sections, out=None):
        s = sub.add_parser(name, help=help_, description=help_)
        s.set_defaults(fn=fn)
        add_flags(s, *sections)
        if out:
            s.add_argument("--out", required=True, help=out)
        return s

    add(
        "tokenize",
        tokenize,
        "render conversations with the target's chat template, mask assistant tokens, "
        "write a tokenized dataset dir (input of capture and online training) "
        "and its vocab map",
        *(Target, Conversations, Count, Vocab, Tokenize),
        out="output directory",
    )

    s = add(
        "show-mask",
        print_mask,
        "print one conversation with its loss-masked (trained) tokens highlighted; use it to check a new chat template",
        *(Target, Conversations),
    )
    s.add_argument("--index", type=int, default=0, help="which usable conversation to show")
    s.add_argument("--template", default=None, help="a jinja chat template file to use instead of the tokenizer's")
    s.add_argument("--no-color", dest="color", action="store_false", help="mark spans with [[ ]] instead of colour")

    s = add(
        "regenerate",
        regenerate_answers,
        "replace assistant turns with the target's own responses (JSONL out, resumable)",
        *(Target, Conversations, Count, Regenerate),
        out="output .jsonl (appended; ids already there are skipped)",
    )
    s.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    engine_dtype_argument(s)

    s = add(
        "vocab",
        rewrite_vocab_map,
        "recount loss-masked tokens of a tokenized dataset or store and rewrite its draft vocab map",
        *(Vocab, VocabFill),
    )
    s.add_argument("--data", required=True, help="tokenized dataset or store directory")

    s = add(
        "capture",
        capture_store,
        "run the target over a tokenized dataset and store its aux + final hidden "
        "states (resumable; run under `accelerate launch` for several processes)",
        *(Target, Store, Capture),
        out="store directory",
    )
    s.add_argument("--data", required=True, help="tokenized dataset directory (from `tokenize`)")
    engine_arguments(s)
    s.add_argument("--no-progress", dest="progress", action="store_false")

    s = add(
        "distil",
        distil_store,
        "the target answers the user turns of each conversation (greedy, batched; the first by default) and the "
        "hidden states of those same forwards are stored: self-distilled offline data in one pass (resumable)",
        *(Target, Conversations, Count, Distil, Store, Vocab),
        out="store directory",
    )
    s.add_argument("--device", default=None, help="hf engine; default: cuda if available, else cpu")
    engine_arguments(s)
    s.add_argument("--no-progress", dest="progress", action="store_false")

    s = add("run", run, "run the pipeline of a YAML config: distil, or [regenerate] -> tokenize -> capture")
    s.add_argument("--config", required=True, help="a prep YAML: a path, or a shipped config's name (smollm2_sharegpt)")
    s.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="override a config key by its dotted path, e.g. prep.num_conversations=200 "
        "prep.capture.dtype=float8_e4m3fn out_dir=runs/x",
    )
    return p


def main(argv=None) -> None:
    options = vars(build_parser().parse_args(argv))
    command, fn = options.pop("command"), options.pop("fn")
    if fn in (distil_store, capture_store):
        options["engine_settings"] = {k: options.pop(flag[2:].replace("-", "_")) for k, flag in ENGINE_SETTINGS.items()}
    try:
        fn(**options)
    except (ValueError, OSError, EngineError) as e:  # bad input, unwritable output, an engine that failed: one line
        raise SystemExit(f"eagle-prep {command}: error: {e}") from e


if __name__ == "__main__":
    main()
