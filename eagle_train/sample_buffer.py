"""A bounded directory of training samples between the process that makes them (a serving engine answering
prompts, engines/) and the trainer that reads them, in place of a store: its bytes never pass a cap.

Sample i is one safetensors file, `{i:09d}.safetensors`, written whole under a temporary name and renamed, so a
reader never sees part of one, on one node or on storage several nodes share. The writer waits while the samples
on disk and the next one would pass `cap_bytes`; the reader waits for the sample it reads next and removes it once
read. Both ask `alive()` of the other side while they wait: a side that died stops the other with its reason, never
a hang. The writer's waits and the peak bytes on disk go to `writer.json`, so the reader can say which side holds
the other back.

    buffer = SampleBuffer("runs/x/buffer", cap_bytes=8 << 30)
    buffer.put(i, {"input_ids": ..., "loss_mask": ..., "aux_hidden": ..., "final_hidden": ...})   # the engine
    sample = buffer.get(i)                                                                          # the trainer
"""

import copy
import errno
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load, save

from eagle_train.files import write_json

SUFFIX = ".safetensors"
WRITER_STATS = "writer.json"


class BufferStopped(ChildProcessError):
    """The other side of the buffer died or stopped: its reason, in one line (an OSError, so a training script says it
    in one line: `train_config.one_line_refusals`)."""


def sample_name(index: int) -> str:
    return f"{index:09d}{SUFFIX}"


def sample_bytes_bound(max_length: int, widths: dict[str, int], dtypes: dict[str, torch.dtype]) -> int:
    """The bytes of the largest sample of `max_length` tokens: per key its row width and dtype (e.g. aux_hidden 3H
    bf16, input_ids 1 int64), plus the safetensors header. A cap below it could stop a run mid-way."""
    rows = sum(widths[key] * torch.empty((), dtype=dtypes[key]).element_size() for key in widths)
    return max_length * rows + 4096


def check_cap(directory: str | Path, cap_bytes: int, largest_sample: int) -> None:
    """One line before any compute: a cap that cannot hold the largest sample, or a disk without room for the cap."""
    if cap_bytes < largest_sample:
        raise ValueError(
            f"the buffer cap of {cap_bytes / 2**20:.1f} MiB is below one sample of the longest length "
            f"({largest_sample / 2**20:.1f} MiB): raise it or lower max_length"
        )
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(directory).free + SampleBuffer(directory, cap_bytes).used_bytes()
    if free < cap_bytes:
        raise ValueError(
            f"the buffer cap is {cap_bytes / 2**30:.2f} GiB but {directory} has {free / 2**30:.2f} GiB free: free "
            "space or lower the cap"
        )


def still_running() -> str | None:
    return None


class SampleBuffer:
    def __init__(self, directory: str | Path, cap_bytes: int, poll_seconds: float = 0.05):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.cap_bytes = cap_bytes
        self.poll_seconds = poll_seconds
        self.stats = {"put": 0, "put_wait_seconds": 0.0, "peak_bytes": 0, "get": 0, "get_wait_seconds": 0.0}
        self.started = time.perf_counter()

    def samples(self) -> dict[int, Path]:
        """The whole samples on disk, by index."""
        return {int(p.name[: -len(SUFFIX)]): p for p in self.directory.glob(f"[0-9]*{SUFFIX}")}

    def used_bytes(self) -> int:
        """The bytes of the samples on disk (one the reader removes meanwhile counts as gone)."""
        total = 0
        for path in self.samples().values():
            try:
                total += path.stat().st_size
            except FileNotFoundError:
                pass
        return total

    def put(self, index: int, sample: dict[str, torch.Tensor], alive: Callable[[], str | None] = still_running):
        """Write sample `index` once the buffer has room for it (at once if it is on disk already: a writer that
        restarted)."""
        path = self.directory / sample_name(index)
        if path.exists():
            return
        data = save({k: v.contiguous() for k, v in sample.items()})
        if len(data) > self.cap_bytes:
            raise ValueError(
                f"sample {index} is {len(data) / 2**20:.1f} MiB, over the buffer cap of "
                f"{self.cap_bytes / 2**20:.1f} MiB: raise the cap"
            )
        start = time.perf_counter()
        while self.used_bytes() + len(data) > self.cap_bytes:
            stopped = alive()
            if stopped:
                raise BufferStopped(stopped)
            time.sleep(self.poll_seconds)
        self.stats["put_wait_seconds"] += time.perf_counter() - start
        tmp = self.directory / f".tmp-{os.getpid()}-{path.name}"
        try:
            tmp.write_bytes(data)
            os.replace(tmp, path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            if e.errno == errno.ENOSPC:
                raise OSError(f"the disk of the buffer {self.directory} is full: free space or lower the cap") from e
            raise
        self.stats["put"] += 1
        self.stats["seconds"] = time.perf_counter() - self.started
        self.stats["peak_bytes"] = max(self.stats["peak_bytes"], self.used_bytes())
        write_json(self.directory / WRITER_STATS, self.stats)

    def get(
        self, index: int, alive: Callable[[], str | None] = still_running, keep: bool = False
    ) -> dict[str, torch.Tensor]:
        """Sample `index`, once it is on disk; it is removed once read, unless `keep` (a sample read again later)."""
        path = self.directory / sample_name(index)
        start = time.perf_counter()
        while not path.exists():
            stopped = alive()
            if stopped and not path.exists():
                raise BufferStopped(stopped)
            time.sleep(self.poll_seconds)
        self.stats["get_wait_seconds"] += time.perf_counter() - start
        sample = load(path.read_bytes())
        if not keep:
            path.unlink()
        self.stats["get"] += 1
        return sample

    def drop_all_but(self, wanted: set[int]) -> int:
        """Remove the samples no reader will read: on resume, those used before the checkpoint (what a writer wrote
        ahead of it stays); returns how many went."""
        gone = [p for i, p in self.samples().items() if i not in wanted]
        for p in gone:
            p.unlink(missing_ok=True)
        return len(gone)

    def writer_stats(self) -> dict:
        """The writer's counters (its own process's, read from disk): put, put_wait_seconds, peak_bytes, seconds
        (from its start to its last sample), and error when it failed."""
        path = self.directory / WRITER_STATS
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return {}

    def bottleneck(self) -> str:
        """Which side holds the other back: the engine when the trainer waits on it longer than it waits for room."""
        writer_wait = self.writer_stats().get("put_wait_seconds", 0.0)
        return "engine" if self.stats["get_wait_seconds"] > writer_wait else "trainer"


def held_out(epoch: int) -> bool:
    return epoch < 0


class BufferedSamples:
    """The trainer's samples as an engine writes them to a `SampleBuffer`, in place of a store's
    (`eagle_train.store.ShardedSamples`): `len`, `lengths()` (upper bounds: prompt and answers, within max_length,
    which is what the micro-batches are cut by) and `[i]` in float32.

    The engine must write in the order the trainer reads, or a full buffer would stop both. The trainer says that
    order with `begin(order, position, main)`: (epoch, sample) pairs, epoch -1 for the held-out samples (written
    first and kept, since every eval reads them again), and where a resumed run starts. Epoch e's copy of sample i
    is its own file (`later_epochs="answer"`: the engine answers again), or with `keep` the first epoch's copy is
    kept and read again; `for_epoch(e)` reads epoch e's. `start_writer(keys, samples)` (main process only) starts
    the engine writing those buffer keys, the sample of each; `writer_alive()` is None while it works, else why it
    stopped, in one line.
    """

    def __init__(
        self,
        directory: str | Path,
        cap_bytes: int,
        lengths: list[int],
        keep: bool,
        start_writer: Callable[[list[int], list[int]], None],
        writer_alive: Callable[[], str | None],
    ):
        self.buffer = SampleBuffer(directory, cap_bytes)
        self._lengths = list(lengths)
        self.keep = keep
        self.start_writer, self.writer_alive = start_writer, writer_alive
        self.held_out: set[int] = set()
        self.epoch = 0

    def __len__(self) -> int:
        return len(self._lengths)

    def lengths(self) -> list[int]:
        return self._lengths

    def key(self, epoch: int, i: int) -> int:
        """The buffer index of epoch `epoch`'s copy of sample i."""
        return i if held_out(epoch) or self.keep else (epoch + 1) * len(self) + i

    def begin(self, order: list[tuple[int, int]], position: int, main: bool) -> None:
        """Start the engine on `order[position:]` (each key once, but those on disk already: a resumed run's engine
        wrote them ahead), after the held-out samples, and remove what no read will want: samples a resumed run read
        before its checkpoint, or that another process count reads no more."""
        self.held_out = {i for e, i in order if held_out(e)}
        self.buffer.started = time.perf_counter()  # the trainer's rate counts from here on
        if not main:
            return
        # with keep the samples of the whole run are kept: the engine writes those missing, each once
        reads = order if self.keep else [r for r in order if held_out(r[0])] + order[position:]
        wanted = {}  # buffer key -> sample, in the order of their first read
        for e, i in reads:
            wanted.setdefault(self.key(e, i), i)
        self.buffer.drop_all_but(set(wanted))
        on_disk = self.buffer.samples()  # before any read: one read meanwhile must not be written again
        todo = [key for key in wanted if key not in on_disk]
        self.start_writer(todo, [wanted[key] for key in todo])

    def for_epoch(self, epoch: int) -> "BufferedSamples":
        view = copy.copy(self)
        view.epoch = epoch
        return view

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        kept = i in self.held_out or self.keep
        key = self.key(-1 if i in self.held_out else self.epoch, i)
        sample = self.buffer.get(key, self.writer_alive, keep=kept)
        item = {"input_ids": sample["input_ids"].to(torch.int64), "loss_mask": sample["loss_mask"].to(torch.bool)}
        for name in ("aux_hidden", "final_hidden"):
            item[name] = sample[name].float()
        return item

    def status(self) -> str:
        """Both sides' rates while they work (not waiting on the other), which holds the other back and the peak
        bytes on disk, for the progress lines."""
        made, read = self.buffer.writer_stats(), self.buffer.stats
        engine_busy = made.get("seconds", 0.0) - made.get("put_wait_seconds", 0.0)
        trainer_busy = time.perf_counter() - self.buffer.started - read["get_wait_seconds"]
        return (
            f"engine {made.get('put', 0) / max(engine_busy, 1e-9):.2f} samples/s, trainer "
            f"{read['get'] / max(trainer_busy, 1e-9):.2f} samples/s: {self.buffer.bottleneck()}-bound | buffer peak "
            f"{made.get('peak_bytes', 0) / 2**20:.0f} MiB"
        )
