"""Loading a draft head from whatever directory a user points at.

A head directory (config.json with format "eagle-train-draft" + model.safetensors), a training
checkpoint that contains one under `head/`, or an engine-layout export (EAGLE-3 reference or
speculators), which `eagle_train.export` imports in memory.
"""

import json
from pathlib import Path

from eagle_train.draft_config import DraftConfig
from eagle_train.export import import_head
from eagle_train.export.layouts import HEAD_CLASSES


def head_directory(path) -> Path:
    """The directory holding the head's config.json + model.safetensors inside `path`."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"draft head {path} does not exist")
    if (path / "head" / "config.json").exists():
        return path / "head"
    if (path / "config.json").exists():
        return path
    raise FileNotFoundError(f"{path} holds no config.json (neither a head, a training checkpoint nor an export)")


def load_draft_head(path, target_model=None):
    """The head stored at `path`, sharing `target_model`'s embedding when the head does not own one."""
    directory = head_directory(path)
    with open(directory / "config.json") as f:
        fmt = json.load(f).get("format")
    if fmt == "eagle-train-draft":
        method = DraftConfig.load(directory).method
        return HEAD_CLASSES[method].from_pretrained(directory, target_model=target_model)
    return import_head(directory, target_model=target_model)  # engine layouts
