"""What a path a user gives for a draft head holds, and the one loader that reads every kind.

Ours: a head directory (config.json with format "eagle-train-draft" + model.safetensors), a
training checkpoint holding one under `head/`, a run directory holding one under `final/`.
Theirs: an engine-layout directory (eagle3, speculators, peagle) or llama.cpp's GGUF file. The
readers of theirs live with the writers, in `eagle_train.export`; this module depends on them and
export never imports this one. Every reader ends in `head_from_state`, which builds the head class the method's
row names: it lives here, not in eagle_train.head, which every head class imports.
"""

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from eagle_train.draft_config import HEAD_FORMAT, DraftConfig
from eagle_train.export import read_export
from eagle_train.export.gguf import ARCHS, gguf_arch, read_gguf_head
from eagle_train.export.layouts import detect_layout
from eagle_train.head import DraftHead, non_finite_values
from eagle_train.methods import row
from eagle_train.target import resolve_target
from eagle_train.unreadable import HEAD_FIX, check_safetensors, read_json_object
from eagle_train.vocab_map import t2d_from_d2t

HEAD, TRAINING_CHECKPOINT, RUN, GGUF = "head", "training-checkpoint", "run", "gguf"


@dataclass(frozen=True)
class HeadLocation:
    """Where a head is: `kind` is HEAD, TRAINING_CHECKPOINT, RUN (ours), GGUF, or the name of the
    engine layout a directory is in; `path` is the head directory itself (`head/` of a checkpoint,
    `final/` of a run) or the GGUF file; `config` its config.json (None for GGUF)."""

    kind: str
    path: Path
    config: dict | None

    @property
    def ours(self) -> bool:
        return self.kind in (HEAD, TRAINING_CHECKPOINT, RUN)


def locate_head(path) -> HeadLocation:
    """Say what `path` is: the one place that tells our checkpoints from exports."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"draft head {path} does not exist")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{path} is a file but not a .gguf draft head")
        return HeadLocation(GGUF, path, None)
    for kind, directory in ((TRAINING_CHECKPOINT, path / "head"), (RUN, path / "final"), (HEAD, path)):
        if (directory / "config.json").exists():
            config = read_json_object(directory / "config.json", "head config", HEAD_FIX)
            if config.get("format") != HEAD_FORMAT:
                kind = detect_layout(config).name
            return HeadLocation(kind, directory, config)
    raise FileNotFoundError(
        f"{path} holds no config.json (neither a head, a training checkpoint, a run directory nor an export)"
    )


def load_draft_head(path, target_model=None, target_config=None) -> DraftHead:
    """The head stored at `path` (any kind `locate_head` knows), in fp32, sharing `target_model`'s
    embedding when the head has none of its own (and its lm_head when the head drafts through the target's).
    The target (model or config) is needed for a GGUF file and for an export whose config.json does not say
    which target layers the head reads."""
    found = locate_head(path)
    if target_model is not None and target_config is None:
        target_config = target_model.config
    if found.kind == GGUF and gguf_arch(found.path) not in ARCHS:  # a draft model: the model transformers reads in it
        cfg, state = read_export(resolve_target(str(found.path)), target_config)
    elif found.kind == GGUF:
        if target_config is None:
            raise ValueError(f"{path}: a GGUF head does not record the target's layer count; pass the target")
        cfg, state = read_gguf_head(found.path, target_config)
    elif found.ours:
        check_safetensors(found.path / "model.safetensors", "head weights", HEAD_FIX)
        cfg, state = DraftConfig.from_dict(found.config), load_file(found.path / "model.safetensors")
    else:
        cfg, state = read_export(found.path, target_config)
    embedding = target_model.get_input_embeddings().weight if target_model is not None else None
    borrows_lm_head = target_model is not None and cfg.block_lm_head == "target"
    lm_head = target_model.get_output_embeddings().weight if borrows_lm_head else None
    return head_from_state(cfg, state, embedding, source=found.path, target_lm_head=lm_head)


def shape_mismatch(cfg: DraftConfig, name: str, got: list[int], want: list[int], source: str) -> str:
    """Why a tensor's shape is not the one the config implies; for fc, how many target layers each side reads."""
    width = cfg.target_hidden_size
    if name == "fc.weight" and got[0] == want[0] and got[1] % width == 0:
        return (
            f"{source}: fc.weight reads {got[1] // width} target layers of {width}, the config {cfg.num_aux} (aux "
            f"layer ids {list(cfg.aux_layer_ids)}, stated in config.json or, where it states none, its reader's "
            "defaults): state the target layers the head was trained on in config.json"
        )
    return f"{source}: {name} is {got}, config.json implies {want}: config.json and the weights disagree"


def head_from_state(
    cfg: DraftConfig, state: dict[str, torch.Tensor], target_embedding=None, source="", target_lm_head=None
) -> DraftHead:
    """The head of `cfg.method` holding `state` (head tensor names), in fp32.

    Every reader ends here: our checkpoints, engine layouts and GGUF files. `t2d` follows from
    `d2t` when absent, and a full-vocabulary head without `d2t` gets the identity map. An embedding
    in `state` that the head class does not save is the head's own (a head trained elsewhere with its
    own); otherwise a borrowing head takes `target_embedding` (the target's), when given. A head that
    `borrows_lm_head` takes `target_lm_head` (the target's), else a copy of it that `state` carries.
    A head holding nan or inf anywhere is refused: it diverged or was trained on broken data.
    """
    head = row(cfg.method).head_class(cfg)
    state = dict(state)
    expected = head.saved_state_dict()
    own_embedding = None if "embed_tokens.weight" in expected else state.pop("embed_tokens.weight", None)
    shipped_lm_head = state.pop("lm_head.weight", None) if head.borrows_lm_head else None
    if "d2t" not in state and cfg.draft_vocab_size == cfg.vocab_size:
        state["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
    missing = sorted(set(expected) - set(state) - {"t2d"})
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{source}: missing tensors {missing}, tensors this head does not have {unexpected}")
    for name, t in state.items():
        if tuple(t.shape) != tuple(expected[name].shape):
            raise ValueError(shape_mismatch(cfg, name, list(t.shape), list(expected[name].shape), source))
        if name == "d2t" and t.is_floating_point():
            raise ValueError(f"{source}: d2t is {t.dtype}; offsets must be integers (re-export it as int64)")
    bad = non_finite_values(state)
    if bad:
        raise ValueError(
            f"{source} holds non-finite values ({bad}): this head was trained on broken data or diverged; "
            "do not deploy it"
        )
    if "t2d" not in state:
        state["t2d"] = t2d_from_d2t(state["d2t"].long(), cfg.vocab_size)
    head.load_state_dict(
        {k: v.long() if k == "d2t" else v.bool() if k == "t2d" else v.float() for k, v in state.items()}, strict=False
    )
    if own_embedding is not None:
        head.attach_embedding(own_embedding, own=True)
    elif target_embedding is not None and not head.owns_embedding:
        head.attach_embedding(target_embedding)
    lm_head = target_lm_head if target_lm_head is not None else shipped_lm_head
    if head.borrows_lm_head and lm_head is not None:
        head.attach_lm_head(lm_head if target_lm_head is not None else lm_head.float())
    return head
