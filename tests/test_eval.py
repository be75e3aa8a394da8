"""`eagle-eval` end to end: JSON, plot, AL recounted from the per-prompt token ids, clear errors."""

import json
import sys

import pytest
import torch
from conftest import tiny_draft_config

from eagle_cli.evaluate import main
from eagle_train.checkpoint import load_draft_head
from eagle_train.methods.eagle3.head import Eagle3Head


def recount_al(record):
    """AL from the per-prompt results only: every new token but each turn's prefill token came
    from a verification forward."""
    turns = [t for p in record["prompts"] for t in p["turns"]]
    return sum(len(t["spec"]["output_ids"]) - 1 for t in turns) / sum(t["spec"]["forwards"] for t in turns)


def test_eval_tiny_target_mt_bench_two_turns(tiny_llama_dir, tiny_head_dir, tmp_path, capsys):
    out = tmp_path / "res" / "results.json"
    main(
        [
            "--target",
            str(tiny_llama_dir),
            "--draft",
            str(tiny_head_dir),
            "--bench",
            "mt_bench",
            "--num-prompts",
            "2",
            "--max-new-tokens",
            "10",
            "--tree",
            "3,2,4",
            "--out",
            str(out),
        ]
    )
    saved = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 1000
    assert [len(p["turns"]) for p in saved["prompts"]] == [2, 2]  # MT-Bench asks its second turn
    assert saved["summary"]["acceptance_length"] == pytest.approx(recount_al(saved), abs=1e-12)
    assert saved["summary"]["turns_identical_to_plain"] == 4  # greedy: spec == plain
    turns = [t for p in saved["prompts"] for t in p["turns"]]
    assert [(t["spec"]["divergence"], t["ngram"]["divergence"]) for t in turns] == [(None, None)] * 4
    assert saved["summary"]["turns_parting_unexplained"] == saved["summary"]["ngram"]["turns_parting_at_ties"] == 0
    assert len(saved["summary"]["acceptance_per_position"]) == 3
    assert "acceptance length (AL)" in capsys.readouterr().out


def test_eval_without_matplotlib_prints_the_table_and_skips_the_plot(
    tiny_llama_dir, tiny_head_dir, tmp_path, monkeypatch, capsys
):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    out = tmp_path / "results.json"
    main(
        [
            "--target",
            str(tiny_llama_dir),
            "--draft",
            str(tiny_head_dir),
            "--bench",
            "gsm8k",
            "--num-prompts",
            "1",
            "--max-new-tokens",
            "4",
            "--chain",
            "2",
            "--out",
            str(out),
        ]
    )
    printed = capsys.readouterr().out
    assert "acceptance length (AL)" in printed
    assert "plot skipped: matplotlib is not installed (pip install 'eagle-train[plot]'" in printed
    assert out.is_file() and not out.with_suffix(".png").exists()


def test_eval_smollm2_random_head(smollm2, tmp_path):
    torch.manual_seed(0)
    Eagle3Head.from_target(smollm2[0]).save_pretrained(tmp_path / "head")
    out = tmp_path / "results.json"
    main(
        [
            "--target",
            "smollm2-135m",
            "--draft",
            str(tmp_path / "head"),
            "--bench",
            "humaneval",
            "--num-prompts",
            "1",
            "--max-new-tokens",
            "10",
            "--chain",
            "3",
            "--out",
            str(out),
        ]
    )
    saved = json.loads(out.read_text())
    al = saved["summary"]["acceptance_length"]
    assert al == pytest.approx(recount_al(saved), abs=1e-12)
    assert 1.0 <= al < 1.3  # a random head is (almost) never right
    turn = saved["prompts"][0]["turns"][0]
    assert turn["spec"]["identical"] and turn["spec"]["forwards"] == len(turn["spec"]["output_ids"]) - 1 - sum(
        turn["spec"]["accepted"]
    )


def test_head_for_another_target_is_refused(tiny_head_dir, tmp_path):
    with pytest.raises(SystemExit, match="does not fit this target.*hidden size 32 != target's 576"):
        main(
            [
                "--target",
                "smollm2-135m",
                "--draft",
                str(tiny_head_dir),
                "--bench",
                "gsm8k",
                "--out",
                str(tmp_path / "r.json"),
            ]
        )


def test_head_with_other_vocabulary_is_refused(tiny_llama_dir, tmp_path):
    cfg = tiny_draft_config(vocab_size=32000, draft_vocab_size=1000, target_num_layers=4, aux_layer_ids=(2, 2, 1))
    Eagle3Head(cfg).save_pretrained(tmp_path / "head")
    with pytest.raises(SystemExit, match="vocabulary 32000 != target's 49152"):
        main(["--target", str(tiny_llama_dir), "--draft", str(tmp_path / "head"), "--out", str(tmp_path / "r.json")])


@pytest.mark.parametrize(
    "args, message",
    [
        (["--bench", "no/such/prompts.jsonl"], "neither one of mt_bench, humaneval, gsm8k nor an existing .jsonl"),
        (["--chain", "0"], "chain drafting needs K >= 1"),
        (["--tree", "3,2"], "--tree expects depth,topk,total"),
        (["--tree", "2,2,9"], "proposes only 6 tokens, fewer than total=9"),
        (["--temperature", "-1"], "temperature must be >= 0"),
    ],
)
def test_bad_arguments_are_refused(tiny_llama_dir, tiny_head_dir, tmp_path, args, message):
    with pytest.raises(SystemExit, match=message):
        main(["--target", str(tiny_llama_dir), "--draft", str(tiny_head_dir), "--out", str(tmp_path / "r.json"), *args])


def test_a_head_with_non_finite_values_is_refused(tiny_llama_dir, tiny_head_dir, tmp_path):
    head = load_draft_head(tiny_head_dir)
    with torch.no_grad():
        head.lm_head.weight[0, 0] = float("nan")
    head.save_pretrained(tmp_path / "head")
    with pytest.raises(SystemExit, match=r"head holds non-finite values \(nan in lm_head.weight\).*do not deploy it"):
        main(["--target", str(tiny_llama_dir), "--draft", str(tmp_path / "head"), "--out", str(tmp_path / "r.json")])
