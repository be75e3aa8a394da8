"""Every file the toolkit writes goes through here: atomically (a temp file renamed over the target, so a kill
never leaves half a file or a truncated JSON) and with the mode any new file gets under the process umask
(safetensors creates its files readable by their owner only, so a colleague's `vllm serve` could not read a head
written in a team directory)."""

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


FILE_MODE = 0o666 & ~_umask()  # read once, at import: changing the umask is not thread-safe


def _write(path: str | Path, write) -> Path:
    """`write(temp path)`, then the temp file gets FILE_MODE and replaces `path`."""
    path = Path(path)
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    write(tmp)
    os.chmod(tmp, FILE_MODE)
    os.replace(tmp, path)
    return path


def write_safetensors(path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict | None = None) -> Path:
    return _write(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))


def write_text(path: str | Path, text: str) -> Path:
    return _write(path, lambda tmp: tmp.write_text(text))


def write_json(path: str | Path, obj, indent: int = 2) -> Path:
    return write_text(path, json.dumps(obj, indent=indent) + "\n")


def share_directory(directory: str | Path) -> None:
    """Give every file under `directory` (written by another library, e.g. transformers' save_pretrained) the
    mode a new file gets."""
    for path in Path(directory).rglob("*"):
        if path.is_file():
            os.chmod(path, FILE_MODE)
