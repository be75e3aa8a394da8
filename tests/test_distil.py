"""Self-distillation in one pass (data_prep/distil.py): the answers are greedy decoding's, turn after turn, the hidden
states are capture's, a killed run resumes to the same store, and runs that share the shards make it too."""

import json

import pytest
import torch
from conftest import CONVERSATIONS

from data_prep.distil import ANSWER, distil, generate_and_capture, render_prompt, turn_prompts
from data_prep.vocab import count_answer_tokens
from eagle_train.hidden_states import target_hidden_states
from eagle_train.store import ShardedSamples, list_shards, read_vocab_map
from eagle_train.target import SMOLLM2, end_of_turn_ids, load_tokenizer

AUX = (2, 15, 27)


def prompt_ids(tok, conv):
    return tok(render_prompt(tok, turn_prompts(conv["messages"])[0]), add_special_tokens=False)["input_ids"]


def test_a_turn_is_an_answer_to_a_question_asked_since_the_last_one():
    two = CONVERSATIONS[1]["messages"]
    assert turn_prompts(two) == [two[:1], [two[0], {"role": "assistant", "content": ANSWER}, two[2]]]
    assert turn_prompts(CONVERSATIONS[2]["messages"]) == [CONVERSATIONS[2]["messages"][:2]]
    user, answer = {"role": "user", "content": "?"}, {"role": "assistant", "content": "A"}
    assert turn_prompts([answer, user]) == []  # nothing asked before the answer; the question is never answered
    assert turn_prompts([user, answer, answer, {"role": "user", "content": " "}, answer]) == [[user]]


def test_answers_are_greedy_decoding_and_hidden_states_are_captures(smollm2):
    model, tok = smollm2
    prompts = [prompt_ids(tok, c) for c in CONVERSATIONS[:3]]  # different lengths: the batch is left-padded
    eos = end_of_turn_ids(model, tok)
    samples = generate_and_capture(model, prompts, 24, AUX, eos, tok.pad_token_id)
    for p, s in zip(prompts, samples):
        with torch.no_grad():
            ref = model.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False, pad_token_id=tok.pad_token_id)
        answer = ref[0, len(p) :].tolist()
        if any(t in eos for t in answer):
            answer = answer[: next(k for k, t in enumerate(answer) if t in eos) + 1]
        assert s["input_ids"].tolist() == p + answer
        assert s["loss_mask"].tolist() == [False] * len(p) + [True] * len(answer)
        aux, final = target_hidden_states(model, s["input_ids"][None], aux_layer_ids=AUX)
        torch.testing.assert_close(s["aux_hidden"], aux[0], atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(s["final_hidden"], final[0], atol=2e-4, rtol=1e-4)
    assert any(s["input_ids"][-1].item() in eos for s in samples)  # some answer ended within the budget


@pytest.fixture
def conversations_file(tmp_path):
    path = tmp_path / "convs.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in CONVERSATIONS))
    return str(path)


def run_distil(smollm2, data, out, **kw):
    model, tok = smollm2
    options = {"max_new_tokens": 16, "batch_size": 2, "max_length": 128, "dtype": "float32", "progress": False}
    return distil(model, tok, data, out, target_name="smollm2-135m", **{**options, **kw})


def test_killed_distil_resumes_to_the_same_store(smollm2, conversations_file, tmp_path):
    whole, stats = run_distil(smollm2, conversations_file, tmp_path / "whole")
    assert whole["num_samples"] == len(CONVERSATIONS) and len(whole["shards"]) == 3
    assert stats["answer_tokens"] == sum(
        int(ShardedSamples(tmp_path / "whole").tokens(i)["loss_mask"].sum()) for i in range(6)
    )
    vmap = read_vocab_map(tmp_path / "whole")
    assert vmap["counts"].sum() == stats["answer_tokens"]

    out = tmp_path / "resumed"
    run_distil(smollm2, conversations_file, out)
    (out / list_shards(out)[1][1]).unlink()  # as if killed before the second batch was written
    (out / "manifest.json").write_text(
        json.dumps({**json.loads((out / "manifest.json").read_text()), "complete": False})
    )
    resumed, stats = run_distil(smollm2, conversations_file, out)
    assert stats["conversations"] == 2  # only the missing batch ran again
    a, b = ShardedSamples(tmp_path / "whole"), ShardedSamples(out)
    for i in range(len(a)):
        for key, value in a[i].items():
            torch.testing.assert_close(b[i][key], value)

    with pytest.raises(ValueError, match="plan"):
        run_distil(smollm2, conversations_file, out, max_new_tokens=8)


def greedy(model, tok, ids: list[int], max_new_tokens: int, eos: set[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    answer = out[0, len(ids) :].tolist()
    return answer[: next((k + 1 for k, t in enumerate(answer) if t in eos), len(answer))]


ARITHMETIC = {  # SmolLM2 answers the first question in 7 tokens, so the second turn has room
    "id": "sums",
    "messages": [
        {"role": "user", "content": "What is 2+2? Answer with a number."},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "6"},
    ],
}


def test_every_turn_is_greedy_decoding_of_the_conversation_so_far(smollm2, tmp_path):
    """turns=None answers both questions of a two-turn conversation: the second prompt is the first, the target's
    own first answer and the template's next user turn, chained as tokens, and decodes to what the chat template
    renders for that conversation; both answers are loss-masked, the hidden states cover the whole sequence."""
    model, tok = smollm2
    data = tmp_path / "convs.jsonl"
    data.write_text(json.dumps(ARITHMETIC) + "\n")
    run_distil(smollm2, str(data), tmp_path / "all", turns=None, max_new_tokens=40, max_length=256)
    store = ShardedSamples(tmp_path / "all")
    conv = ARITHMETIC["messages"]
    eos = end_of_turn_ids(model, tok)
    first = prompt_ids(tok, ARITHMETIC)
    sample = next(store[i] for i in range(len(store)) if store[i]["input_ids"][: len(first)].tolist() == first)
    a1 = greedy(model, tok, first, 40, eos)
    assert a1[-1] in eos
    text = render_prompt(tok, [conv[0], {"role": "assistant", "content": tok.decode(a1[:-1])}, conv[2]])
    prompt = sample["input_ids"][: len(tok(text, add_special_tokens=False)["input_ids"])].tolist()
    assert prompt[: len(first) + len(a1)] == first + a1 and tok.decode(prompt) == text
    a2 = greedy(model, tok, prompt, 40, eos)
    assert sample["input_ids"].tolist() == prompt + a2
    mask = [False] * len(first) + [True] * len(a1) + [False] * (len(prompt) - len(first) - len(a1)) + [True] * len(a2)
    assert sample["loss_mask"].tolist() == mask
    aux, final = target_hidden_states(model, sample["input_ids"][None], aux_layer_ids=AUX)
    torch.testing.assert_close(sample["aux_hidden"], aux[0], atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(sample["final_hidden"], final[0], atol=2e-4, rtol=1e-4)
    run_distil(smollm2, str(data), tmp_path / "one", max_new_tokens=40, max_length=256)
    one = ShardedSamples(tmp_path / "one")
    assert sum(int(one[i]["loss_mask"].sum()) for i in range(len(one))) < sum(
        int(store[i]["loss_mask"].sum()) for i in range(len(store))
    )


def test_runs_that_share_the_shards_make_the_store_one_run_makes(smollm2, conversations_file, tmp_path):
    whole, _ = run_distil(smollm2, conversations_file, tmp_path / "whole")
    manifest, stats = run_distil(smollm2, conversations_file, tmp_path / "shared", shard=(1, 2))
    assert manifest is None and stats["conversations"] == 2  # shard 1 of 3; shards 0 and 2 are the other run's
    manifest, stats = run_distil(smollm2, conversations_file, tmp_path / "shared", shard=(0, 2))
    assert stats["conversations"] == 4 and manifest["num_samples"] == whole["num_samples"]
    a, b = ShardedSamples(tmp_path / "whole"), ShardedSamples(tmp_path / "shared")
    for i in range(len(a)):
        for key, value in a[i].items():
            torch.testing.assert_close(b[i][key], value)
    assert (read_vocab_map(tmp_path / "whole")["counts"] == read_vocab_map(tmp_path / "shared")["counts"]).all()
    with pytest.raises(ValueError, match="shard 2/2"):
        run_distil(smollm2, conversations_file, tmp_path / "shared", shard=(2, 2))


def test_no_room_for_an_answer_is_a_clear_error(smollm2, conversations_file, tmp_path):
    with pytest.raises(ValueError, match="raise max_length"):
        run_distil(smollm2, conversations_file, tmp_path / "x", max_length=20)


def test_prep_run_with_distil_writes_a_store_the_trainer_reads(conversations_file, tmp_path, capsys):
    from data_prep.cli import main

    config = tmp_path / "prep.yaml"
    config.write_text(
        f"target: smollm2-135m\ndata: {conversations_file}\nout_dir: {tmp_path / 'run'}\n"
        "prep:\n  max_length: 96\n  draft_vocab_size: 64\n  distil: {enabled: true, max_new_tokens: 8, batch_size: 4}\n"
        f"  vocab_fill: {{source: {conversations_file}, conversations: 3}}\n"
    )
    main(["run", "--config", str(config)])
    printed = capsys.readouterr().out
    assert "distilled 6 conversations this run (6 answers)" in printed and "answer tok/s" in printed
    store = ShardedSamples(tmp_path / "run" / "store")
    assert len(store) == 6 and store.has_hidden and store[0]["aux_hidden"].shape[1] == 3 * 576
    vmap = read_vocab_map(tmp_path / "run" / "store")  # 6 answers of <= 8 tokens use fewer than 64 ids
    assert len(vmap["d2t"]) == 64 and "draft ids the data never uses, chosen by" in printed
    assert torch.equal(vmap["fill"], count_answer_tokens(str(conversations_file), load_tokenizer(SMOLLM2), 49152, 3))
    assert vmap["t2d"][vmap["counts"] > 0].all() and vmap["t2d"][(vmap["counts"] == 0) & (vmap["fill"] > 0)].any()
    assert not (tmp_path / "run" / "tokenized").exists()


def test_the_cli_answers_in_the_data_engines_dtype_and_a_resume_keeps_it(
    conversations_file, tmp_path, monkeypatch, capsys
):
    """`eagle-prep distil` loads the target in bf16 where the machine multiplies it fast, `--engine-dtype` says
    otherwise, the plan records which, and a resume in another dtype is refused."""
    from data_prep.cli import main
    from eagle_train import bf16

    monkeypatch.setattr(bf16, "bf16_is_fast", lambda: True)
    args = ["distil", "--data", conversations_file, "--limit", "2", "--max-length", "96", "--max-new-tokens", "4"]
    args += ["--batch-size", "2", "--dtype", "float32", "--no-progress"]
    main([*args, "--out", str(tmp_path / "auto")])
    assert "; hf in bfloat16)" in capsys.readouterr().out
    main([*args, "--out", str(tmp_path / "fp32"), "--engine-dtype", "float32"])
    auto, fp32 = ShardedSamples(tmp_path / "auto"), ShardedSamples(tmp_path / "fp32")
    assert auto.manifest["plan"]["engine_dtype"] == "bfloat16" and fp32.manifest["plan"]["engine_dtype"] == "float32"
    prompt = int(auto[0]["loss_mask"].int().argmax())  # the answers may part at a near-tie; the prompts are one
    assert prompt > 10 and torch.equal(auto[0]["input_ids"][:prompt], fp32[0]["input_ids"][:prompt])
    x, y = (store[0]["final_hidden"][:prompt] for store in (auto, fp32))
    error = ((x - y).norm(dim=-1) / y.norm(dim=-1)).mean()
    assert 1e-3 < error < 0.1  # bf16's rounding (2**-8 an operation) through 30 layers; fp32's two runs: < 1e-5
    with pytest.raises(SystemExit, match="'engine_dtype': 'bfloat16'"):
        main([*args, "--out", str(tmp_path / "auto"), "--engine-dtype", "float32"])


def test_turns_a_chat_template_refuses_are_left_out_and_counted():
    """A template that raises on a later turn (Mistral's "roles must alternate") costs that conversation its later
    turns, counted per reason, not the run; one that raises on the first prompt leaves the conversation out."""
    import copy

    from data_prep.distil import chained_end_of_turn, plan_conversations
    from eagle_train.target import SMOLLM2, load_tokenizer

    tok = copy.deepcopy(load_tokenizer(SMOLLM2))
    end_id = chained_end_of_turn(tok, {tok.eos_token_id})
    tok.chat_template = (
        "{% if messages | length > 2 or messages[-1]['content'] == 'Hi' %}{{ raise_exception('roles must alternate') }}"
        "{% endif %}" + tok.chat_template
    )
    planned, cut = plan_conversations(tok, CONVERSATIONS, None, 512, 16, None, None, end_id)
    assert cut == {"chat template error: roles must alternate": 2}  # c1 loses its second turn, c2 ("Hi") is out
    assert [len(segments) for _, segments in planned] == [1] * (len(CONVERSATIONS) - 1)


def test_the_trainer_reads_where_the_targets_argmax_is_off_a_distilled_stores_answers(smollm2, tmp_path):
    """A distilled store's answer tokens are the target's argmax, so the trainer takes `in_draft` from them and
    runs only the draft rows of the target's lm_head: the batch the whole-vocabulary pass gives, every turn."""
    from eagle_train.methods.eagle3.train import build_eagle3_head
    from eagle_train.train_config import load_train_config
    from eagle_train.trainer import build_model, micro_batch

    data = tmp_path / "convs.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in CONVERSATIONS))
    run_distil(smollm2, str(data), tmp_path / "s", turns=None, max_new_tokens=24, max_length=256)
    overrides = [f"data_path={tmp_path / 's'}", f"output_dir={tmp_path / 'run'}", "draft_vocab_size=32"]
    _, source = build_model(load_train_config(None, overrides), build_eagle3_head, None, "cpu")
    store = ShardedSamples(tmp_path / "s")
    padded = micro_batch([store[i] for i in range(len(store))], list(range(len(store))), 256, 0)
    assert source.greedy_answers
    fast = source(padded)
    source.greedy_answers = False
    full = source(padded)
    answers = torch.roll(padded["loss_mask"], -1, dims=1)
    assert full["in_draft"][answers].any() and not full["in_draft"][answers].all()  # 32 draft ids miss some
    assert torch.equal(fast["in_draft"], full["in_draft"])
    torch.testing.assert_close(fast["target_probs"], full["target_probs"], rtol=1e-5, atol=1e-7)
