"""What a path a user gives for a draft head holds, and the one loader that reads every kind.

Ours: a head directory (config.json with format "eagle-train-draft" + model.safetensors), a
training checkpoint holding one under `head/`, a run directory holding one under `final/`.
Theirs: an engine-layout directory (eagle3, speculators, peagle) or llama.cpp's GGUF file. The
readers of theirs live with the writers, in `eagle_train.export`; this module depends on them and
export never imports this one.
"""

from dataclasses import dataclass
from pathlib import Path

from safetensors.torch import load_file

from eagle_train.draft_config import HEAD_FORMAT, DraftConfig
from eagle_train.export import read_export
from eagle_train.export.gguf import read_gguf_head
from eagle_train.export.layouts import detect_layout
from eagle_train.head import DraftHead, head_from_state
from eagle_train.unreadable import HEAD_FIX, check_safetensors, read_json_object

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
    if found.kind == GGUF:
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
