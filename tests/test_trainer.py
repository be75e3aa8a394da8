"""The trainer on the real SmolLM2 target in one process: config errors before compute, offline ==
online, exact resume, init_from, checkpoints that load. Two processes: tests/test_distributed.py."""

import json
from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState
from conftest import TRAIN_DRAFT_VOCAB, load_script
from safetensors.torch import save_file

from eagle_train import backend, bf16
from eagle_train.batching import epoch_batches
from eagle_train.checkpoint import load_draft_head
from eagle_train.methods import METHODS, objective_for
from eagle_train.methods.eagle3.train import build_eagle3_head, eagle3_objective
from eagle_train.train_checkpoint import STATE_FILE, check_resumable, checkpoint_damage
from eagle_train.train_config import TrainConfig, load_train_config
from eagle_train.trainer import train
from eagle_train.training_parts import noisy_features

REPO = Path(__file__).resolve().parents[1]


def config(data_path, out, *overrides):
    base = [
        f"data_path={data_path}",
        f"output_dir={out}",
        "ttt_length=3",
        "tokens_per_batch=128",
        "max_length=128",
        "learning_rate=1e-3",
        "warmup_steps=2",
        "eval_fraction=0",
        "report_to=none",
        "log_every=0",
        "seed=0",
        "mixed_precision=no",  # fp32 on every CPU: these tests compare losses bit for bit or to 1e-5
    ]
    return load_train_config(None, base + list(overrides))


def run(cfg, **kwargs):
    return train(cfg, build_eagle3_head, objective_for(cfg), **kwargs)


def losses(result):
    return [m["loss"] for m in result["history"]]


def test_overrides_are_typed_and_unknown_keys_name_the_valid_ones(tmp_path):
    cfg = load_train_config(
        REPO / "configs" / "eagle3_smollm2.yaml",
        [
            f"data_path={tmp_path / 'no-data-yet'}",  # nothing to take the unset keys from
            "learning_rate=2e-4",
            "ttt_length=5",
            "aux_layer_ids=[2,15,27]",
            "gradient_checkpointing=true",
            "adam_betas=0.9,0.99",
            "draft_vocab_size=null",
            "mixed_precision=no",  # YAML's False
        ],
    )
    assert (cfg.learning_rate, cfg.ttt_length, cfg.aux_layer_ids) == (2e-4, 5, [2, 15, 27])
    assert cfg.mixed_precision == "no"
    assert cfg.gradient_checkpointing is True and cfg.adam_betas == [0.9, 0.99] and cfg.draft_vocab_size is None
    with pytest.raises(ValueError, match=r"unknown config key\(s\) \['lerning_rate'\]; valid keys: .*learning_rate"):
        load_train_config(None, ["lerning_rate=1e-4"])
    with pytest.raises(ValueError, match="'ttt_length' expects int, got 'seven'"):
        load_train_config(None, ["ttt_length=seven"])
    with pytest.raises(ValueError, match="not key=value"):
        load_train_config(None, ["ttt_length"])


def test_a_training_script_implies_its_method_and_refuses_another():
    from eagle_cli.train import config_from_command_line

    assert config_from_command_line(["learning_rate=1e-3"], method="peagle").method == "peagle"
    assert config_from_command_line(["--config", "peagle_smollm2"]).method == "peagle"
    with pytest.raises(SystemExit, match=r"^error: method=eagle3: this script trains peagle heads") as err:
        config_from_command_line(["--config", str(REPO / "configs" / "eagle3_smollm2.yaml")], method="peagle")
    with pytest.raises(SystemExit, match=rf"^error: method 'medusa' is not one of {', '.join(METHODS)}$"):
        config_from_command_line(["method=medusa"])
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "overrides, error, match",
    [
        (["draft_vocab_size=50000"], ValueError, "draft_vocab_size 50000 is larger than the target vocabulary 49152"),
        (["ttt_length=0"], ValueError, "ttt_length must be >= 1"),
        (["tv_weight=1.5"], ValueError, r"tv_weight must be in \[0, 1\]"),
        (["data_path=/nonexistent/store"], FileNotFoundError, "data_path /nonexistent/store does not exist"),
        (["eval_fraction=1.5"], ValueError, "eval_fraction must be in"),
        (["aux_layer_ids=[3,15,27]"], ValueError, r"aux_layer_ids=\[3, 15, 27\] but the store at .* holds aux layers"),
        (["resume=/nonexistent/ckpt"], FileNotFoundError, "resume checkpoint"),
        (["mode=streaming"], ValueError, "mode 'streaming' is not one of"),
        ([f"output_dir={__file__}/run"], ValueError, r"output_dir .* cannot be written: .*test_trainer.py is not a"),
    ],
)
def test_bad_runs_fail_before_any_compute(monkeypatch, train_store, tmp_path, overrides, error, match):
    def no_compute(*args, **kwargs):
        raise AssertionError("the target was loaded before the config was checked")

    monkeypatch.setattr("eagle_train.trainer.load_target", no_compute)
    with pytest.raises(error, match=match):
        run(config(train_store, tmp_path, *overrides))


def test_a_store_from_another_target_or_a_dataset_without_hidden_states_is_refused(
    monkeypatch, train_store, train_tokenized, tiny_llama_dir, tmp_path
):
    monkeypatch.setattr("eagle_train.trainer.load_target", lambda *a, **k: pytest.fail("target loaded"))
    with pytest.raises(ValueError, match="does not match target"):
        run(config(train_store, tmp_path, f"target={tiny_llama_dir}"))
    with pytest.raises(ValueError, match="tokenized dataset without hidden states: train with mode=online"):
        run(config(train_tokenized, tmp_path, "mode=offline"))


def test_a_fresh_run_refuses_an_output_dir_with_checkpoints(monkeypatch, train_store, tmp_path):
    monkeypatch.setattr("eagle_train.trainer.load_target", lambda *a, **k: pytest.fail("target loaded"))
    (tmp_path / "checkpoint-3").mkdir()
    (tmp_path / "checkpoint-3" / STATE_FILE).write_text("{}")
    with pytest.raises(ValueError, match="holds checkpoints of an earlier run: continue it with resume=auto"):
        run(config(train_store, tmp_path))


def test_offline_and_online_training_give_the_same_step0_loss(train_store, train_tokenized, tmp_path):
    offline = run(config(train_store, tmp_path / "off", "max_steps=1", "draft_vocab_size=128"))
    online = run(config(train_tokenized, tmp_path / "on", "max_steps=1", "mode=online", "draft_vocab_size=128"))
    a, b = offline["history"][0], online["history"][0]
    assert a["count_0"] == b["count_0"] > 10
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    assert a["acc_0"] == pytest.approx(b["acc_0"], abs=1e-6)
    assert a["loss"] > 0


def test_bf16_autocast_on_the_cpu_trains_the_fp32_run_to_bf16_rounding(train_store, tmp_path):
    fp32 = run(config(train_store, tmp_path / "fp32", "max_steps=3"))
    AcceleratorState._reset_state()  # one Accelerator per precision per process
    half = run(config(train_store, tmp_path / "bf16", "max_steps=3", "mixed_precision=bf16"))
    assert fp32["history"][0]["count_0"] > 10
    for a, b in zip(fp32["history"], half["history"], strict=True):
        assert a["count_0"] == b["count_0"]
        # bf16 keeps 8 significant bits: each matmul's output is off by up to 2^-8 relative, a layer deep
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-2)
    assert [m["loss"] for m in fp32["history"]] != [m["loss"] for m in half["history"]]  # autocast ran


def test_auto_precision_is_bf16_on_cuda_and_on_cpus_with_bf16_instructions(monkeypatch, tmp_path):
    with_bf16, without = tmp_path / "zen4", tmp_path / "zen2"
    with_bf16.write_text("flags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_bf16 avx512_vnni\n")
    without.write_text("flags\t\t: fpu sse2 avx2 avx512f avx512bw\n")
    assert bf16.cpu_multiplies_bf16(with_bf16)
    assert not bf16.cpu_multiplies_bf16(without)
    assert not bf16.cpu_multiplies_bf16(tmp_path / "no-such-file")  # not Linux: fp32
    auto, fp32 = load_train_config(None, []), load_train_config(None, ["mixed_precision=no"])
    for cuda, bf16_cpu, want in ((False, False, "no"), (False, True, "bf16"), (True, False, "bf16")):
        monkeypatch.setattr(torch.cuda, "is_available", lambda cuda=cuda: cuda)
        monkeypatch.setattr(bf16, "cpu_multiplies_bf16", lambda bf16_cpu=bf16_cpu: bf16_cpu)
        assert backend.precision(auto) == want
        assert backend.precision(fp32) == "no"


def test_a_smaller_draft_vocab_keeps_the_most_frequent_ids(train_store):
    from data_prep.vocab import build_vocab_map
    from eagle_train.store import read_vocab_map
    from eagle_train.trainer import vocab_map_of_size

    vmap = read_vocab_map(train_store)
    small = vocab_map_of_size(vmap, 100)
    reference = build_vocab_map(vmap["counts"], 100)  # what data_prep would have written
    assert torch.equal(small["d2t"], reference["d2t"]) and torch.equal(small["t2d"], reference["t2d"])
    assert vocab_map_of_size(vmap, TRAIN_DRAFT_VOCAB) is vmap


def test_a_sample_seen_before_needs_only_the_draft_rows_of_the_target_lm_head(train_store, smollm2, tmp_path):
    from eagle_train.store import ShardedSamples, read_vocab_map
    from eagle_train.trainer import BatchSource, micro_batch

    cfg = config(train_store, tmp_path)
    t2d = read_vocab_map(train_store)["t2d"]
    source = BatchSource(cfg, smollm2[0], t2d, [2, 15, 27], torch.device("cpu"))
    data, ids = ShardedSamples(train_store), [3, 1, 4]
    first = source(micro_batch([data[i] for i in ids], ids, 128, seed=0))
    assert sorted(source.in_draft) == sorted(ids)
    source.target_logits = None  # a second pass over these samples must not need the whole vocabulary
    again = source(micro_batch([data[i] for i in ids[::-1]], ids[::-1], 128, seed=0))
    assert torch.equal(again["in_draft"], first["in_draft"].flip(0)) and first["in_draft"].any()
    assert torch.allclose(again["target_probs"], first["target_probs"].flip(0), atol=1e-6)


def test_feature_noise_scales_with_each_layer_and_reaches_training_batches_only():
    scales = torch.tensor([0.5, 5.0, 200.0])  # the low, mid and high layers of a real target differ so
    aux = (torch.randn(2, 50, 3, 64) * scales[:, None]).flatten(-2)
    batch = {"aux_hidden": aux, "input_ids": None, "loss_mask": None, "target_probs": None, "in_draft": None}
    seen = []

    def model(fn, features, *args, **kwargs):
        seen.append(features)
        return features.sum(), {}

    objective = eagle3_objective(TrainConfig(feature_noise=0.1))
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            objective(model, {**batch, "generator": torch.Generator().manual_seed(7)}, lambda loss: None)
    trained, evaluated = seen
    assert torch.equal(evaluated, aux)
    assert torch.equal(trained, noisy_features(aux, 0.1, torch.Generator().manual_seed(7)))
    assert not torch.equal(trained, noisy_features(aux, 0.1, torch.Generator().manual_seed(8)))
    layers, noise = aux.unflatten(-1, (3, -1)), (trained - aux).unflatten(-1, (3, -1))
    relative = noise / (0.1 * layers.pow(2).mean(-1, keepdim=True).sqrt())
    n = relative[..., 0, :].numel()
    for layer in range(3):  # standard normal per layer: sample std within 5 of its standard errors (1 / sqrt(2n))
        assert relative[..., layer, :].std().item() == pytest.approx(1.0, abs=5 / (2 * n) ** 0.5)
        assert relative[..., layer, :].mean().item() == pytest.approx(0.0, abs=5 / n**0.5)


def test_batches_are_length_grouped_within_budget_and_seeded():
    lengths = [5, 90, 30, 31, 64, 7, 100, 12, 45, 46]
    batches = epoch_batches(list(range(10)), lengths, 128, seed=3, epoch=0)
    assert sorted(i for b in batches for i in b) == list(range(10))
    assert all(len(b) * max(lengths[i] for i in b) <= 128 or len(b) == 1 for b in batches)
    assert batches == epoch_batches(list(range(10)), lengths, 128, seed=3, epoch=0)
    assert batches != epoch_batches(list(range(10)), lengths, 128, seed=3, epoch=1)


def test_resume_after_a_stop_continues_the_identical_loss_curve(train_store, smollm2, tmp_path):
    overrides = ["num_epochs=2", "eval_fraction=0.2"]
    straight = run(config(train_store, tmp_path / "a", *overrides))
    n = len(straight["history"])
    assert n >= 6
    stop = n // 2 + 1  # mid-epoch, off the save_every grid: the stop writes its own checkpoint
    first = run(config(train_store, tmp_path / "b", *overrides, "save_every=2", f"stop_after_step={stop}"))
    ckpt = first["checkpoint"]
    assert ckpt.name == f"checkpoint-{stop}"
    assert {p.name for p in ckpt.iterdir()} == {
        "head",
        "optimizer.pt",
        "scheduler.pt",
        "rng-rank0.pt",
        STATE_FILE,
    }
    saved = json.loads((ckpt / STATE_FILE).read_text())
    assert saved["step"] == stop and saved["num_processes"] == 1 and saved["samples_consumed"] > 0
    resumed = run(config(train_store, tmp_path / "b", *overrides, "resume=auto"))
    assert losses(first) == losses(straight)[:stop]
    assert losses(resumed) == losses(straight)[stop:]  # bit-identical on CPU, fp32
    assert resumed["eval_after"] == straight["eval_after"]
    assert straight["eval_after"]["loss"] < straight["eval_before"]["loss"]

    # <output_dir>/final is the last head; it loads through the common loader, shares the target embedding
    model = smollm2[0]
    head = load_draft_head(tmp_path / "b" / "final", model)
    again = load_draft_head(resumed["checkpoint"], model)
    for k, v in head.saved_state_dict().items():
        assert torch.equal(v, again.saved_state_dict()[k]), k
    assert head.embed_tokens.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()

    # init_from that head: training starts exactly where it ended
    init = run(config(train_store, tmp_path / "c", *overrides, "max_steps=1", f"init_from={tmp_path / 'b' / 'final'}"))
    assert init["eval_before"] == straight["eval_after"]


def test_a_resume_the_checkpoint_cannot_give_is_refused_before_the_target_loads(train_store, tmp_path, monkeypatch):
    """FSDP / ZeRO save one optimizer shard per process: another process count is refused, and so
    is another backend (a whole AdamW state, FSDP shards and ZeRO partitions do not convert); both
    messages name the launch that resumes it and init_from. A whole optimizer resumes with any count."""
    from eagle_train import trainer

    monkeypatch.setattr(trainer, "build_model", lambda *a: pytest.fail("the target loaded"))
    out = tmp_path / "run"
    ckpt = out / "checkpoint-4"
    ckpt.mkdir(parents=True)
    for rank in (0, 1):
        torch.save({}, ckpt / f"optimizer-rank{rank}.pt")
        torch.save({}, ckpt / f"rng-rank{rank}.pt")
    torch.save({}, ckpt / "scheduler.pt")
    (ckpt / "head").mkdir()
    (ckpt / "head" / "config.json").write_text("{}")
    save_file({"fc.weight": torch.zeros(1)}, ckpt / "head" / "model.safetensors")
    position = {"step": 4, "epoch": 0, "epoch_samples": 8, "samples_consumed": 8, "tokens_consumed": 512}
    (ckpt / STATE_FILE).write_text(json.dumps({**position, "num_processes": 2, "optimizer_layout": "zero2"}))
    with pytest.raises(
        ValueError,
        match=r"saved by DeepSpeed ZeRO-2 and this launch is one process or DDP: resume it with "
        r"deepspeed_zero2.yaml and the same process count, or .*init_from=",
    ):
        run(config(train_store, out, "resume=auto"))
    with pytest.raises(
        ValueError, match=r"sharded over 2 processes.*this run has 1: resume it with 2 processes.*init_from="
    ):
        check_resumable(ckpt, 1, "zero2")
    check_resumable(ckpt, 2, "zero2")  # the same backend and count: fine
    with pytest.raises(ValueError, match="saved by DeepSpeed ZeRO-2 and this launch is DeepSpeed ZeRO-3"):
        check_resumable(ckpt, 2, "zero3")

    whole = tmp_path / "whole"
    whole.mkdir()
    torch.save({}, whole / "optimizer.pt")
    (whole / STATE_FILE).write_text(json.dumps({"num_processes": 2, "step": 4}))  # no layout: saved earlier
    check_resumable(whole, 1, "whole")
    check_resumable(whole, 3, "whole")
    with pytest.raises(
        ValueError, match="saved by one process or DDP and this launch is FSDP: resume it with 1 process"
    ):
        check_resumable(whole, 2, "fsdp")


def test_a_store_of_other_weights_in_the_same_shape_is_refused(tiny_llama, tiny_llama_dir, small_tokenized, tmp_path):
    """Same architecture, same directory name, other weights: only the fingerprint tells them apart."""
    from conftest import tiny_target

    from data_prep.capture import capture

    model, tokenizer = tiny_llama
    capture(model, small_tokenized, tmp_path / "store", target_name=str(tiny_llama_dir), progress=False)
    other = tmp_path / "elsewhere" / tiny_llama_dir.name
    tiny_target(seed=1, **model.config.to_diff_dict()).save_pretrained(other)
    tokenizer.save_pretrained(other)
    with pytest.raises(ValueError, match=r"weights fingerprint \w+\) does not match .* \(weights fingerprint \w+\)"):
        run(config(tmp_path / "store", tmp_path / "run", f"target={other}"))
    assert not list((tmp_path / "run").glob("checkpoint-*"))


def test_a_run_that_supervises_nothing_stops(train_store, tmp_path):
    """max_length=8 keeps the system prompt only: no loss-masked token is left to train."""
    with pytest.raises(ValueError, match=r"3 steps supervised no position: .* max_length"):
        run(config(train_store, tmp_path, "max_length=8", "max_steps=3"))
    assert not list(tmp_path.glob("checkpoint-*")) and not (tmp_path / "final").exists()


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["max_steps=-5"], "max_steps must be >= 0"),
        (["save_every=-1"], "save_every must be >= 0"),
        (["eval_every=-2"], "eval_every must be >= 0"),
        (["log_every=-1"], "log_every must be >= 0"),
        (["warmup_steps=-1"], "warmup_steps must be >= 0"),
        (["keep_checkpoints=0"], "keep_checkpoints must be >= 1"),
        (["learning_rate=.inf"], "learning_rate must be a number > 0"),
        (["weight_decay=-0.1"], "weight_decay must be >= 0"),
        (["feature_noise=-0.1"], "feature_noise must be >= 0"),
        (["num_epochs=0", "max_steps=3"], "num_epochs must be >= 1"),
        (["num_workers=-1"], "num_workers must be >= 0"),
    ],
)
def test_meaningless_numbers_are_refused_before_any_compute(monkeypatch, train_store, tmp_path, overrides, match):
    monkeypatch.setattr("eagle_train.trainer.load_target", lambda *a, **k: pytest.fail("target loaded"))
    with pytest.raises(ValueError, match=match):
        run(config(train_store, tmp_path, *overrides))


# ---- nothing silently wrong: non-finite steps, damaged checkpoints, one line from the scripts ----


def poison(monkeypatch, store, step: int) -> list[int]:
    """Make the store samples of `step`'s micro-batch (one process, eval_fraction=0) read as nan; returns them."""
    from eagle_train.store import ShardedSamples

    data = ShardedSamples(store)
    lengths = [min(n, 128) for n in data.lengths()]
    samples = epoch_batches(list(range(len(data))), lengths, 128, seed=0, epoch=0)[step - 1]
    read = ShardedSamples.__getitem__

    def poisoned(self, i):
        item = read(self, i)
        if i in samples:
            item["aux_hidden"] = torch.full_like(item["aux_hidden"], float("nan"))
        return item

    monkeypatch.setattr(ShardedSamples, "__getitem__", poisoned)
    return sorted(samples)


def test_a_nan_loss_stops_the_run_naming_the_step_its_samples_and_the_last_good_checkpoint(
    monkeypatch, train_store, tmp_path
):
    """What was logged before the stop reaches metrics.jsonl and TensorBoard alike."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    samples = poison(monkeypatch, train_store, step=3)
    with pytest.raises(ValueError) as err:
        run(config(train_store, tmp_path, "max_steps=5", "save_every=2", "report_to=tensorboard"))
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(
        f"step 3: loss is nan and the gradient norm is nan (samples {', '.join(map(str, samples))} of {train_store}"
    )
    assert message.endswith(f"the last good checkpoint is {tmp_path / 'checkpoint-2'}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2", "metrics.jsonl", "tensorboard"]  # no final
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    events = EventAccumulator(str(tmp_path / "tensorboard" / "run"))
    events.Reload()
    logged = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert logged == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in rows]  # float32 in TensorBoard


def test_a_run_that_fails_before_writing_anything_leaves_no_output_dir(monkeypatch, train_store, tmp_path):
    poison(monkeypatch, train_store, step=1)
    with pytest.raises(ValueError, match=r"^step 1: loss is nan .*no checkpoint was saved$"):
        run(config(train_store, tmp_path / "run", "max_steps=2", "report_to=tensorboard"))
    assert not (tmp_path / "run").exists()


def test_a_head_with_nan_is_never_saved(monkeypatch, train_store, tmp_path):
    """Should a non-finite step get through (DeepSpeed steps inside backward), the checkpoint is refused."""
    poison(monkeypatch, train_store, step=1)
    monkeypatch.setattr("eagle_train.trainer.refuse_non_finite_step", lambda *a: None)
    with pytest.raises(ValueError, match=r"^step 1: the head holds non-finite values \(nan in fc.weight, .*not saving"):
        run(config(train_store, tmp_path, "max_steps=1"))
    assert not list(tmp_path.glob("checkpoint-*")) and not (tmp_path / "final").exists()


def test_the_scripts_say_a_refusal_from_inside_train_in_one_line(monkeypatch, train_store, tmp_path):
    (tmp_path / "checkpoint-3").mkdir()
    (tmp_path / "checkpoint-3" / STATE_FILE).write_text("{}")
    for script in ("train_eagle3", "train_peagle"):
        with pytest.raises(SystemExit, match=r"^error: output_dir .* holds checkpoints of an earlier run") as err:
            load_script(f"{script}.py").main([f"data_path={train_store}", f"output_dir={tmp_path}", "report_to=none"])
        assert "\n" not in str(err.value)
    poison(monkeypatch, train_store, step=1)
    with pytest.raises(SystemExit, match=r"^error: step 1: loss is nan"):
        load_script("train_eagle3.py").main([*overrides_of(train_store, tmp_path / "run"), "max_steps=1"])


def overrides_of(data_path, out) -> list[str]:
    return [f"data_path={data_path}", f"output_dir={out}", "tokens_per_batch=128", "max_length=128", "eval_fraction=0"]


@pytest.fixture(scope="module")
def stopped_run(train_store, tmp_path_factory):
    """A run of 4 steps stopped after step 3, a checkpoint after every step, and its loss curve."""
    out = tmp_path_factory.mktemp("stopped") / "run"
    first = run(config(train_store, out, "max_steps=4", "save_every=1", "keep_checkpoints=4", "stop_after_step=3"))
    return out, losses(first)


DAMAGE = [
    (STATE_FILE, b"", f"{STATE_FILE} is empty"),
    (STATE_FILE, b"{not json", f"{STATE_FILE} is not JSON"),
    ("head/model.safetensors", None, "head/model.safetensors is missing"),
    ("head/model.safetensors", "half", "head/model.safetensors is truncated or unreadable"),
    ("scheduler.pt", None, "scheduler.pt is missing"),
    ("optimizer.pt", "half", "optimizer.pt is truncated or unreadable"),
    ("rng-rank0.pt", None, "rng-rank0.pt is missing"),
]


@pytest.mark.parametrize("name, damage, reason", DAMAGE)
def test_a_damaged_checkpoint_says_why(stopped_run, tmp_path, name, damage, reason):
    import shutil

    ckpt = shutil.copytree(stopped_run[0] / "checkpoint-2", tmp_path / "checkpoint-2")
    assert checkpoint_damage(ckpt) == ""
    file = ckpt / name
    if damage is None:
        file.unlink()
    else:
        file.write_bytes(damage if damage != "half" else file.read_bytes()[: file.stat().st_size // 2])
    assert checkpoint_damage(ckpt).startswith(reason)


def test_resume_auto_skips_a_damaged_newest_checkpoint_and_metrics_keep_each_step_once(
    stopped_run, train_store, tmp_path, capsys
):
    import shutil

    out = shutil.copytree(stopped_run[0], tmp_path / "run")
    (out / "checkpoint-3" / STATE_FILE).write_text("")
    with pytest.raises(ValueError, match=rf"checkpoint-3 cannot be resumed: {STATE_FILE} is empty; resume from"):
        run(config(train_store, out, "max_steps=4", f"resume={out / 'checkpoint-3'}"))
    resumed = run(config(train_store, out, "max_steps=4", "save_every=1", "keep_checkpoints=4", "resume=auto"))
    assert f"skipping {out / 'checkpoint-3'}: {STATE_FILE} is empty" in capsys.readouterr().out
    assert losses(resumed)[0] == stopped_run[1][2]  # step 3 again, from checkpoint-2
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["split"] == "train"] == [1, 2, 3, 4]
    assert [r["loss"] for r in rows if r["split"] == "train"][:2] == stopped_run[1][:2]


def test_rotation_after_passing_over_a_damaged_newer_checkpoint_keeps_the_one_just_saved(
    stopped_run, train_store, tmp_path
):
    """A damaged checkpoint-9 (another run's, cut short) is newer than anything this run saves: rotating by step
    alone kept it and deleted checkpoint-4 as soon as it was written, and with it the final head's source."""
    import shutil

    out = shutil.copytree(stopped_run[0], tmp_path / "run")
    shutil.copytree(out / "checkpoint-3", out / "checkpoint-9")
    (out / "checkpoint-9" / STATE_FILE).write_text("")
    run(config(train_store, out, "max_steps=4", "save_every=1", "keep_checkpoints=1", "resume=auto"))
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-9"]
    assert (out / "final" / "model.safetensors").is_file()
