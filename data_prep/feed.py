"""Online training fed by a serving engine (`mode=online engine=vllm`): a vLLM engine answers the conversations at a
run's data_path, as `eagle-prep distil --engine vllm` would, and hands each sample (tokens, loss mask, aux and final
hidden states) to the trainer through a bounded buffer (eagle_train/sample_buffer.py) instead of a store. The target
runs only in the engine, with the engine's own parallelism (its options pass through: tensor_parallel_size...), on
devices, cores or a node of its own, while the trainer trains.

The samples are distil's: the same plan of conversations (`plan_conversations`, sorted by length; sample k is the
k-th planned), the same chained turns (`answer_turns`), the same last row (`with_every_row`), stored in bf16 as a
distilled store holds them. The trainer reads them as it reads a store's; only their order comes from the run
(`BufferedSamples.begin`), and the engine writes in that order.

The feed's directory (buffer_dir) is laid out as a store without shards, so the trainer's checks read it as one: a
manifest (target, aux layers, max_length, the plan) and a vocab map, counted from the source answers of the planned
conversations (the target's own answers do not exist before training starts).
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import torch

from data_prep.chat import MAX_LENGTH
from data_prep.distil import answer_turns, chained_end_of_turn, plan_conversations, with_every_row
from data_prep.readers import read_conversations
from data_prep.vocab import build_vocab_map, count_turn_tokens
from eagle_train.bf16 import data_engine_dtype
from eagle_train.files import write_json
from eagle_train.hidden_states import default_aux_layer_ids
from eagle_train.sample_buffer import (
    WRITER_STATS,
    BufferedSamples,
    BufferStopped,
    SampleBuffer,
    check_cap,
    sample_bytes_bound,
)
from eagle_train.store import (
    HIDDEN_FORMAT,
    MANIFEST,
    VERSION,
    chat_template_fingerprint,
    encode_checked,
    target_identity,
    write_vocab_map,
)
from eagle_train.target import (
    end_of_turn_ids,
    files_fingerprint,
    load_generation_config,
    load_target_config,
    load_tokenizer,
)
from eagle_train.vocab_map import DRAFT_VOCAB_SIZE

WRITER_CHILD = "import sys; from data_prep.feed import write_samples; write_samples(sys.argv[1])"
STORED_DTYPE = "bfloat16"  # what a distilled store holds by default, so the trainer reads the same values
ENGINE_LOG = "engine.log"


def bound_lengths(planned, max_new_tokens: int, max_length: int) -> list[int]:
    """Each planned conversation's longest sample: its turns' prompts and an answer of max_new_tokens each."""
    return [min(sum(map(len, segments)) + len(segments) * max_new_tokens, max_length) for _, segments in planned]


class EngineFeed:
    """The samples of an engine-fed run (`samples`, a `BufferedSamples`) and the config the trainer runs
    (`config`: data_path is the feed's directory, max_length and aux_layer_ids set). Every
    training process makes one; the main process's starts the engine when the trainer says what it reads, in a
    child process (`write_samples`) that runs `engines.vllm_data.HiddenStatesServer`.

        with EngineFeed(cfg) as feed:
            train(feed.config, build_head, objective, data=feed.samples)
    """

    def __init__(self, cfg):
        target_config = load_target_config(cfg.target)
        max_length = cfg.max_length or MAX_LENGTH
        aux = list(cfg.aux_layer_ids or default_aux_layer_ids(target_config.num_hidden_layers))
        tokenizer = load_tokenizer(cfg.target)
        generation = SimpleNamespace(generation_config=load_generation_config(cfg.target))
        self.eos_ids = sorted(end_of_turn_ids(generation, tokenizer))
        self.end_id = chained_end_of_turn(tokenizer, set(self.eos_ids)) if cfg.turns != 1 else None
        read = []  # the conversations the plan saw, which the vocab map counts
        self.planned, _ = plan_conversations(
            tokenizer,
            (read.append(c) or c for c in read_conversations(cfg.data_path)),
            cfg.num_conversations,
            max_length,
            cfg.max_new_tokens,
            cfg.system_prompt,
            cfg.turns,
            self.end_id,
        )
        if not self.planned:
            raise ValueError(
                f"no first turn of {cfg.data_path!r} leaves room for {cfg.max_new_tokens} new tokens within "
                f"max_length={max_length}: raise max_length or lower max_new_tokens"
            )
        self.directory = Path(cfg.buffer_dir or Path(cfg.output_dir) / "buffer")
        h = target_config.hidden_size
        cap = int(cfg.buffer_gib * 2**30)
        widths = {"aux_hidden": 3 * h, "final_hidden": h, "input_ids": 1, "loss_mask": 1}
        dtypes = {"aux_hidden": torch.bfloat16, "final_hidden": torch.bfloat16, "input_ids": torch.int64}
        check_cap(self.directory, cap, sample_bytes_bound(max_length, widths, {**dtypes, "loss_mask": torch.bool}))
        self.engine_options = {"max_num_seqs": cfg.engine_batch_size, **cfg.engine_options}
        self.engine_options["dtype"] = data_engine_dtype(self.engine_options)
        planned = [read[i] for i, _ in self.planned]
        draft_vocab_size = min(cfg.draft_vocab_size or DRAFT_VOCAB_SIZE, target_config.vocab_size)
        self.write_store_files(cfg, target_config, tokenizer, planned, max_length, aux, draft_vocab_size)
        self.config = replace(
            cfg, data_path=str(self.directory), max_length=max_length, aux_layer_ids=aux, draft_vocab_size=None
        )
        lengths = bound_lengths(self.planned, cfg.max_new_tokens, max_length)
        self.samples = BufferedSamples(self.directory, cap, lengths, cfg.later_epochs == "keep", self.start, self.alive)
        self.writer: subprocess.Popen | None = None
        self.heartbeat = Heartbeat(self.directory / HEARTBEAT)

    def write_store_files(self, cfg, target_config, tokenizer, planned, max_length, aux, draft_vocab_size) -> None:
        """The manifest and vocab map that make the feed's directory read as a store without shards: the map
        counts the source answers of the `planned` conversations."""
        counts = count_turn_tokens(planned, tokenizer, target_config.vocab_size, len(planned))
        vmap = build_vocab_map(counts, draft_vocab_size)
        write_vocab_map(self.directory, vmap["d2t"], vmap["t2d"], vmap["counts"])
        manifest = {
            "format": HIDDEN_FORMAT,
            "version": VERSION,
            "complete": True,
            "target": {
                **target_identity(target_config),
                "given": cfg.target,
                "fingerprint": files_fingerprint(cfg.target),
            },
            "aux_layer_ids": aux,
            "dtype": STORED_DTYPE,
            "tokenizer": cfg.target,
            "chat_template_fingerprint": chat_template_fingerprint(tokenizer.chat_template),
            "max_length": max_length,
            "source": str(cfg.data_path),
            "plan": {
                "distil": "greedy answers, turn after turn, captured while generated",
                "engine": "vllm",
                "feed": "made by the engine as the trainer reads them, through a bounded buffer",
                "turns": cfg.turns,
                "max_new_tokens": cfg.max_new_tokens,
                "system_prompt": cfg.system_prompt,
                "source_samples": len(self.planned),
            },
            "num_samples": len(self.planned),
            "shards": [],
        }
        write_json(self.directory / MANIFEST, manifest)

    def start(self, keys: list[int], samples: list[int]) -> None:
        """Start the engine writing buffer `keys` in order, sample `samples[k]` into `keys[k]` (the main process)."""
        stop_earlier_writer(self.directory)
        (self.directory / WRITER_STATS).unlink(missing_ok=True)
        request = {
            "target": self.config.target,
            "aux_layer_ids": self.config.aux_layer_ids,
            "engine_options": self.engine_options,
            "directory": str(self.directory),
            "cap_bytes": self.samples.buffer.cap_bytes,
            "keys": keys,
            "conversations": [[self.planned[i][0], self.planned[i][1]] for i in samples],
            "held_out": sorted(self.samples.key(-1, i) for i in self.samples.held_out),
            "keep": self.samples.keep,
            "max_new_tokens": self.config.max_new_tokens,
            "max_length": self.config.max_length,
            "end_id": self.end_id,
            "eos_ids": self.eos_ids,
            "batch_size": self.config.engine_batch_size,
            "parent": os.getpid(),
        }
        (self.directory / HEARTBEAT).unlink(missing_ok=True)
        path = self.directory / REQUEST
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(request))
        os.replace(tmp, path)  # an external engine never reads half a request
        if self.config.engine_launch == "external":
            print(f"waiting for the engine: run `python -m data_prep.feed {self.directory}` where it runs")
            return
        env = {**os.environ, "OMP_NUM_THREADS": "1", **{k: str(v) for k, v in self.config.engine_env.items()}}
        log = open(self.directory / ENGINE_LOG, "w")
        self.writer = subprocess.Popen([sys.executable, "-c", WRITER_CHILD, str(path)], env=env, stderr=log)
        self.started_by = os.getpid()  # a DataLoader worker's copy of it cannot wait on another's child

    def alive(self) -> str | None:
        """None while the engine works; else why it stopped, in one line."""
        said = self.samples.buffer.writer_stats().get("error")
        if said:
            return f"the vLLM engine stopped: {said}"
        if self.writer is not None and os.getpid() == self.started_by and self.writer.poll() is not None:
            tail = (self.directory / ENGINE_LOG).read_text(errors="replace").strip().splitlines()[-1:]
            return f"the vLLM engine exited ({self.writer.returncode}): {tail[0] if tail else 'no output'}"
        return self.heartbeat.stopped()

    def close(self) -> None:
        if self.writer is not None and self.writer.poll() is None:
            self.writer.send_signal(signal.SIGTERM)
            try:
                self.writer.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.writer.kill()
                self.writer.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


WRITER_PID = "writer.pid"
REQUEST = "writer-request.json"  # what the trainer asks the engine to write: keys, conversations, settings
HEARTBEAT = "writer.heartbeat"  # a count the engine's process raises every HEARTBEAT_SECONDS while it lives
HEARTBEAT_SECONDS, HEARTBEAT_SILENCE = 5.0, 120.0


class Heartbeat:
    """The engine's liveness as the trainer sees it through the shared directory, on any node: the count in the
    heartbeat file must change within HEARTBEAT_SILENCE seconds of this process's clock (no clocks compared)."""

    def __init__(self, path: Path):
        self.path, self.last, self.since = path, None, time.monotonic()

    def stopped(self) -> str | None:
        try:
            count = self.path.read_text()
        except OSError:
            return None  # not started yet: vLLM's start takes minutes on a big target
        if count != self.last:
            self.last, self.since = count, time.monotonic()
        elif time.monotonic() - self.since > HEARTBEAT_SILENCE:
            return (
                f"no heartbeat from the vLLM engine for {HEARTBEAT_SILENCE:.0f}s ({self.path}): its process or node "
                "died, or lost the shared storage"
            )
        return None


BEATING: set[Path] = set()  # the heartbeats this process raises already (`serve` answers request after request)


def beat(path: Path) -> None:
    """Raise the heartbeat count every HEARTBEAT_SECONDS, from a daemon thread of the engine's process, one a file."""
    if path in BEATING:
        return
    BEATING.add(path)

    def run():
        count = 0
        while True:
            count += 1
            tmp = path.with_suffix(".tmp")
            tmp.write_text(str(count))
            os.replace(tmp, path)
            time.sleep(HEARTBEAT_SECONDS)

    threading.Thread(target=run, daemon=True).start()


def stop_earlier_writer(directory: Path) -> None:
    """A writer a killed trainer left behind stops at its next sample; a resumed run stops it at once."""
    try:
        pid = int((directory / WRITER_PID).read_text())
        if WRITER_CHILD.split(";")[1].strip() in Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " "):
            os.kill(pid, signal.SIGTERM)
    except (OSError, ValueError):
        pass


def chunks(n: int, size: int) -> list[tuple[int, int]]:
    """The engine's calls over n samples: from size / 8 up to `size`, then halving over the last ones. A call hands
    its samples over only when its longest answer ends, so small first calls start the trainer early, and small last
    ones leave it little to train once the engine is done."""
    out, start, step, least = [], 0, max(1, size // 8), max(1, size // 8)
    while start < n:
        stop = min(n, start + min(step, max(least, (n - start) // 2)))
        out.append((start, stop))
        start, step = stop, min(size, 2 * step)
    return out


def write_samples(request_path: str, external: bool = False) -> None:
    """The engine's side: answer the conversations of the trainer's request in order, a batch at a time, and put each
    sample into the buffer. As the main training process's child, stop when it is gone; started apart (`external`,
    `serve`), when the trainer asks anew (a resumed run). An engine that fails says why in the buffer's writer stats,
    which the trainer reads."""
    from engines.vllm_data import HiddenStatesServer

    torch.set_num_threads(1)
    asked = Path(request_path).read_text()
    request = json.loads(asked)
    directory = Path(request["directory"])
    (directory / WRITER_PID).write_text(str(os.getpid()))
    buffer = SampleBuffer(directory, request["cap_bytes"])
    held_out = set(request["held_out"])

    def gone() -> str | None:
        if external:
            return None if Path(request_path).read_text() == asked else "the trainer asked anew"
        return None if os.getppid() == request["parent"] else "the trainer exited"

    def alive() -> str | None:
        reason = gone()
        if reason:
            return reason
        on_disk = buffer.samples()  # no reader frees room when every sample on disk is one that stays
        if on_disk and (request["keep"] or held_out >= set(on_disk)):
            return (
                f"the buffer cap of {buffer.cap_bytes / 2**30:.2f} GiB is full of samples that are read again (the "
                "held-out ones, and with later_epochs=keep every one): raise buffer_gib, lower eval_fraction, or "
                "use later_epochs=answer"
            )
        return None

    todo = list(zip(request["keys"], request["conversations"]))
    size = request["batch_size"]
    if not todo:
        return  # every sample is in the buffer already (later_epochs=keep, resumed)
    beat(directory / HEARTBEAT)
    try:
        with HiddenStatesServer(request["target"], request["aux_layer_ids"], request["engine_options"]) as server:
            buffer.started = time.perf_counter()  # the engine's rate counts from its start on
            buffer.stats["engine_start_seconds"] = server.init_seconds

            def answer(prompts):
                return server.answer(prompts, request["max_new_tokens"], set(request["eos_ids"]))

            for start, stop in chunks(len(todo), size):
                if gone():
                    return  # the trainer was killed, or a resumed one asks anew
                chunk = todo[start:stop]
                conversations = [(source, segments) for _, (source, segments) in chunk]
                samples = answer_turns(
                    answer, conversations, request["max_new_tokens"], request["max_length"], request["end_id"]
                )
                for (key, (source, _)), sample in zip(chunk, samples):
                    sample = with_every_row(sample)
                    where = f"the target's hidden states while answering conversation {source}"
                    sample.update(
                        encode_checked(sample.pop("aux_hidden"), sample.pop("final_hidden"), STORED_DTYPE, where)
                    )
                    buffer.put(key, sample, alive)
    except BufferStopped:
        return
    except Exception as e:  # the trainer reads this line and stops with it
        buffer.stats["error"] = " ".join(str(e).split())[:500] or type(e).__name__
        write_json(directory / WRITER_STATS, buffer.stats)
        raise


def serve(directory: str) -> None:
    """`python -m data_prep.feed BUFFER_DIR`: the engine of a run with `engine_launch=external`, on a node of its own
    that shares BUFFER_DIR with the trainer's. Answers each request the trainer writes there (a resumed run's too),
    until killed."""
    path = Path(directory) / REQUEST
    done = None
    print(f"waiting for a trainer's request in {path}")
    while True:
        try:
            asked = path.read_text()
        except OSError:
            asked = None
        if asked is None or asked == done:
            time.sleep(1.0)
            continue
        print(f"answering {len(json.loads(asked)['keys'])} samples into {directory}")
        try:
            write_samples(str(path), external=True)
        except Exception:  # said in the writer stats, which the trainer reads; wait for its next request
            pass
        done = asked


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m data_prep.feed BUFFER_DIR (the buffer_dir of a run with engine_launch=external)")
    serve(sys.argv[1])
