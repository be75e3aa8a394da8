"""The hidden-state store format: round trips, fp8, vocab map, and refusing another target's store."""

import copy
import hashlib
import json
import pickle
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from eagle_train.files import write_json
from eagle_train.store import (
    HIDDEN_FORMAT,
    MANIFEST,
    ShardedSamples,
    StoreWriter,
    check_store_matches,
    finalize_manifest,
    read_manifest,
    read_vocab_map,
    shard_name,
    target_fingerprint,
    target_identity,
    write_vocab_map,
)

H = 16


def fake_samples(lengths, seed=0, h=H):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        # low / mid / high layers of very different scale, like a real target's
        aux = torch.cat([torch.randn(n, h, generator=g) * s for s in (0.05, 3.0, 400.0)], dim=-1)
        out.append(
            {
                "input_ids": torch.randint(0, 1000, (n,), generator=g),
                "loss_mask": torch.rand(n, generator=g) > 0.4,
                "aux_hidden": aux,
                "final_hidden": torch.randn(n, h, generator=g) * 2,
            }
        )
    return out


def write_store(path, samples, dtype, per_shard=2):
    with StoreWriter(path, dtype) as w:
        for k in range(0, len(samples), per_shard):
            w.add_shard(k // per_shard, samples[k : k + per_shard], range(k, min(k + per_shard, len(samples))))
    return finalize_manifest(
        path,
        {
            "format": HIDDEN_FORMAT,
            "dtype": dtype,
            "aux_layer_ids": [2, 15, 27],
            "target": {"name": "t", "num_hidden_layers": 30, "hidden_size": H},
        },
    )


def rel_err(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("dtype,tol", [("float32", 0.0), ("bfloat16", 0.005), ("float8_e4m3fn", 0.05)])
def test_round_trip(tmp_path, dtype, tol):
    samples = fake_samples([5, 9, 3, 7, 1])
    manifest = write_store(tmp_path, samples, dtype)
    assert manifest["num_samples"] == 5 and manifest["num_tokens"] == 25 and len(manifest["shards"]) == 3
    data = ShardedSamples(tmp_path)
    assert data.has_hidden and len(data) == 5 and data.lengths() == [5, 9, 3, 7, 1]
    for i, ref in enumerate(samples):
        item = data[i]
        assert item["input_ids"].dtype == torch.int64 and torch.equal(item["input_ids"], ref["input_ids"])
        assert item["loss_mask"].dtype == torch.bool and torch.equal(item["loss_mask"], ref["loss_mask"])
        for key in ("aux_hidden", "final_hidden"):
            assert item[key].dtype == torch.float32 and item[key].shape == ref[key].shape
            assert rel_err(item[key], ref[key]) <= tol
        # every aux layer keeps its own precision (per-token, per-layer scales), even the tiny low one
        for j in range(3):
            sl = slice(j * H, (j + 1) * H)
            assert rel_err(item["aux_hidden"][:, sl], ref["aux_hidden"][:, sl]) <= max(tol, 1e-7)
    assert torch.equal(data[-1]["input_ids"], samples[-1]["input_ids"])
    with pytest.raises(IndexError):
        data[5]
    assert ShardedSamples(tmp_path, dtype=torch.bfloat16)[0]["aux_hidden"].dtype == torch.bfloat16
    clone = pickle.loads(pickle.dumps(data))  # DataLoader workers started by spawn get a pickled copy
    assert torch.equal(clone[3]["aux_hidden"], data[3]["aux_hidden"])


def test_shards_get_the_mode_of_any_new_file(tmp_path):
    """A store is shared: safetensors alone writes owner-only files; we follow the umask like `open`."""
    write_store(tmp_path, fake_samples([3, 4]), "bfloat16", per_shard=1)
    (tmp_path / "plain.txt").write_text("x")
    expected = (tmp_path / "plain.txt").stat().st_mode & 0o777
    assert [p.stat().st_mode & 0o777 for p in sorted(tmp_path.glob("shard-*"))] == [expected] * 4  # and checksums


def test_fp8_halves_the_bytes(tmp_path):
    samples = fake_samples([64, 64], h=64)  # per token: bf16 8H + 5 bytes, fp8 4H + 4 scales + 5 bytes
    sizes = {}
    for dtype in ("bfloat16", "float8_e4m3fn"):
        write_store(tmp_path / dtype, samples, dtype)
        sizes[dtype] = (tmp_path / dtype / shard_name(0)).stat().st_size
        with safe_open(str(tmp_path / dtype / shard_name(0)), framework="pt") as f:
            assert f.get_slice("aux_hidden").get_dtype() == {"bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3"}[dtype]
            assert f.get_slice("input_ids").get_dtype() == "I32"
            keys = set(f.keys())
        if dtype == "float8_e4m3fn":
            assert {"aux_scale", "final_scale"} <= keys
    assert sizes["float8_e4m3fn"] < 0.6 * sizes["bfloat16"]


def test_writer_error_surfaces(tmp_path):
    bad = fake_samples([3, 4])
    bad[1]["final_hidden"] = torch.randn(4, H + 1)  # cannot be concatenated with sample 0
    with pytest.raises(RuntimeError, match="writing a shard"):
        with StoreWriter(tmp_path) as w:
            w.add_shard(0, bad, [0, 1])
    assert not (tmp_path / shard_name(0)).exists()


def test_tokenized_dataset_and_vocab_map(tmp_path):
    samples = [{k: s[k] for k in ("input_ids", "loss_mask")} for s in fake_samples([4, 6])]
    with StoreWriter(tmp_path) as w:
        w.add_shard(0, samples, [0, 1])
    finalize_manifest(tmp_path, {"format": "eagle-tokenized", "target": {"vocab_size": 1000}})
    t2d = torch.zeros(1000, dtype=torch.bool)
    t2d[[0, 5, 10]] = True
    write_vocab_map(tmp_path, torch.tensor([0, 4, 8]), t2d, torch.arange(1000))
    data = ShardedSamples(tmp_path)
    assert not data.has_hidden and set(data[1]) == {"input_ids", "loss_mask"} and len(data[1]["input_ids"]) == 6
    vmap = read_vocab_map(tmp_path)
    assert vmap["d2t"].dtype == torch.int64 and vmap["t2d"].dtype == torch.bool and vmap["counts"].dtype == torch.int64
    assert vmap["d2t"].tolist() == [0, 4, 8] and len(vmap["t2d"]) == 1000
    with pytest.raises(FileNotFoundError, match="eagle-prep vocab"):
        read_vocab_map(tmp_path / "nothing-here")


def test_unfinished_or_foreign_directories_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="no manifest.json"):
        ShardedSamples(tmp_path)
    write_json(tmp_path / MANIFEST, {"format": HIDDEN_FORMAT, "complete": False})
    with pytest.raises(ValueError, match="has not finished"):
        ShardedSamples(tmp_path)
    (tmp_path / MANIFEST).write_text(json.dumps({"format": "something-else", "complete": True}))
    with pytest.raises(ValueError, match="unknown format"):
        read_manifest(tmp_path)


def config(name="/cache/targets/SmolLM2-135M-Instruct.Q4_1-e9965bdc7643", layers=30, hidden=576, vocab=49152):
    return SimpleNamespace(
        _name_or_path=name, model_type="llama", num_hidden_layers=layers, hidden_size=hidden, vocab_size=vocab
    )


def test_check_store_matches(small_store, smollm2):
    manifest = ShardedSamples(small_store).manifest
    check_store_matches(manifest, smollm2[0].config)  # the target that made it
    for key in ("", "-tf4", "-tf5", "-tf5-r2"):  # moved cache, conversions by other transformers and revisions
        check_store_matches(manifest, config(name=f"/elsewhere/SmolLM2-135M-Instruct.Q4_1-0123456789ab{key}"))
    check_store_matches(manifest, smollm2[0].config, aux_layer_ids=(2, 15, 27))
    with pytest.raises(ValueError, match=r"Llama-3\.2-1B.*16 layers.*hidden 2048.*Capture a new store"):
        check_store_matches(manifest, config("meta-llama/Llama-3.2-1B", layers=16, hidden=2048, vocab=128256))
    with pytest.raises(ValueError, match="name: store 'SmolLM2-135M-Instruct.Q4_1' vs target 'SmolLM2-135M-Base'"):
        check_store_matches(manifest, config("HuggingFaceTB/SmolLM2-135M-Base"))  # same shapes, other model
    with pytest.raises(ValueError, match=r"aux layers \[2, 15, 27\].*\[3, 15, 26\]"):
        check_store_matches(manifest, smollm2[0].config, aux_layer_ids=(3, 15, 26))


def damage(path, offset_from_end=None, size=4096, byte=None):
    """Flip (or set to `byte`) `size` bytes in the middle of a file, or `offset_from_end` bytes before its end."""
    data = bytearray(path.read_bytes())
    start = len(data) // 2 if offset_from_end is None else len(data) - offset_from_end
    for k in range(start, start + size):
        data[k] = byte if byte is not None else data[k] ^ 0xFF
    path.write_bytes(bytes(data))


def test_each_shard_carries_its_sha256_beside_it_and_in_the_manifest(tmp_path):
    manifest = write_store(tmp_path, fake_samples([5, 9, 3]), "bfloat16")
    for entry in manifest["shards"]:
        shard = tmp_path / entry["file"]
        digest = hashlib.sha256(shard.read_bytes()).hexdigest()
        assert entry["sha256"] == digest and entry["bytes"] == shard.stat().st_size
        assert shard.with_suffix(".sha256").read_text() == f"{digest}  {shard.name}\n"  # `sha256sum -c` reads it


def test_a_damaged_shard_is_refused_on_first_read_naming_it(tmp_path):
    write_store(tmp_path, fake_samples([50, 60, 70, 80]), "bfloat16")
    damage(tmp_path / shard_name(1))  # inside the hidden states: every tensor still parses
    data = ShardedSamples(tmp_path)
    assert data[0]["input_ids"].shape == (50,)  # shard 0 is whole
    with pytest.raises(ValueError, match=r"shard-00001.safetensors is damaged: its sha256 differs.*rerun"):
        data[2]
    with pytest.raises(ValueError, match="shard-00001.safetensors is damaged"):
        data.tokens(3)  # token reads are checked too


def test_truncated_or_missing_shards_are_named_in_one_line(tmp_path):
    write_store(tmp_path, fake_samples([50, 60, 70, 80, 90, 10]), "bfloat16")
    shard = tmp_path / shard_name(1)
    whole = shard.read_bytes()
    for cut in (whole[:-100], whole[:50], whole + b"\0"):  # the data or the header cut short, bytes appended
        shard.write_bytes(cut)
        with pytest.raises(ValueError, match=r"shard-00001.safetensors \(store shard\) is unreadable \(.*\): rerun"):
            ShardedSamples(tmp_path)
    (tmp_path / shard_name(2)).unlink()
    shard.unlink()
    with pytest.raises(FileNotFoundError, match="shard-00001.safetensors is missing"):
        ShardedSamples(tmp_path)


def test_dataloader_workers_check_each_shard_once_per_run(tmp_path):
    """Workers start anew each epoch; what one of them checked stays checked for the parent and the next ones."""
    write_store(tmp_path, fake_samples([5, 9, 3, 7]), "bfloat16")
    data = ShardedSamples(tmp_path)
    assert not data.verified.any()
    loader = torch.utils.data.DataLoader(data, batch_size=None, num_workers=1, multiprocessing_context="fork")
    assert len(list(loader)) == 4
    assert data.verified.all()


def test_non_finite_hidden_states_are_refused_on_read(tmp_path):
    samples = fake_samples([5, 9, 3])
    samples[1]["aux_hidden"][4, 7] = float("inf")
    write_store(tmp_path, samples, "bfloat16")
    data = ShardedSamples(tmp_path)
    data[0]
    with pytest.raises(ValueError, match=r"shard-00000.safetensors, sample 1 .*1 non-finite values .* in aux_hidden"):
        data[1]


def test_the_fingerprint_names_the_weights_whatever_the_dtype(tiny_llama, tiny_llama_dir):
    from conftest import tiny_target

    from eagle_train.target import files_fingerprint

    model = tiny_llama[0]
    fingerprint = target_fingerprint(model)
    assert target_fingerprint(copy.deepcopy(model).to(torch.bfloat16)) == fingerprint  # fp32 is bf16-exact here
    assert target_fingerprint(tiny_target(seed=1, **model.config.to_diff_dict())) != fingerprint
    assert files_fingerprint(str(tiny_llama_dir)) == fingerprint  # what a serving engine's store records
    manifest = {
        "format": HIDDEN_FORMAT,
        "aux_layer_ids": [1, 2, 3],
        "target": {**target_identity(model.config), "given": "runs/a/tiny", "fingerprint": fingerprint},
    }
    check_store_matches(manifest, model.config, weights_fingerprint=fingerprint)
    check_store_matches(manifest, model.config)  # nothing to compare: the config checks only
    with pytest.raises(ValueError, match=r"'runs/a/tiny' \(weights fingerprint \w+\) .* other weights"):
        check_store_matches(manifest, model.config, weights_fingerprint="0123456789abcdef")


def test_a_damaged_manifest_or_vocab_map_is_named_in_one_line(tmp_path):
    write_store(tmp_path, fake_samples([5, 9]), "bfloat16")
    manifest = tmp_path / MANIFEST
    for text in ("", manifest.read_text()[:40], "[1, 2]"):
        manifest.write_text(text)
        with pytest.raises(
            ValueError, match=r"manifest.json \(store manifest\) is unreadable \(.*\): delete it and rerun"
        ):
            ShardedSamples(tmp_path)
    d2t = torch.tensor([0, 3, 6])  # target ids 0, 4, 8
    t2d = torch.zeros(10, dtype=torch.bool)
    t2d[[0, 4, 8]] = True
    write_vocab_map(tmp_path, d2t, t2d, torch.arange(10))
    assert read_vocab_map(tmp_path)["d2t"].tolist() == [0, 3, 6]
    for bad_d2t, bad_t2d in ((torch.tensor([0, 3, 8]), t2d), (torch.tensor([0, 6, 3]), t2d), (d2t, ~t2d)):
        write_vocab_map(tmp_path, bad_d2t, bad_t2d, torch.arange(10))
        with pytest.raises(ValueError, match=r"vocab_map.safetensors is damaged .*: remake it with `eagle-prep vocab"):
            read_vocab_map(tmp_path)
    vmap = tmp_path / "vocab_map.safetensors"
    vmap.write_bytes(vmap.read_bytes()[:-3])
    with pytest.raises(ValueError, match=r"vocab_map.safetensors \(vocab map\) is unreadable \(.*\): remake it"):
        read_vocab_map(tmp_path)
