"""eagle-prep's knobs, each declared once: its default, its help, its flag and its key in `eagle-prep run`'s YAML.

A section is a dataclass of the knobs that go together to the library calls that take them. A subcommand's flags
are the fields of its sections (`add_flags`); `eagle-prep run` reads the same fields from its YAML by their keys
(`RUN_KEYS`, `from_run`), so a flag and a YAML key cannot disagree. Defaults are the library functions' own (read
from their signatures), so neither can the library.
"""

import argparse
import dataclasses
import inspect
from dataclasses import dataclass, field

from data_prep.capture import capture
from data_prep.chat import MAX_LENGTH
from data_prep.dataset import tokenize_dataset
from data_prep.distil import ENGINES, distil
from data_prep.readers import SHAREGPT, read_conversations
from data_prep.regenerate import regenerate, regenerate_batch
from eagle_train.store import STORE_DTYPES
from eagle_train.target import SMOLLM2
from engines.vllm_child import INSTALL_HINT


def default(fn, name: str):
    """The default of `fn`'s parameter `name`."""
    return inspect.signature(fn).parameters[name].default


def knob(default, key: str, help: str, flag: str | None = None, from_yaml=None, **argparse_options):
    """A field: `key` its dotted path in the YAML, `flag` its command-line flag (None: the YAML's only),
    `from_yaml` what turns a YAML value into the field's, `argparse_options` (type, choices) what argparse needs
    beyond the default and the help."""
    metadata = {"key": key, "help": help, "flag": flag, "from_yaml": from_yaml, "argparse": argparse_options}
    return field(default=default, metadata=metadata)


def parse_layers(text: str) -> tuple[int, ...] | None:
    """`--aux-layers 2,15,27`."""
    return tuple(int(x) for x in text.split(",")) if text else None


def parse_turns(text: str) -> int | None:
    """`--turns`: a count, or `all` (None)."""
    if text == "all":
        return None
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a number of turns (1, 2, ...) or all")
    return int(text)


def yaml_turns(value) -> int | None:
    """`prep.distil.turns` of a YAML config: a count, all, or null (all)."""
    try:
        return None if value is None else parse_turns(str(value))
    except argparse.ArgumentTypeError as e:
        raise ValueError(f"prep.distil.turns: {e}") from e


@dataclass
class Target:
    target: str = knob(SMOLLM2, "target", "hub id, local HF dir, .gguf file or alias (smollm2-135m)", "--target")


@dataclass
class Conversations:
    """The conversations read, and how each is cut and prompted."""

    data: str = knob(
        SHAREGPT, "data", "'sharegpt', a .json/.jsonl/.parquet file, a saved datasets dir or a hub dataset", "--data"
    )
    split: str = knob(
        default(read_conversations, "split"), "prep.split", "split for hub / DatasetDict sources", "--split"
    )
    max_length: int = knob(
        MAX_LENGTH, "prep.max_length", "tokens a conversation is cut to (prompt + answer)", "--max-length", type=int
    )
    system_prompt: str | None = knob(
        default(tokenize_dataset, "system_prompt"),
        "prep.system_prompt",
        "replace every conversation's system prompt with this",
        "--system-prompt",
    )


@dataclass
class Count:
    limit: int | None = knob(
        default(tokenize_dataset, "limit"),
        "prep.num_conversations",
        "stop after this many usable conversations",
        "--limit",
        type=int,
    )


@dataclass
class Vocab:
    draft_vocab_size: int = knob(
        default(tokenize_dataset, "draft_vocab_size"),
        "prep.draft_vocab_size",
        "target ids in the data's draft vocabulary map (a run may take fewer)",
        "--draft-vocab-size",
        type=int,
    )


@dataclass
class Tokenize:
    shard_tokens: int = knob(
        default(tokenize_dataset, "shard_tokens"),
        "prep.tokenized_shard_tokens",
        "tokens per shard file",
        "--shard-tokens",
        type=int,
    )
    workers: int = knob(
        default(tokenize_dataset, "workers"),
        "prep.workers",
        "processes that render and tokenize (same output)",
        "--workers",
        type=int,
    )


@dataclass
class Regenerate:
    batch_size: int = knob(
        default(regenerate, "batch_size"),
        "prep.regenerate.batch_size",
        "conversations answered together",
        "--batch-size",
        type=int,
    )
    max_new_tokens: int = knob(
        default(regenerate_batch, "max_new_tokens"),
        "prep.regenerate.max_new_tokens",
        "longest answer, in tokens",
        "--max-new-tokens",
        type=int,
    )
    temperature: float = knob(
        default(regenerate_batch, "temperature"),
        "prep.regenerate.temperature",
        "0 = greedy",
        "--temperature",
        type=float,
    )
    top_p: float = knob(
        default(regenerate_batch, "top_p"), "prep.regenerate.top_p", "nucleus sampling", "--top-p", type=float
    )
    max_turns: int | None = knob(
        default(regenerate_batch, "max_turns"),
        "prep.regenerate.max_turns",
        "regenerate at most this many assistant turns per conversation (later turns are dropped)",
        "--max-turns",
        type=int,
    )
    seed: int = knob(
        0, "prep.regenerate.seed", "torch's seed before regenerating (sampling draws from it)", "--seed", type=int
    )


@dataclass
class Distil:
    turns: int | None = knob(
        default(distil, "turns"),
        "prep.distil.turns",
        "user turns answered per conversation, each after the target's own earlier answers: a number or all "
        "(default 1; a conversation stops at the first turn without room for an answer)",
        "--turns",
        from_yaml=yaml_turns,
        type=parse_turns,
    )
    max_new_tokens: int = knob(
        default(distil, "max_new_tokens"),
        "prep.distil.max_new_tokens",
        "longest answer, in tokens",
        "--max-new-tokens",
        type=int,
    )
    batch_size: int = knob(
        default(distil, "batch_size"),
        "prep.distil.batch_size",
        "conversations answered together (one shard, the unit of resume; vllm: its max_num_seqs)",
        "--batch-size",
        type=int,
    )


@dataclass
class Engine:
    engine: str = knob(
        default(distil, "engine"),
        "prep.distil.engine",
        f"who runs the target: hf (transformers, here) or vllm (continuous batching, hidden states from the "
        f"generating forwards; needs vLLM: {INSTALL_HINT})",
        "--engine",
        choices=ENGINES,
    )


@dataclass
class Store:
    """What a hidden-state store holds, whichever command writes it."""

    aux_layer_ids: tuple[int, ...] | None = knob(
        default(capture, "aux_layer_ids"),
        "prep.capture.aux_layer_ids",
        "comma-separated hidden_states indices; default 2,N//2,N-3 (distinct ones below 7 layers)",
        "--aux-layers",
        type=parse_layers,
    )
    dtype: str = knob(
        default(capture, "dtype"), "prep.capture.dtype", "the store's dtype", "--dtype", choices=list(STORE_DTYPES)
    )


@dataclass
class Capture:
    token_budget: int = knob(
        default(capture, "token_budget"),
        "prep.capture.token_budget",
        "padded tokens per forward",
        "--token-budget",
        type=int,
    )
    shard_tokens: int = knob(
        default(capture, "shard_tokens"),
        "prep.capture.shard_tokens",
        "tokens per shard (the unit of resume)",
        "--shard-tokens",
        type=int,
    )


@dataclass
class VocabFill:
    fill_from: str | None = knob(
        None,
        "prep.vocab_fill.source",
        "conversations (sharegpt, a file, a hub dataset) whose answers rank the ids the data never uses: "
        "a small dataset's map then fills with words answers elsewhere use",
        "--fill-from",
    )
    fill_conversations: int = knob(
        20000,
        "prep.vocab_fill.conversations",
        "how many of the fill source's conversations to count",
        "--fill-conversations",
        type=int,
    )


@dataclass
class Steps:
    """`eagle-prep run`'s own keys: where its output goes and which steps run."""

    out_dir: str | None = knob(None, "out_dir", "where tokenized/ and store/ go")
    regenerate: bool = knob(False, "prep.regenerate.enabled", "the target rewrites the answers first (text path)")
    distil: bool = knob(False, "prep.distil.enabled", "the target answers and its states are stored, in one pass")
    capture: bool = knob(True, "prep.capture.enabled", "capture the tokenized data's hidden states (text path)")


SECTIONS = (Target, Conversations, Count, Vocab, Tokenize, Regenerate, Distil, Engine, Store, Capture, VocabFill, Steps)

# Every key `eagle-prep run` reads (dotted paths into the YAML) and its default. Any other key, in the file or on
# the command line, is refused: a misspelt key must not silently fall back.
RUN_KEYS = {f.metadata["key"]: f.default for section in SECTIONS for f in dataclasses.fields(section)}


def add_flags(parser, *sections) -> None:
    """The flags of the knobs of `sections` that have one, each with its default and help."""
    for section in sections:
        for f in dataclasses.fields(section):
            if f.metadata["flag"]:
                parser.add_argument(
                    f.metadata["flag"],
                    dest=f.name,
                    default=f.default,
                    help=f.metadata["help"],
                    **f.metadata["argparse"],
                )


def from_run(section, values: dict):
    """`section` read from `eagle-prep run`'s values by dotted key (`RUN_KEYS`' defaults filled in)."""
    read = {}
    for f in dataclasses.fields(section):
        value = values[f.metadata["key"]]
        read[f.name] = f.metadata["from_yaml"](value) if f.metadata["from_yaml"] else value
    return section(**read)


def knobs(*sections) -> dict:
    """The fields of section instances as keyword arguments."""
    return {k: v for s in sections for k, v in dataclasses.asdict(s).items()}
