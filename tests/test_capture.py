"""Hidden-state capture on SmolLM2: exactness, resume after a kill, two processes, fp8, refusals."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import assert_same_forward, free_port
from safetensors import safe_open

import data_prep.capture as capture_mod
from data_prep.capture import capture, pad_batch, plan_shards
from eagle_train.store import ShardedSamples, read_vocab_map, shard_name
from eagle_train.target import SMOLLM2

REPO = Path(__file__).resolve().parents[1]


def run_capture(smollm2, data, out, **kw):
    model, tok = smollm2
    kw = {"token_budget": 160, "shard_tokens": 100, **kw}
    return capture(model, data, out, target_name=SMOLLM2, pad_id=tok.pad_token_id, progress=False, **kw)


def assert_same_store(a, b):
    """Bitwise equal: the same process captured both with the same batches."""
    sa, sb = ShardedSamples(a), ShardedSamples(b)
    assert len(sa) == len(sb) and sa.lengths() == sb.lengths()
    for i in range(len(sa)):
        x, y = sa[i], sb[i]
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def assert_equivalent_store(a, b, config):
    """The same tokens and masks, and hidden states equal up to the rounding of another thread count or batch
    shape (fp32 reductions in another order) and of the store's dtype."""
    sa, sb = ShardedSamples(a, dtype=torch.float32), ShardedSamples(b, dtype=torch.float32)
    stored = getattr(torch, sb.manifest["dtype"])  # read back as fp32; rounded to this when written
    assert len(sa) == len(sb) and sa.lengths() == sb.lengths() and sa.manifest["dtype"] == sb.manifest["dtype"]
    for i in range(len(sa)):
        x, y = sa[i], sb[i]
        assert x.keys() == y.keys()
        for k in x:
            if x[k].is_floating_point():
                assert_same_forward(x[k], y[k], config, stored_dtype=stored)
            else:
                assert torch.equal(x[k], y[k]), k


def test_plan_bounds_padded_tokens_and_covers_every_sample():
    lengths = [5, 50, 7, 300, 12, 12, 40, 3]
    plan = plan_shards(lengths, token_budget=64, shard_tokens=60)
    batches = [b for shard in plan for b in shard]
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 64
    assert [lengths[b[0]] for b in batches] == sorted((lengths[b[0]] for b in batches), reverse=True)
    assert plan == plan_shards(lengths, token_budget=64, shard_tokens=60)  # deterministic


def test_capture_equals_output_hidden_states_batched_and_padded(smollm2, small_tokenized, tmp_path):
    model, tok = smollm2
    manifest, stats = run_capture(
        smollm2, small_tokenized, tmp_path / "s", dtype="float32", token_budget=512, shard_tokens=10**6
    )
    assert stats["shards"] == 1 and manifest["aux_layer_ids"] == [2, 15, 27]
    store, source = ShardedSamples(tmp_path / "s"), ShardedSamples(small_tokenized)
    plan = plan_shards(source.lengths(), 512, 10**6)
    batches = plan[0]
    assert any(len({source.lengths()[i] for i in b}) > 1 for b in batches)  # some batch really pads
    by_id = {}
    with safe_open(str(tmp_path / "s" / shard_name(0)), framework="pt") as f:
        for pos, sid in enumerate(f.get_tensor("sample_ids").tolist()):
            by_id[sid] = store[pos]
    assert sorted(by_id) == list(range(len(source)))
    worst = 0.0
    for batch in batches:  # the same padded batches through the plain HF path
        samples = [source.tokens(i) for i in batch]
        ids, mask = pad_batch(samples, tok.pad_token_id, "cpu")
        hs = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
        for b, i in enumerate(batch):
            n = len(samples[b]["input_ids"])
            got = by_id[i]
            assert torch.equal(got["input_ids"], samples[b]["input_ids"])
            assert torch.equal(got["loss_mask"], samples[b]["loss_mask"])
            ref_aux = torch.cat([hs[2][b, :n], hs[15][b, :n], hs[27][b, :n]], dim=-1)
            worst = max(
                worst,
                (got["aux_hidden"] - ref_aux).abs().max().item(),
                (got["final_hidden"] - hs[-1][b, :n]).abs().max().item(),
            )
    assert worst <= 1e-4
    # and each sample alone, unpadded (relative tolerance: SmolLM2's massive activation is ~24000)
    for i in (0, 5):
        alone = model(source.tokens(i)["input_ids"][None], output_hidden_states=True).hidden_states
        torch.testing.assert_close(
            by_id[i]["aux_hidden"], torch.cat([alone[2], alone[15], alone[27]], -1)[0], rtol=1e-5, atol=1e-4
        )
    assert torch.equal(read_vocab_map(tmp_path / "s")["d2t"], read_vocab_map(small_tokenized)["d2t"])


def test_killed_capture_resumes_to_the_same_store(smollm2, small_tokenized, small_store, tmp_path, monkeypatch):
    """`small_store` is the uninterrupted run with the same settings (bf16, budget 160, 100 tokens/shard)."""
    real, calls = capture_mod.target_hidden_states, []
    plan = plan_shards(ShardedSamples(small_tokenized).lengths(), 160, 100)
    assert len(plan) >= 3
    kill_at = len(plan[0]) + len(plan[1]) + 1  # die in the middle of shard 2

    def dying(*args, **kwargs):
        calls.append(1)
        if len(calls) == kill_at:
            raise KeyboardInterrupt("killed")
        return real(*args, **kwargs)

    monkeypatch.setattr(capture_mod, "target_hidden_states", dying)
    out = tmp_path / "s"
    with pytest.raises(KeyboardInterrupt):
        run_capture(smollm2, small_tokenized, out)
    kept = {name: (out / name).stat().st_mtime_ns for name in (shard_name(0), shard_name(1))}
    assert not (out / shard_name(2)).exists()
    (out / ".tmp-999-shard-00002.safetensors").write_bytes(b"torn")  # what a hard kill mid-write leaves
    with pytest.raises(ValueError, match="has not finished"):
        ShardedSamples(out)
    calls.clear()
    manifest, stats = run_capture(smollm2, small_tokenized, out)
    assert stats["shards"] == len(plan) - 2
    assert len(calls) == sum(len(s) for s in plan[2:])  # finished shards were not recomputed
    assert {name: (out / name).stat().st_mtime_ns for name in kept} == kept
    assert manifest["num_samples"] == len(ShardedSamples(small_tokenized))
    assert_same_store(out, small_store)
    assert json.loads((out / "manifest.json").read_text())["shards"] == ShardedSamples(small_store).manifest["shards"]


def test_refuses_to_mix_targets_layers_dtypes(smollm2, tiny_llama, small_tokenized, small_store):
    with pytest.raises(ValueError, match=r"aux layers \[2, 15, 27\].*\[3, 15, 27\]"):
        run_capture(smollm2, small_tokenized, small_store, aux_layer_ids=(3, 15, 27))
    with pytest.raises(ValueError, match="dtype='bfloat16', not 'float8_e4m3fn'"):
        run_capture(smollm2, small_tokenized, small_store, dtype="float8_e4m3fn")
    with pytest.raises(ValueError, match="plan="):
        run_capture(smollm2, small_tokenized, small_store, token_budget=512)
    model, tok = tiny_llama
    with pytest.raises(ValueError, match=r"4 layers, hidden 32.*Capture a new store"):
        capture(
            model,
            small_tokenized,
            small_store,
            target_name="tiny",
            pad_id=2,
            progress=False,
            token_budget=160,
            shard_tokens=100,
        )
    with pytest.raises(ValueError, match="hidden-state store; capture reads a tokenized dataset"):
        run_capture(smollm2, small_store, small_store.parent / "x")
    assert_same_store(small_store, small_store)  # untouched and still readable


def test_fp8_capture_round_trip(smollm2, small_tokenized, small_store, tmp_path):
    run_capture(smollm2, small_tokenized, tmp_path / "fp8", dtype="float8_e4m3fn")
    ref, fp8 = ShardedSamples(small_store), ShardedSamples(tmp_path / "fp8")  # vs the bf16 store
    assert fp8.manifest["dtype"] == "float8_e4m3fn"
    for key in ("aux_hidden", "final_hidden"):
        a = torch.cat([fp8[i][key] for i in range(len(fp8))])
        b = torch.cat([ref[i][key] for i in range(len(ref))])
        rel = ((a - b).norm(dim=-1) / b.norm(dim=-1)).max().item()  # worst token
        assert 0 < rel < 0.05, key
    assert torch.equal(fp8[3]["input_ids"], ref[3]["input_ids"])


def test_two_processes_under_accelerate_make_one_store(smollm2, small_tokenized, small_store, tmp_path):
    out = tmp_path / "s2"
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--main_process_port",
        str(free_port()),
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "-m",
        "data_prep.cli",
        "capture",
        "--target",
        SMOLLM2,
        "--data",
        str(small_tokenized),
        "--out",
        str(out),
        "--token-budget",
        "160",
        "--shard-tokens",
        "100",
        "--engine-dtype",
        "float32",  # the store it is compared with is fp32's
        "--no-progress",
    ]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    assert "torch.distributed world size 2, backend gloo" in log  # a real 2-process group, not two worlds
    assert "rank 0: captured" in log and "rank 1: captured" in log
    manifest = ShardedSamples(out).manifest
    assert manifest["num_processes"] == 2
    assert {s["rank"] for s in manifest["shards"]} == {0, 1}
    assert [s["rank"] for s in manifest["shards"]] == [k % 2 for k in range(len(manifest["shards"]))]
    # each process runs on half the threads, so fp32 reductions round differently than in one process
    assert_equivalent_store(out, small_store, smollm2[0].config)


def test_a_rerun_recomputes_only_a_damaged_shard(smollm2, small_tokenized, small_store, tmp_path, monkeypatch, capsys):
    out = tmp_path / "s"
    shutil.copytree(small_store, out)
    shard = out / shard_name(1)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 4096] = b"\xff" * 4096
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="shard-00001.safetensors is damaged"):
        [ShardedSamples(out)[i] for i in range(len(ShardedSamples(out)))]
    real, calls = capture_mod.target_hidden_states, []
    monkeypatch.setattr(capture_mod, "target_hidden_states", lambda *a, **k: calls.append(1) or real(*a, **k))
    manifest, stats = run_capture(smollm2, small_tokenized, out)
    plan = plan_shards(ShardedSamples(small_tokenized).lengths(), 160, 100)
    assert stats["shards"] == 1 and len(calls) == len(plan[1])  # shard 1's batches only
    assert f"{shard} is damaged (its sha256 differs" in capsys.readouterr().out
    assert_same_store(out, small_store)


def test_non_finite_hidden_states_are_refused_at_capture(smollm2, small_tokenized, tmp_path, monkeypatch):
    real = capture_mod.target_hidden_states

    def overflowing(model, ids, mask, layers):
        aux, final = real(model, ids, mask, layers)
        lengths = mask.sum(1)
        final[0, int(lengths[0]) - 1, 3] = float("inf")  # the last real token of the batch's first sample
        if len(lengths) > 1 and lengths[-1] < ids.shape[1]:
            aux[-1, -1] = float("nan")  # padding is never stored: not a refusal
        return aux, final

    monkeypatch.setattr(capture_mod, "target_hidden_states", overflowing)
    first = plan_shards(ShardedSamples(small_tokenized).lengths(), 160, 100)[0][0][0]
    with pytest.raises(ValueError, match=rf"non-finite hidden states \(inf or nan\) for samples \[{first}\] of the"):
        run_capture(smollm2, small_tokenized, tmp_path / "s")
    assert not list((tmp_path / "s").glob("shard-*"))


def test_independent_runs_with_shards_make_one_store(small_tokenized, small_store, tmp_path, capsys):
    """`capture --shard 1/2` and `--shard 0/2`, one after the other as on two machines, fill one store; the run
    that ends last finishes it."""
    from data_prep.cli import main

    out = tmp_path / "shared"
    common = ["capture", "--data", str(small_tokenized), "--out", str(out), "--token-budget", "160"]
    common += ["--shard-tokens", "100", "--engine-dtype", "float32", "--no-progress"]
    main([*common, "--shard", "1/2"])
    assert "shard 1/2 of" in capsys.readouterr().out
    assert not json.loads((out / "manifest.json").read_text())["complete"]
    main([*common, "--shard", "0/2"])
    assert "store " in capsys.readouterr().out
    manifest = ShardedSamples(out).manifest
    assert [s["rank"] for s in manifest["shards"]] == [k % 2 for k in range(len(manifest["shards"]))]
    assert_same_store(out, small_store)
    with pytest.raises(SystemExit, match="--cpu-kv-cache-gib: vLLM's settings; add --engine vllm"):
        main([*common, "--cpu-kv-cache-gib", "4"])
