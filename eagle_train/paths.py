"""Local path or Hugging Face Hub id: the one rule for every name a user gives (a target, a data source).

A name that can only be a path, or that a user evidently meant as one, and is not there fails at once, naming
it: asked of the Hub instead, it waits through the Hub client's retries and ends in a traceback about the
network. A name that is left to the Hub and cannot be fetched from it is one line too.
"""

from pathlib import Path

# Suffixes that make a name a file: hub ids never end in these.
FILE_SUFFIXES = (".json", ".jsonl", ".parquet", ".arrow", ".csv", ".gguf", ".safetensors", ".bin", ".pt", ".yaml")


def local_hint(name: str) -> str | None:
    """Why `name` is a local path and cannot be a hub id (what a missing one is reported with), or None
    when it may be a hub id."""
    if name.startswith(("/", ".", "~")):
        return "no such file or directory"
    suffix = Path(name).suffix.lower()
    if suffix in FILE_SUFFIXES:
        return f"no such file here; a name ending in {suffix} is a file, not a hub id"
    if name.count("/") > 1:
        return "no such directory here; a hub id would be 'org/name', with one '/'"
    first = name.split("/")[0]
    if "/" in name and Path(first).is_dir():
        return f"no such directory here; a hub id would be 'org/name' with no local '{first}/' directory"
    return None


def check_local(what: str, name: str) -> None:
    """Raise FileNotFoundError naming `name` when it is a local path (`local_hint`) that does not exist."""
    hint = local_hint(name)
    if hint is not None and not Path(name).expanduser().exists():
        raise FileNotFoundError(f"{what} {name!r} does not exist ({hint})")


def hub_error(what: str, name: str, error: Exception, local: str = "a local directory") -> FileNotFoundError:
    """The one-line error for a name only the Hub could hold and the Hub client failed to fetch: its reason is
    the client's first line (no network, no such repository, gated)."""
    reason = str(error).strip().splitlines()[0].rstrip(".") if str(error).strip() else type(error).__name__
    return FileNotFoundError(
        f"could not load {what} {name!r} from the Hugging Face Hub: {reason}; give {local}, or check the network "
        "(HF_HUB_OFFLINE=1 reads only the local Hub cache, failing at once instead of retrying)"
    )
