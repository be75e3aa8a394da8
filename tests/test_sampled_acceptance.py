"""scripts/bench/sampled_acceptance.py's split of first drafts by the target token they had to match."""

import pytest
import torch
from conftest import load_script

sampled = load_script("bench/sampled_acceptance.py")


def test_each_first_draft_counts_once_in_the_first_class_its_token_falls_in():
    text = {7: "7", 8: " walks", 20: "42", 21: ", ", 11: " the", 30: " cat", 31: "\n"}
    in_draft = torch.ones(40, dtype=torch.bool)
    in_draft[[7, 8]] = False
    input_ids = torch.tensor([1, 11, 20, 5, 9, 9, 9, 9])
    first = [  # (position, target token, accepted)
        (2, 7, False),  # a digit outside the draft vocabulary: outside first
        (3, 8, False),  # outside, though not a digit
        (3, 20, True),  # digits, though 20 is at position 2, before 3
        (4, 21, True),  # punctuation (the space stripped)
        (4, 31, False),  # whitespace alone
        (5, 11, True),  # " the" is at position 1: a repeat
        (1, 11, False),  # ... but not before position 1
        (6, 30, True),  # other
    ]
    counts = sampled.by_token_class(first, input_ids, in_draft, lambda ids: text[ids[0]])
    assert counts == {
        "outside the draft vocabulary": [0, 2],
        "digits": [1, 1],
        "punctuation or space": [1, 2],
        "repeats an earlier token": [1, 1],
        "other": [1, 2],
    }


def test_a_missing_head_is_refused_in_one_line_before_the_target_loads(train_store, tmp_path, monkeypatch):
    monkeypatch.setattr(sampled, "load_target", lambda *a, **k: pytest.fail("loaded the target"))
    with pytest.raises(SystemExit, match=r"draft head .*checkpoint-535 does not exist: give a head directory"):
        sampled.main(["--store", str(train_store), "--head", str(tmp_path / "checkpoint-535")])
