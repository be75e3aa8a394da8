"""scripts/bench/store_subsets.py: subsets chosen by prompt or by answer, each a store of the source's samples bit for
bit."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import load_script, with_train_vocab_map

from eagle_train.store import ShardedSamples


@pytest.fixture
def mix(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "scripts" / "bench"))  # as when run
    return load_script("bench/store_subsets.py")


def test_prompt_kinds_and_subsets(mix):
    assert mix.prompt_kind("Fix this Python function:\n```def f(): pass```") == "code"
    assert mix.prompt_kind("A pen costs $3. How many pens can I buy with 12 dollars?") == "math"
    assert mix.prompt_kind("Write a haiku about rain.") == "other"
    assert mix.is_word(" the") and not mix.is_word(" 42") and not mix.is_word(", ")
    # answer tokens 7 (a word seen before), 7 again, 8 (new), 3 (seen, not a word): 2 of 4
    assert mix.copy_share([7, 5, 3, 7, 7, 8, 3], [0, 0, 0, 1, 1, 1, 1], {5, 7, 8}) == 0.5
    kinds, shares = ["other", "code", "other", "math", "other"], [0.1, 0.0, 0.5, 0.2, 0.3]
    assert mix.subsets(kinds, shares, 3) == {"natural": [0, 1, 2], "domain": [0, 1, 3], "copy": [2, 3, 4]}


def test_subset_stores_hold_the_source_samples(mix, small_store, tmp_path):
    src = with_train_vocab_map(shutil.copytree(small_store, tmp_path / "src"))
    mix.main(["--store", str(src), "--out", str(tmp_path / "mix"), "--num-samples", "2"])
    source = ShardedSamples(src, dtype=torch.bfloat16)
    for name in ("natural", "domain", "copy"):
        subset = ShardedSamples(tmp_path / "mix" / name / "store", dtype=torch.bfloat16)
        ids = json.loads((tmp_path / "mix" / name / "source_samples.json").read_text())
        assert len(subset) == 2
        for k, i in enumerate(ids):
            got, want = subset[k], source[i]
            assert got.keys() == want.keys() and all(torch.equal(got[key], want[key]) for key in want)
        assert (tmp_path / "mix" / name / "store" / "vocab_map.safetensors").read_bytes() == (
            src / "vocab_map.safetensors"
        ).read_bytes()


def test_bad_arguments_are_refused_in_one_line(mix, small_store, small_tokenized, tmp_path, capsys):
    for argv, says in (
        (["--store", str(small_store), "--out", str(tmp_path / "a"), "--num-samples", "0"], "at least 1"),
        (["--store", str(small_store), "--out", str(tmp_path), "--num-samples", "2"], "exists"),
        (["--store", str(tmp_path / "none"), "--out", str(tmp_path / "b"), "--num-samples", "2"], "not a store"),
        (["--store", str(small_tokenized), "--out", str(tmp_path / "c"), "--num-samples", "2"], "tokenized dataset"),
    ):
        with pytest.raises(SystemExit) as err:
            mix.main(argv)
        assert err.value.code == 2
        message = capsys.readouterr().err.strip().splitlines()[-1]
        assert says in message, message
    assert not any((tmp_path / d).exists() for d in "abc")
