"""Files read whole by the toolkit that may have been cut short (a copy interrupted, a full disk) or damaged: the
failure is one line naming the file and the fix, not the reading library's traceback about a header or a shape."""

import functools
import json
from pathlib import Path

from safetensors import SafetensorError, safe_open

HEAD_FIX = "copy it again from where it was written, or write it again"


def unreadable(path, what: str, error: Exception, fix: str) -> ValueError:
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return ValueError(f"{path} ({what}) is unreadable (truncated or damaged: {reason}): {fix}")


def check_safetensors(path: str | Path, what: str, fix: str) -> None:
    """Open `path`'s header: safetensors checks there that the tensors it lists cover the file exactly."""
    try:
        with safe_open(str(path), "pt"):
            pass
    except SafetensorError as e:
        raise unreadable(path, what, e, fix) from e


def read_json_object(path: str | Path, what: str, fix: str) -> dict:
    """A JSON file that must hold an object (a config, an index, a manifest)."""
    try:
        found = json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise unreadable(path, what, e, fix) from None
    if not isinstance(found, dict):
        raise unreadable(path, what, ValueError(f"a JSON {type(found).__name__}, not an object"), fix)
    return found


def open_gguf(path: str | Path, what: str, fix: str):
    """A GGUFReader of `path`, shared while the file stays as it is: parsing a tokenizer's hundred thousand strings
    takes seconds, and a check reads the target's file and the draft's several times. A file cut short fails in the
    parser as an IndexError or a reshape ValueError."""
    stat = Path(path).stat()
    try:
        return gguf_reader(str(Path(path).resolve()), (stat.st_ino, stat.st_size, stat.st_mtime_ns))
    except (ValueError, IndexError, KeyError) as e:
        raise unreadable(path, what, e, fix) from e


@functools.lru_cache(maxsize=2)  # a target's file and a draft's
def gguf_reader(path: str, version: tuple):
    """A read-only GGUFReader, once per file `version` (inode, size, modification time)."""
    from gguf import GGUFReader

    return GGUFReader(path)
