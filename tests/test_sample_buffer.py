"""The bounded buffer between a sample-making engine and the trainer (eagle_train/sample_buffer.py): samples come out
whole and in order, the bytes on disk never pass the cap, a side that dies stops the other with its reason, a
resumed reader loses no sample and reads none twice, and a cap that cannot work is one line before any compute."""

import threading
import time

import pytest
import torch

from eagle_train.sample_buffer import BufferStopped, SampleBuffer, check_cap, sample_bytes_bound

H, T = 16, 12


def sample(i: int) -> dict:
    g = torch.Generator().manual_seed(i)
    return {
        "input_ids": torch.randint(0, 100, (T,), generator=g),
        "loss_mask": torch.ones(T, dtype=torch.bool),
        "aux_hidden": torch.randn(T, 3 * H, generator=g).to(torch.bfloat16),
        "final_hidden": torch.randn(T, H, generator=g).to(torch.bfloat16),
    }


def one_sample_bytes(tmp_path) -> int:
    probe = SampleBuffer(tmp_path / "probe", cap_bytes=1 << 30)
    probe.put(0, sample(0))
    return probe.used_bytes()


def test_samples_come_out_whole_in_order_and_the_disk_never_holds_more_than_the_cap(tmp_path):
    size = one_sample_bytes(tmp_path)
    cap = 3 * size
    writer, reader = SampleBuffer(tmp_path / "b", cap, 0.001), SampleBuffer(tmp_path / "b", cap, 0.001)
    seen_bytes = []

    def write():
        for i in range(20):
            writer.put(i, sample(i))
            seen_bytes.append(writer.used_bytes())

    thread = threading.Thread(target=write)
    thread.start()
    for i in range(20):
        time.sleep(0.002)  # a slow trainer: the writer fills the buffer and waits
        got = reader.get(i)
        assert all(torch.equal(got[k], v) for k, v in sample(i).items())
    thread.join()
    assert max(seen_bytes) <= cap and writer.stats["peak_bytes"] <= cap
    assert writer.stats["peak_bytes"] > 2 * size  # it did fill up
    assert writer.stats["put_wait_seconds"] > 0 and reader.writer_stats()["put"] == 20
    assert reader.bottleneck() == "trainer" and reader.samples() == {}


def test_a_dead_writer_stops_the_reader_with_its_reason_and_a_dead_reader_the_writer(tmp_path):
    size = one_sample_bytes(tmp_path)
    buffer = SampleBuffer(tmp_path / "b", 2 * size, 0.001)
    buffer.put(0, sample(0))
    assert torch.equal(
        buffer.get(0, alive=lambda: "vLLM exited 1: CUDA out of memory")["input_ids"], sample(0)["input_ids"]
    )
    with pytest.raises(BufferStopped, match="vLLM exited 1: CUDA out of memory"):
        buffer.get(1, alive=lambda: "vLLM exited 1: CUDA out of memory")  # never a hang, never part of a sample
    buffer.put(1, sample(1))
    buffer.put(2, sample(2))
    with pytest.raises(BufferStopped, match="the trainer exited"):
        buffer.put(3, sample(3), alive=lambda: "the trainer exited")


def test_a_resumed_reader_loses_no_sample_and_reads_none_twice(tmp_path):
    """The trainer read samples 0-4 but checkpointed after 2 and was killed; the writer ran ahead to 6, and wrote 9,
    which the resumed run (with another process count) no longer reads. On resume 9 goes, 5 and 6 stay, and 3 and 4
    (removed when first read) are written again."""
    buffer = SampleBuffer(tmp_path / "b", 1 << 30)
    for i in [*range(7), 9]:
        buffer.put(i, sample(i))
    for i in range(5):
        buffer.get(i)
    assert sorted(buffer.samples()) == [5, 6, 9]
    resumed = SampleBuffer(tmp_path / "b", 1 << 30)
    assert resumed.drop_all_but(set(range(3, 7))) == 1
    assert sorted(resumed.samples()) == [5, 6]
    for i in range(3, 7):
        resumed.put(i, sample(i))  # the writer restarts at the checkpoint: 5 and 6 are kept as they are
    assert [int(torch.equal(resumed.get(i)["input_ids"], sample(i)["input_ids"])) for i in range(3, 7)] == [1] * 4


def test_a_cap_that_cannot_work_is_one_line_before_any_compute(tmp_path):
    largest = sample_bytes_bound(
        T,
        {"aux_hidden": 3 * H, "final_hidden": H, "input_ids": 1, "loss_mask": 1},
        {
            "aux_hidden": torch.bfloat16,
            "final_hidden": torch.bfloat16,
            "input_ids": torch.int64,
            "loss_mask": torch.bool,
        },
    )
    assert largest >= one_sample_bytes(tmp_path)
    with pytest.raises(ValueError, match="below one sample of the longest length") as refused:
        check_cap(tmp_path / "b", largest - 1, largest)
    assert len(str(refused.value).splitlines()) == 1
    with pytest.raises(ValueError, match="GiB free: free space or lower the cap"):
        check_cap(tmp_path / "b", 1 << 60, largest)
    check_cap(tmp_path / "b", 1 << 20, largest)
    with pytest.raises(ValueError, match="over the buffer cap"):
        SampleBuffer(tmp_path / "c", 100).put(0, sample(0))
