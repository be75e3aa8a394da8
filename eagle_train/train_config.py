"""The training run's configuration: a YAML file plus `key=value` overrides, checked before any compute.

One flat dataclass (like torchtune's recipe configs, minus the indirection): every knob a run has is a field of
`TrainConfig`, so an unknown key is a typo and is refused with the list of valid keys. The fields are the common
keys below and each method's own, which its folder's `config.py` declares and its row names (`Method.train_keys`):
`TrainConfig` composes them (`methods.with_method_keys`), so a method's key is read as `cfg.num_depths` like any
other, and this module names none of them.
"""

import contextlib
import dataclasses
import importlib.util
import math
import os
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from eagle_train import methods
from eagle_train.architectures import check_supported, text_config
from eagle_train.launch import launched_with
from eagle_train.store import HIDDEN_FORMAT, MANIFEST, check_store_matches, read_manifest, read_vocab_map
from eagle_train.vocab_map import check_draft_vocab_size

# the defaults of common keys, which the methods' own functions read too
TTT_LENGTH = 7  # EAGLE-3: unrolled draft steps; the draft model: drafts a round of its chain walk
TV_WEIGHT = 0.0  # every method: the share of total variation in each draft's loss (soft cross-entropy alone)

EVERY_OFF = {
    "save_every": "only at the end",
    "eval_every": "before and after training only",
    "log_every": "no step lines",
}
MODES = ("offline", "online")
ENGINES = ("hf", "vllm")  # online: who runs the target (engine)
LATER_EPOCHS = ("answer", "keep")  # engine=vllm: what epochs after the first read (later_epochs)
ENGINE_LAUNCHES = ("child", "external")  # engine=vllm: who starts the engine (engine_launch)
REPORT_TO = ("tensorboard", "wandb", "none")


@dataclass
class CommonTrainConfig:
    """The keys every run has, whatever its method, and what a run's config does; `TrainConfig` adds each method's
    own."""

    # what to train on
    target: str = "smollm2-135m"  # alias, local HF dir, .gguf or hub id (must be the store's target)
    data_path: str = ""  # hidden-state store (offline) or tokenized dataset (online; a store works too)
    mode: str = "offline"  # offline: hidden states from the store; online: run the target per batch
    # online: hf runs the target in every training process on a tokenized dataset; vllm has a vLLM engine answer
    # the conversations at data_path (any eagle-prep source) and feed their states through a bounded buffer
    engine: str = "hf"
    engine_options: dict = field(default_factory=dict)  # engine=vllm: passed to vllm.LLM (tensor_parallel_size...)
    engine_env: dict = field(default_factory=dict)  # engine=vllm: the engine's environment (CUDA_VISIBLE_DEVICES...)
    # engine=vllm: child, the main training process starts the engine; external, it runs apart (another node sharing
    # buffer_dir): `python -m data_prep.feed BUFFER_DIR` there
    engine_launch: str = "child"
    engine_batch_size: int = 32  # engine=vllm: conversations the engine answers together
    max_new_tokens: int = 256  # engine=vllm: the longest answer
    turns: int | None = 1  # engine=vllm: user turns answered per conversation (None: all)
    system_prompt: str | None = None  # engine=vllm: put before each conversation without one
    num_conversations: int | None = None  # engine=vllm: the first N conversations of data_path (None: all)
    buffer_dir: str = ""  # engine=vllm: the samples between engine and trainer ("": <output_dir>/buffer)
    buffer_gib: float = 4.0  # engine=vllm: the buffer's cap on disk
    # engine=vllm: answer, the engine answers every epoch again; keep, the first epoch's samples stay in the buffer
    # (the cap must hold them all) and later epochs read them again
    later_epochs: str = "answer"
    method: str = "eagle3"  # a row of eagle_train.methods.METHODS: eagle3, peagle, dflash, dspark or draft_model
    # None: offline, the store's layers; online, hidden_states.default_aux_layer_ids (2, N//2, N-3 from 7 layers)
    aux_layer_ids: list[int] | None = None
    draft_vocab_size: int | None = None  # None: the data's vocab map's; else its most frequent ids (by its counts)
    init_from: str = ""  # an eagle-train head/checkpoint dir or an engine-layout EAGLE-3 dir
    warm_start: bool = (
        False  # a new head's norm and lm_head start as the target's (eagle_train.warm_start; not P-EAGLE)
    )
    # the objective (each method's own keys: its folder's config.py)
    ttt_length: int = TTT_LENGTH  # EAGLE-3: unrolled draft steps; the draft model: drafts a round of its chain walk
    tv_weight: float = TV_WEIGHT  # each draft's loss is (1 - w) soft CE + w total variation (every method)
    # EAGLE-3, DFlash, DSpark: noise on the training batches' target hidden states, times each layer's RMS
    # (training_parts.noisy_features)
    feature_noise: float = 0.0
    draft_num_layers: int | None = None  # the head's layers; None: its method's default for the target's size
    # the mask slots' token (P-EAGLE, DFlash, DSpark); None: a spare special token the data never uses
    mask_token_id: int | None = None
    # batching (per process): padded tokens per micro-batch; samples longer than max_length are truncated
    max_length: int | None = None  # None: the data's (the max_length it was prepared with)
    tokens_per_batch: int = 8192
    gradient_accumulation_steps: int = 1
    eval_fraction: float = 0.02  # held-out share of the samples
    num_workers: int = 0
    # optimisation
    num_epochs: int = 1
    max_steps: int = 0  # > 0 overrides num_epochs
    learning_rate: float = 1e-4
    min_lr_ratio: float = 0.0  # cosine decays to learning_rate * min_lr_ratio
    warmup_steps: int = 0
    weight_decay: float = 0.0
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    max_grad_norm: float = 0.5
    mixed_precision: str = "auto"  # auto: bf16 on CUDA and CPUs with bf16 instructions, else fp32; or "no" / "bf16"
    seed: int = 0
    # output
    output_dir: str = "runs/eagle3"
    save_every: int = 0  # steps; 0: only at the end
    keep_checkpoints: int = 2
    eval_every: int = 0  # steps; 0: before training and at the end only
    log_every: int = 10
    report_to: str = "tensorboard"  # falls back to none when tensorboard is not installed
    run_name: str = ""
    resume: str = ""  # "", "auto" (latest checkpoint in output_dir) or a checkpoint dir
    stop_after_step: int = 0  # > 0: checkpoint and exit after that step (a job's time slice); resume=auto goes on

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def train_config_class() -> type:
    """`TrainConfig` as the rows stand: the common keys and every method's own (a row registered later, as
    tests/test_methods.py registers one, composes it again)."""
    return methods.with_method_keys("TrainConfig", CommonTrainConfig, lambda method: method.train_keys)


TrainConfig = train_config_class()


def runs_the_target(cfg: TrainConfig) -> bool:
    """Whether each training process runs the target (online with engine=hf); else the data holds the states."""
    return cfg.mode == "online" and cfg.engine == "hf"


def field_names() -> list[str]:
    return [f.name for f in dataclasses.fields(TrainConfig)]


def keys_by_method() -> dict[str, list[str]]:
    """The keys under the methods they belong to, for --help: the common ones, then each key class's
    under the methods whose rows name it ("dflash, dspark")."""
    listing = {"common": [f.name for f in dataclasses.fields(CommonTrainConfig)]}
    for keys, names in methods.key_classes(lambda method: method.train_keys).items():
        listing[", ".join(names)] = [f.name for f in dataclasses.fields(keys)]
    return listing


def _as_type(value, annotation):
    """`value` as `annotation` (int, float, bool, str, list[...] or X | None); TypeError when it is not one."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null", "")):
            return None
        (annotation,) = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is list:
        (item,) = typing.get_args(annotation)
        if isinstance(value, str):  # "2,15,27" from a shell
            value = [v for v in value.strip("[]").split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise TypeError
        return [_as_type(v, item) for v in value]
    if annotation is bool:
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        if not isinstance(value, bool):
            raise TypeError
        return value
    if annotation is str and isinstance(value, bool):  # YAML reads mixed_precision=no (or off) as False
        return "yes" if value else "no"
    if annotation is dict:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise TypeError
        return dict(value)
    if isinstance(value, bool) or isinstance(value, (dict, list)):
        raise TypeError
    if annotation is int:
        if isinstance(value, float) and not value.is_integer():
            raise TypeError
        return int(value)
    if annotation is float:
        return float(value)  # YAML reads "1e-4" as a string
    return str(value)


def _coerce(name: str, value, annotation):
    try:
        return _as_type(value, annotation)
    except (TypeError, ValueError):
        kind = str(annotation).replace("<class '", "").replace("'>", "")
        raise ValueError(f"config key {name!r} expects {kind}, got {value!r}") from None


def make_config(values: dict) -> TrainConfig:
    names = field_names()
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise ValueError(f"unknown config key(s) {unknown}; valid keys: {', '.join(names)}")
    hints = typing.get_type_hints(TrainConfig)
    return TrainConfig(**{k: _coerce(k, v, hints[k]) for k, v in values.items()})


def parse_overrides(overrides: list[str]) -> dict:
    """`key=value` strings -> dict; values are parsed as YAML scalars/lists
    (`ttt_length=5`, `aux_layer_ids=[2,15,27]`)."""
    out = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r} is not key=value (e.g. learning_rate=3e-4)")
        try:
            out[key.strip()] = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            out[key.strip()] = raw
    return out


def load_train_config(
    path: str | Path | None = None, overrides: list[str] = (), defaults: dict | None = None
) -> TrainConfig:
    """`defaults`, then the YAML file at `path` (optional), then `overrides` on top."""
    values = dict(defaults or {})
    if path:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"config file {path} does not exist")
        in_file = yaml.safe_load(path.read_text()) or {}
        if not isinstance(in_file, dict):
            raise ValueError(f"{path} must hold a mapping of config keys, not {type(in_file).__name__}")
        values.update(in_file)
    values.update(parse_overrides(list(overrides)))
    return from_data(make_config(values))


def from_data(cfg: TrainConfig) -> TrainConfig:
    """`cfg` with the keys it leaves to the data (None) taken from the data at `data_path`: `max_length` (the
    one the data was prepared with), `draft_vocab_size` (its vocab map's, the whole vocabulary where its method's row
    says a new head drafts over it (`Method.whole_vocabulary`), unless `init_from` brings one) and,
    offline, `aux_layer_ids` (the store's layers). A value the data contradicts is refused: offline, aux layers
    the store does not hold. A shorter `max_length` is no contradiction: it truncates the longer samples, as
    asked. Without data at `data_path`, `cfg` as it is (`validate` names the missing path)."""
    if not cfg.data_path or not (Path(cfg.data_path) / MANIFEST).is_file():
        return cfg
    manifest = read_manifest(cfg.data_path)
    values = {}
    if cfg.max_length is None:
        if "max_length" not in manifest:
            raise ValueError(f"{cfg.data_path} does not record the max_length it was prepared with: set max_length")
        values["max_length"] = manifest["max_length"]
    if cfg.draft_vocab_size is None and not cfg.init_from:  # a head to start from brings its own vocab map
        vocab_map = read_vocab_map(cfg.data_path)  # t2d spans the target's vocabulary, d2t the draft vocabulary
        whole = methods.method_of(cfg).whole_vocabulary
        values["draft_vocab_size"] = len(vocab_map["t2d" if whole and whole(cfg) else "d2t"])
    if not runs_the_target(cfg) and manifest["format"] == HIDDEN_FORMAT:
        held = list(manifest["aux_layer_ids"])
        if cfg.aux_layer_ids is None:
            values["aux_layer_ids"] = held
        elif list(cfg.aux_layer_ids) != held:
            raise ValueError(
                f"aux_layer_ids={cfg.aux_layer_ids} but the store at {cfg.data_path} holds aux layers {held}: "
                "leave aux_layer_ids unset to train on the store's, train with mode=online, or capture a store "
                f"with --aux-layers {','.join(map(str, cfg.aux_layer_ids))}"
            )
    return dataclasses.replace(cfg, **values)


@contextlib.contextmanager
def one_line_refusals():
    """In a training script, a refusal (ValueError: a bad config, broken data, a run that diverged; OSError: a
    missing path, a directory it may not write, a full disk) ends the process with `error: ...` and exit status
    1: one line, never a traceback."""
    try:
        yield
    except (ValueError, OSError) as e:
        sys.exit(f"error: {e}")


def validate(cfg: TrainConfig, target_config) -> None:
    """Every check that needs no compute: raise ValueError/FileNotFoundError naming the fix.

    `target_config` is the target's HF config (`eagle_train.target.load_target_config`).
    """
    check_supported(target_config, "training")

    def need(ok, message):
        if not ok:
            raise ValueError(message)

    need(cfg.mode in MODES, f"mode {cfg.mode!r} is not one of {MODES}")
    need(cfg.engine in ENGINES, f"engine {cfg.engine!r} is not one of {ENGINES}")
    need(
        cfg.engine == "hf" or cfg.mode == "online",
        f"engine={cfg.engine} makes the hidden states online: set mode=online (offline reads a store)",
    )
    need(cfg.later_epochs in LATER_EPOCHS, f"later_epochs {cfg.later_epochs!r} is not one of {LATER_EPOCHS}")
    need(cfg.engine_launch in ENGINE_LAUNCHES, f"engine_launch {cfg.engine_launch!r} is not one of {ENGINE_LAUNCHES}")
    need(cfg.report_to in REPORT_TO, f"report_to {cfg.report_to!r} is not one of {REPORT_TO}")
    need(
        cfg.report_to != "wandb" or importlib.util.find_spec("wandb") is not None,
        "report_to=wandb needs the wandb package (pip install wandb); or use report_to=tensorboard or none",
    )
    need(
        cfg.mixed_precision in ("auto", "no", "bf16"),
        f"mixed_precision {cfg.mixed_precision!r} is not auto, no or bf16",
    )
    need(cfg.ttt_length >= 1, f"ttt_length must be >= 1 (the number of unrolled draft steps), got {cfg.ttt_length}")
    need(0 <= cfg.tv_weight <= 1, f"tv_weight must be in [0, 1] (the share of total variation), got {cfg.tv_weight}")
    need(
        cfg.draft_num_layers is None or cfg.draft_num_layers >= 1,
        f"draft_num_layers must be >= 1 (or null for the default), got {cfg.draft_num_layers}",
    )
    vocab = text_config(target_config).vocab_size
    need(
        cfg.mask_token_id is None or 0 <= cfg.mask_token_id < vocab,
        f"mask_token_id {cfg.mask_token_id} is outside the target vocabulary [0, {vocab}); "
        "leave it null to pick a spare special token",
    )
    need(cfg.gradient_accumulation_steps >= 1, "gradient_accumulation_steps must be >= 1")
    need(
        cfg.gradient_accumulation_steps == 1 or not launched_with("DEEPSPEED"),
        "DeepSpeed steps its optimizer inside every backward: use gradient_accumulation_steps=1 "
        "(raise tokens_per_batch or the process count instead), or DDP/FSDP",
    )
    need(cfg.stop_after_step >= 0, f"stop_after_step must be >= 0 (0: run to the end), got {cfg.stop_after_step}")
    need(0 <= cfg.eval_fraction < 1, f"eval_fraction must be in [0, 1), got {cfg.eval_fraction}")
    need(0 < cfg.learning_rate < math.inf, f"learning_rate must be a number > 0, got {cfg.learning_rate}")
    need(cfg.feature_noise >= 0, f"feature_noise must be >= 0 (0: none), got {cfg.feature_noise}")
    need(cfg.weight_decay >= 0, f"weight_decay must be >= 0, got {cfg.weight_decay}")
    need(cfg.warmup_steps >= 0, f"warmup_steps must be >= 0 (0: no warmup), got {cfg.warmup_steps}")
    need(cfg.max_steps >= 0, f"max_steps must be >= 0 (0: run num_epochs), got {cfg.max_steps}")
    for key in ("save_every", "eval_every", "log_every"):
        need(getattr(cfg, key) >= 0, f"{key} must be >= 0 (0: {EVERY_OFF[key]}), got {getattr(cfg, key)}")
    need(
        cfg.num_workers >= 0,
        f"num_workers must be >= 0 (0: load batches in the training process), got {cfg.num_workers}",
    )
    need(0 <= cfg.min_lr_ratio <= 1, f"min_lr_ratio must be in [0, 1], got {cfg.min_lr_ratio}")
    need(
        len(cfg.adam_betas) == 2 and all(0 <= b < 1 for b in cfg.adam_betas),
        f"adam_betas must be two numbers in [0, 1), got {cfg.adam_betas}",
    )
    need(cfg.max_grad_norm >= 0, "max_grad_norm must be >= 0 (0 disables clipping)")
    need(cfg.num_epochs >= 1, f"num_epochs must be >= 1 (max_steps > 0 overrides it), got {cfg.num_epochs}")
    need(cfg.keep_checkpoints >= 1, f"keep_checkpoints must be >= 1, got {cfg.keep_checkpoints}")
    need(
        not cfg.warm_start or not cfg.init_from,
        "warm_start starts a new head from the target's norm and lm_head: not with init_from (that head brings "
        "its own)",
    )
    output_dir = Path(cfg.output_dir).absolute()
    writable = next(p for p in (output_dir, *output_dir.parents) if p.exists())
    need(
        writable.is_dir() and os.access(writable, os.W_OK | os.X_OK),
        f"output_dir {cfg.output_dir} cannot be written: {writable} is not a directory this user may write; "
        "choose another output_dir",
    )
    # the data, after the keys a config alone decides
    if not cfg.data_path:
        raise ValueError(
            "data_path is not set: point it at a store from `eagle-prep capture` (offline) "
            "or a tokenized dataset from `eagle-prep tokenize` (online)"
        )
    if not Path(cfg.data_path).exists() and cfg.engine == "hf":
        raise FileNotFoundError(
            f"data_path {cfg.data_path} does not exist: run `eagle-prep run --config ...` first or fix the path"
        )
    if cfg.engine == "vllm" and not (Path(cfg.data_path) / MANIFEST).is_file():
        return  # conversations, which the engine's feed (data_prep.feed) reads and checks
    from_data(cfg)  # its refusals, for a config made without load_train_config
    need(cfg.max_length is not None, "max_length is unset: load_train_config takes the data's, or set it")
    need(cfg.max_length >= 4, f"max_length must be >= 4 tokens, got {cfg.max_length}")
    need(
        cfg.tokens_per_batch >= cfg.max_length,
        f"tokens_per_batch {cfg.tokens_per_batch} is smaller than max_length {cfg.max_length}: a longest sample "
        "would not fit a micro-batch; raise tokens_per_batch or lower max_length",
    )
    manifest = read_manifest(cfg.data_path)
    if cfg.mode == "offline" and manifest["format"] != HIDDEN_FORMAT:
        raise ValueError(
            f"{cfg.data_path} is a tokenized dataset without hidden states: train with mode=online, "
            "or capture a store with `eagle-prep capture` for mode=offline"
        )
    if manifest["format"] == HIDDEN_FORMAT:
        check_store_matches(manifest, target_config, cfg.aux_layer_ids)
    else:
        check_store_matches(manifest, target_config)
    n = target_config.num_hidden_layers
    if cfg.aux_layer_ids is not None:
        need(
            len(cfg.aux_layer_ids) == 3 and all(0 <= i < n for i in cfg.aux_layer_ids),
            f"aux_layer_ids must be three layer indices in [0, {n - 1}], got {cfg.aux_layer_ids}",
        )
    if cfg.draft_vocab_size is not None:
        check_draft_vocab_size(cfg.draft_vocab_size, vocab, " (or leave it unset to take the vocab map's size)")
    if not cfg.init_from:
        v = len(read_vocab_map(cfg.data_path)["t2d"])
        need(v == vocab, f"{cfg.data_path}/vocab_map.safetensors covers a vocabulary of {v}, the target has {vocab}")
    elif not Path(cfg.init_from).exists():
        raise FileNotFoundError(f"init_from {cfg.init_from} does not exist")
    if cfg.resume not in ("", "auto") and not Path(cfg.resume).is_dir():
        raise FileNotFoundError(
            f"resume checkpoint {cfg.resume} does not exist (use resume=auto for the latest "
            f"in output_dir, or a checkpoint-<step> dir)"
        )
