"""The trainer fed through the bounded buffer (eagle_train/sample_buffer.BufferedSamples), with a thread that copies a
store's samples in as a stand-in for the engine: it trains exactly as on the store itself, holds no more than its cap,
resumes after a stop losing and repeating no sample, and stops in one line naming an engine that died. vLLM making the
samples: tests/test_online_vllm.py."""

import json
import subprocess
import sys
import threading

import pytest
from safetensors.torch import save
from test_trainer import config, losses, run

from eagle_train.sample_buffer import BufferedSamples, BufferStopped, SampleBuffer
from eagle_train.store import ShardedSamples
from eagle_train.train_checkpoint import STATE_FILE

OVERRIDES = ["num_epochs=2", "eval_fraction=0.2", "tokens_per_batch=128"]


class StoreAsEngine:
    """Writes a store's samples into the buffer in the order the trainer asks for, from a thread: what the vLLM
    writer (data_prep.feed.write_samples) does with the samples it makes."""

    def __init__(self, store, directory, cap_bytes, keep=False):
        self.store = ShardedSamples(store)
        self.samples = BufferedSamples(directory, cap_bytes, self.store.lengths(), keep, self.start, self.alive)
        self.written, self.error, self.stop = [], None, False  # written: the keys asked for, in order

    def start(self, keys, samples):
        self.writer = writer = SampleBuffer(
            self.samples.buffer.directory, self.samples.buffer.cap_bytes, poll_seconds=0.001
        )

        def write():
            try:
                for key, i in zip(keys, samples):
                    writer.put(key, self.store[i], lambda: "the trainer stopped" if self.stop else None)
                    self.written.append(key)
            except BufferStopped:
                pass

        self.thread = threading.Thread(target=write, daemon=True)
        self.thread.start()

    def alive(self):
        return self.error

    def close(self):
        self.stop = True
        self.thread.join()


def state_of(result) -> dict:
    return json.loads((result["checkpoint"] / STATE_FILE).read_text())


def test_a_buffer_fed_run_trains_exactly_as_its_store_and_holds_no_more_than_its_cap(train_store, tmp_path):
    straight = run(config(train_store, tmp_path / "store", *OVERRIDES))
    store = ShardedSamples(train_store)
    largest = max(len(save(store[i])) for i in range(len(store)))
    engine = StoreAsEngine(train_store, tmp_path / "buffer", cap_bytes=2 * largest)
    fed = run(config(train_store, tmp_path / "fed", *OVERRIDES), data=engine.samples)
    engine.close()
    assert losses(fed) == losses(straight)  # the same samples in the same order: bit-identical on CPU, fp32
    assert fed["eval_before"] == straight["eval_before"] and fed["eval_after"] == straight["eval_after"]
    assert largest < engine.writer.stats["peak_bytes"] <= 2 * largest  # it filled up, and never passed the cap
    # each sample the run reads written once: the held-out one (kept for every eval), then every epoch's copies
    held_out = engine.samples.held_out
    assert len(held_out) == 1
    assert len(engine.written) == len(set(engine.written)) == len(held_out) + state_of(fed)["samples_consumed"]
    assert sorted(engine.samples.buffer.samples()) == sorted(held_out)  # the rest was removed as it was read


def test_a_buffer_fed_run_resumes_losing_and_repeating_no_sample(train_store, tmp_path):
    """Stopped mid-run after a checkpoint (as a kill would leave it, with the engine ahead of the trainer), then
    resumed with a new engine: the loss curve is the uninterrupted run's, and the new engine writes the samples from
    the checkpoint on."""
    straight = run(config(train_store, tmp_path / "store", *OVERRIDES))
    stop = len(straight["history"]) // 2 + 1
    out = tmp_path / "fed"
    first = StoreAsEngine(train_store, tmp_path / "buffer", cap_bytes=1 << 30)
    stopped = run(config(train_store, out, *OVERRIDES, "save_every=2", f"stop_after_step={stop}"), data=first.samples)
    first.close()
    ahead = len(first.written) - 1 - state_of(stopped)["samples_consumed"]
    assert ahead > 0  # the engine wrote samples the trainer had not read when it stopped
    again = StoreAsEngine(train_store, tmp_path / "buffer", cap_bytes=1 << 30)
    resumed = run(config(train_store, out, *OVERRIDES, "resume=auto"), data=again.samples)
    again.close()
    assert losses(stopped) + losses(resumed) == losses(straight)
    assert resumed["eval_after"] == straight["eval_after"]
    consumed = state_of(resumed)["samples_consumed"] - state_of(stopped)["samples_consumed"]
    assert len(again.written) == again.writer.stats["put"] == consumed - ahead  # what is on disk stays as it is
    assert sorted(again.samples.buffer.samples()) == sorted(again.samples.held_out)


def test_an_engine_that_died_stops_the_trainer_in_one_line(train_store, tmp_path):
    engine = StoreAsEngine(train_store, tmp_path / "buffer", cap_bytes=1 << 30)
    engine.start = lambda keys, samples: None  # it never writes
    engine.samples.start_writer = engine.start
    engine.error = "the vLLM engine exited (1): torch.OutOfMemoryError: CUDA out of memory"
    cfg = config(train_store, tmp_path / "fed", *OVERRIDES)
    with pytest.raises(BufferStopped, match="CUDA out of memory"):
        run(cfg, data=engine.samples)
    script = (
        "import sys; from eagle_train.train_config import one_line_refusals; "
        "from eagle_train.sample_buffer import BufferStopped\n"
        "with one_line_refusals(): raise BufferStopped('the vLLM engine exited (1): boom')"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 1 and done.stderr == "error: the vLLM engine exited (1): boom\n"


def test_an_engine_on_another_node_is_alive_while_its_heartbeat_count_moves(tmp_path, monkeypatch):
    """engine_launch=external: the trainer sees the engine only through the shared directory. Before the first beat
    it waits (vLLM starts); a count that stops moving for HEARTBEAT_SILENCE seconds of the trainer's own clock means
    the engine's process or node died."""
    from data_prep import feed

    clock = [0.0]
    monkeypatch.setattr(feed.time, "monotonic", lambda: clock[0])
    heartbeat = feed.Heartbeat(tmp_path / feed.HEARTBEAT)
    clock[0] = 10 * feed.HEARTBEAT_SILENCE
    assert heartbeat.stopped() is None  # no engine yet: waiting is not dying
    for count in range(1, 4):
        (tmp_path / feed.HEARTBEAT).write_text(str(count))
        clock[0] += feed.HEARTBEAT_SILENCE - 1
        assert heartbeat.stopped() is None
    clock[0] += feed.HEARTBEAT_SILENCE - 1
    assert heartbeat.stopped() is None
    clock[0] += 2
    assert "no heartbeat from the vLLM engine for 120s" in heartbeat.stopped()


def test_the_engine_answers_in_calls_that_grow_to_its_batch_shrink_at_the_end_and_cover_every_sample_once():
    from data_prep.feed import chunks

    for n, size in [(96, 32), (3, 32), (1000, 256), (5, 1)]:
        calls = chunks(n, size)
        assert [i for a, b in calls for i in range(a, b)] == list(range(n))
        sizes = [b - a for a, b in calls]
        assert sizes[0] == min(n, max(1, size // 8)) and max(sizes) <= size
        top = sizes.index(max(sizes))
        assert sizes[: top + 1] == sorted(sizes[: top + 1])  # growing, then not
        assert sizes[top:] == sorted(sizes[top:], reverse=True) and sizes[-1] <= max(1, size // 8)
