"""Self-distillation in one pass (data_prep/distil.py): the answers are greedy decoding's, the hidden states are
capture's, and a killed run resumes to the same store."""

import json

import pytest
import torch
from conftest import CONVERSATIONS

from data_prep.distil import distil, first_turn_prompt, generate_and_capture
from eagle_train.hidden_states import target_hidden_states
from eagle_train.store import ShardedSamples, list_shards, read_vocab_map
from eagle_train.target import end_of_turn_ids

AUX = (2, 15, 27)


def prompt_ids(tok, conv):
    text = tok.apply_chat_template(first_turn_prompt(conv["messages"]), tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


def test_first_turn_prompt_stops_before_the_first_answer_and_needs_a_question():
    assert first_turn_prompt(CONVERSATIONS[1]["messages"]) == CONVERSATIONS[1]["messages"][:1]
    assert first_turn_prompt(CONVERSATIONS[2]["messages"]) == CONVERSATIONS[2]["messages"][:2]
    assert first_turn_prompt([{"role": "assistant", "content": "Hi"}, {"role": "user", "content": "?"}]) is None


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
    assert stats["prompts"] == 2  # only the missing batch ran again
    a, b = ShardedSamples(tmp_path / "whole"), ShardedSamples(out)
    for i in range(len(a)):
        for key, value in a[i].items():
            torch.testing.assert_close(b[i][key], value)

    with pytest.raises(ValueError, match="plan"):
        run_distil(smollm2, conversations_file, out, max_new_tokens=8)


def test_no_room_for_an_answer_is_a_clear_error(smollm2, conversations_file, tmp_path):
    with pytest.raises(ValueError, match="raise max_length"):
        run_distil(smollm2, conversations_file, tmp_path / "x", max_length=20)


def test_prep_run_with_distil_writes_a_store_the_trainer_reads(conversations_file, tmp_path, capsys):
    from data_prep.cli import main

    config = tmp_path / "prep.yaml"
    config.write_text(
        f"target: smollm2-135m\ndata: {conversations_file}\nout_dir: {tmp_path / 'run'}\n"
        "prep:\n  max_length: 96\n  draft_vocab_size: 64\n  distil: {enabled: true, max_new_tokens: 8, batch_size: 4}\n"
    )
    main(["run", "--config", str(config)])
    printed = capsys.readouterr().out
    assert "distilled 6 first turns" in printed and "answer tok/s" in printed
    store = ShardedSamples(tmp_path / "run" / "store")
    assert len(store) == 6 and store.has_hidden and store[0]["aux_hidden"].shape[1] == 3 * 576
    assert len(read_vocab_map(tmp_path / "run" / "store")["d2t"]) == 64
    assert not (tmp_path / "run" / "tokenized").exists()
