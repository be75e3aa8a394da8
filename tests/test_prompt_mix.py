"""scripts/bench/prompt_mix.py: two subsets chosen by prompt, each a store of the source's samples bit for bit."""

import json
import shutil

import torch
from conftest import load_script, with_train_vocab_map

from eagle_train.store import ShardedSamples


def test_prompt_kinds_and_subsets():
    mix = load_script("bench/prompt_mix.py")
    assert mix.prompt_kind("Fix this Python function:\n```def f(): pass```") == "code"
    assert mix.prompt_kind("A pen costs $3. How many pens can I buy with 12 dollars?") == "math"
    assert mix.prompt_kind("Write a haiku about rain.") == "other"
    kinds = ["other", "code", "other", "math", "other"]
    assert mix.subsets(kinds, 3) == {"natural": [0, 1, 2], "domain": [0, 1, 3]}


def test_subset_stores_hold_the_source_samples(small_store, tmp_path):
    mix = load_script("bench/prompt_mix.py")
    src = with_train_vocab_map(shutil.copytree(small_store, tmp_path / "src"))
    mix.main(["--store", str(src), "--out", str(tmp_path / "mix"), "--num-samples", "2"])
    source = ShardedSamples(src, dtype=torch.bfloat16)
    for name in ("natural", "domain"):
        subset = ShardedSamples(tmp_path / "mix" / name / "store", dtype=torch.bfloat16)
        ids = json.loads((tmp_path / "mix" / name / "source_samples.json").read_text())
        assert len(subset) == 2
        for k, i in enumerate(ids):
            got, want = subset[k], source[i]
            assert got.keys() == want.keys() and all(torch.equal(got[key], want[key]) for key in want)
        assert (tmp_path / "mix" / name / "store" / "vocab_map.safetensors").read_bytes() == (
            src / "vocab_map.safetensors"
        ).read_bytes()
