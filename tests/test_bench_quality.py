"""scripts/bench/quality.py at toy scale: the trainer's clock leaves out its pauses, one evaluation
point on the tiny random Llama is lossless and complete, the curve is drawn, and a tree asked of a block
drafter is refused before any compute."""

import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import load_script

from eagle_train.checkpoint import load_draft_head
from eagle_train.hidden_states import target_hidden_states
from eagle_train.methods.eagle3.head import Eagle3Head
from inference.drafting import TreeShape
from inference.generate import Runtime

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench" / "quality.py"


@pytest.fixture(scope="module")
def quality():
    return load_script("bench/quality.py")


def test_a_block_drafter_refuses_a_tree_before_any_compute(quality, tmp_path):
    argv = ["--budget", "1", "--out", str(tmp_path / "run"), "--prep", "configs/smollm2_sharegpt.yaml"]
    train = ["--train", str(SCRIPT.parents[2] / "configs" / "dspark_smollm2.yaml")]
    with pytest.raises(SystemExit, match="a DSpark head drafts a chain only"):
        quality.main([*argv, *train, "--tree", "3,2,4"])
    assert not (tmp_path / "run").exists()


def process_state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads process states from /proc")
def test_trainer_clock_leaves_out_pauses(quality, tmp_path):
    trainer = quality.TrainerProcess([sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "log")
    try:
        trainer.pause()
        deadline = time.time() + 5
        while process_state(trainer.proc.pid) != "T" and time.time() < deadline:
            time.sleep(0.05)
        assert process_state(trainer.proc.pid) == "T"
        stopped = trainer.pauses[0][0]
        assert trainer.running_seconds(stopped + 10) == pytest.approx(stopped - trainer.start)  # still paused
        trainer.resume()
        continued = trainer.pauses[0][1]
        assert process_state(trainer.proc.pid) != "T"
        assert trainer.running_seconds(continued + 2) == pytest.approx(stopped - trainer.start + 2)
    finally:
        trainer.kill()
    assert trainer.proc.returncode is not None


def test_one_point_on_the_tiny_llama(quality, tmp_path, tiny_llama_dir, tiny_llama):
    model, _ = tiny_llama
    head = Eagle3Head.from_target(model, draft_vocab_size=500, target=str(tiny_llama_dir))
    head.save_pretrained(tmp_path / "head")
    shapes = {"chain K=2": TreeShape.chain(2), "tree 2,2,3": TreeShape(2, 2, 3)}
    evaluator = quality.Evaluator(str(tiny_llama_dir), "cpu", ["mt_bench", "gsm8k"], 1, shapes, 6, 1, 6)
    summaries, sequences = evaluator(tmp_path / "head")
    walk = evaluator.walk(tmp_path / "head", 2)  # over the first turns' greedy answers, made batched
    (ids, plain), text = sequences["gsm8k"][0], evaluator.walk_texts[tuple(head.config.aux_layer_ids)]["gsm8k"][0]
    assert text["input_ids"].tolist() == ids + plain and text["loss_mask"].sum() == len(plain)
    other = Eagle3Head.from_target(model, draft_vocab_size=500, target=str(tiny_llama_dir), aux_layer_ids=(0, 1, 2))
    assert tuple(other.config.aux_layer_ids) != tuple(head.config.aux_layer_ids)
    other.save_pretrained(tmp_path / "other")
    evaluator.walk(tmp_path / "other", 2)  # a head reading other layers is walked over those layers' states
    again = evaluator.walk_texts[(0, 1, 2)]["gsm8k"][0]
    aux, _ = target_hidden_states(model, again["input_ids"][None], aux_layer_ids=(0, 1, 2))
    torch.testing.assert_close(again["aux_hidden"], aux[0], atol=2e-4, rtol=1e-4)
    assert walk["gsm8k"]["rounds"] == summaries["chain K=2"]["gsm8k"]["verify_forwards"]  # one turn: the same text
    assert set(walk) == {"mt_bench", "gsm8k"} and walk["gsm8k"]["acceptance_length"] >= 1.0
    evaluator.model.to(torch.bfloat16)  # as on a GPU: the head runs in bf16, the target distribution in fp32
    walk16 = evaluator.walk(tmp_path / "head", 2)
    for bench, w in walk.items():  # the same answer tokens covered, in rounds of 1..K+1
        tokens = w["acceptance_length"] * w["rounds"]
        assert walk16[bench]["acceptance_length"] * walk16[bench]["rounds"] == pytest.approx(tokens)
        assert tokens / 3 <= walk16[bench]["rounds"] <= tokens
    evaluator.model.float()
    assert set(summaries) == set(shapes)
    head = load_draft_head(tmp_path / "head", model).eval()
    for name, per_bench in summaries.items():
        assert set(per_bench) == {"mt_bench", "gsm8k"}
        runtime = Runtime(model, head, shapes[name], eos_token_ids=evaluator.eos)
        for bench, s in per_bench.items():
            assert s["turns_identical_to_plain"] == s["turns"]  # greedy speculative decoding is lossless
            # the reference: each turn's prompt decoded by the runtime itself, pooled as eagle-eval pools
            runs = [runtime.generate(ids, 6) for ids, _ in sequences[bench]]
            assert s["acceptance_length"] == sum(map(sum, (r.emitted for r in runs))) / sum(r.forwards for r in runs)
            assert s["accepted_drafts"] == sum(map(sum, (r.accepted for r in runs)))
            assert s["timed_pairs"] == s["turns"] and s["speedup"] > 0  # each turn timed once beside plain
    chain = summaries["chain K=2"]["gsm8k"]  # one turn: the walk's text is the one the chain decoded
    assert walk["gsm8k"]["acceptance_length"] * walk["gsm8k"]["rounds"] == pytest.approx(
        chain["accepted_drafts"] + chain["verify_forwards"]
    )
    assert summaries["chain K=2"]["mt_bench"]["turns"] == 2  # both MT-Bench turns
    assert [len(out) for _, out in sequences["gsm8k"]] == [6]
    top1 = evaluator.target_top1_probability(sequences)
    with torch.no_grad():  # the reference: the target's top-1 probability before each of its tokens, one at a time
        probs = {
            bench: [
                evaluator.model(torch.tensor([ids + out[:j]])).logits[0, -1].softmax(-1).max().item()
                for ids, out in turns
                for j in range(len(out))
            ]
            for bench, turns in sequences.items()
        }
    for bench, p in probs.items():
        assert top1[bench] == pytest.approx(sum(p) / len(p), rel=1e-5)
    assert top1["all"] == pytest.approx(sum(map(sum, probs.values())) / sum(map(len, probs.values())), rel=1e-5)

    pytest.importorskip("matplotlib")
    point = {"compute_minutes": 1.0, "results": summaries, "mean_acceptance_length": {name: 1.0 for name in shapes}}
    record = {
        "name": "toy",
        "budget_minutes": 2,
        "data_minutes": 0.5,
        "eval_minutes": 0.1,
        "points": [point],
        "eval": {"drafting": {name: {} for name in shapes}, "benches": ["mt_bench", "gsm8k"]},
        "target_top1_probability": top1,
    }
    assert quality.plot_curve(record, tmp_path / "quality.png")
    assert (tmp_path / "quality.png").stat().st_size > 0


def test_help_explains_the_run(quality, capsys):
    with pytest.raises(SystemExit) as done:  # what `python scripts/bench/quality.py --help` runs, in this process
        quality.main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--budget", "--prep", "--train", "--eval-every", "--save-every", "--num-prompts", "--tree"):
        assert flag in out


def test_every_recipe_is_a_valid_objective_and_later_overrides_win(quality):
    from eagle_train.train_config import load_train_config

    yaml = str(Path(__file__).resolve().parents[1] / "configs" / "eagle3_smollm2.yaml")

    def parse(*extra):
        return quality.parse_args(["--budget", "1", "--out", "x", "--prep", "p", "--train", yaml, *extra])

    seen = set()
    for name, overrides in quality.RECIPES.items():
        args = parse("--recipe", name)
        assert args.train == [yaml, *overrides]
        cfg = load_train_config(args.train[0], args.train[1:])
        seen.add((cfg.tv_weight, cfg.rejection_weight))
    assert len(seen) == len(quality.RECIPES)  # each recipe trains another objective
    assert (0.0, 0.0) in seen  # sft: soft cross-entropy alone, whatever the YAML says
    args = parse("tv_weight=0.1", "--recipe", "tv")
    assert load_train_config(args.train[0], args.train[1:]).tv_weight == 0.1
    with pytest.raises(SystemExit):
        parse("--recipe", "nope")


def test_the_comparison_table_has_a_row_per_point_with_its_figures():
    compare = load_script("bench/quality_compare.py")

    def result(al):
        return {"acceptance_length": al, "speedup": al - 0.5, "acceptance_per_position": [al - 1, (al - 1) / 2]}

    def point(step, al, walk):
        results = {name: {b: result(al + k) for k, b in enumerate(("mt_bench", "gsm8k"))} for name in ("c", "t")}
        return {"step": step, "compute_minutes": step / 10, "results": results, "walk": walk}

    ev = {"benches": ["mt_bench", "gsm8k"], "drafting": {"c": {}, "t": {}}}
    walk = {"mt_bench": {"acceptance_length": 1.25}, "gsm8k": {"acceptance_length": 1.5}}
    records = [
        {"name": "a", "recipe": "tv", "eval": ev, "points": [point(10, 1.5, None), point(20, 1.75, walk)]},
        {"name": "b", "eval": ev, "points": [point(30, 1.25, walk)]},
    ]
    lines = compare.table(records).splitlines()
    assert len(lines) == 2 + 3 and lines[0].count("|") == lines[2].count("|") == 10
    assert lines[2] == "| a | tv | 10 | 1.00 | 1.500 / 2.500 | 1.500 / 2.500 | 1.00x / 2.00x | 0.500 0.250 | - |"
    assert lines[3].endswith("| 0.750 0.375 | 1.2500 / 1.5000 |") and lines[4].startswith("| b | - | 30 | 3.00 |")
