"""Readers, chat templates and loss masks, regeneration, the vocabulary map and the eagle-prep CLI."""

import copy
import json
import shutil

import pytest
import torch
from conftest import CONVERSATIONS

from data_prep import cli
from data_prep.chat import SkipSample, masked_spans, show_mask, tokenize_conversation
from data_prep.dataset import tokenize_dataset
from data_prep.readers import ReadReport, read_conversations
from data_prep.regenerate import regenerate
from data_prep.vocab import build_vocab_map, count_tokens
from eagle_train.store import ShardedSamples, read_vocab_map
from eagle_train.target import SMOLLM2

SHAREGPT_RECORD = {"id": "s1", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}]}

# ------------------------------------------------------------------------------------ readers


def read_all(source, **kw):
    report = ReadReport()
    return list(read_conversations(str(source), report=report, **kw)), report


def test_reads_sharegpt_json_jsonl_openai_parquet_and_saved_datasets(tmp_path):
    import datasets

    openai = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}
    parts = {
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": [{"type": "text", "text": "Hello!"}]},
        ]
    }
    (tmp_path / "a.json").write_text(json.dumps([SHAREGPT_RECORD, parts]))
    (tmp_path / "a.jsonl").write_text(json.dumps(SHAREGPT_RECORD) + "\n\n" + json.dumps(parts) + "\n")
    datasets.Dataset.from_list([openai, openai]).to_parquet(str(tmp_path / "a.parquet"))
    datasets.Dataset.from_list([SHAREGPT_RECORD]).save_to_disk(str(tmp_path / "saved"))
    expected = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    for name, n in [("a.json", 2), ("a.jsonl", 2), ("a.parquet", 2), ("saved", 1)]:
        convs, report = read_all(tmp_path / name)
        assert len(convs) == n and report.kept == n and not report.skipped, name
        assert all(c["messages"] == expected for c in convs), name
    assert read_all(tmp_path / "a.json")[0][0]["id"] == "s1"
    assert read_all(tmp_path / "a.json")[0][1]["id"] == "1"  # no id: the record's index


def test_embedded_sharegpt_alias():
    convs, report = read_all("sharegpt", limit=20)
    assert len(convs) == 20 and report.kept == 20
    assert all(any(m["role"] == "assistant" for m in c["messages"]) for c in convs)


def test_malformed_records_are_counted_per_reason_not_fatal(tmp_path):
    good = json.dumps(SHAREGPT_RECORD)
    lines = [
        good,
        "{not json",
        json.dumps({"text": "no schema"}),
        good,
        json.dumps({"conversations": [{"from": "human", "value": "only a question"}]}),
        json.dumps({"conversations": [{"from": "alien", "value": "?"}]}),
        json.dumps({"messages": [{"role": "user", "content": {"image": 1}}]}),
        json.dumps({"conversations": []}),
        json.dumps([1, 2]),
        good,
    ]
    (tmp_path / "mixed.jsonl").write_text("\n".join(lines * 5000) + "\n")  # 50,000 records
    convs, report = read_all(tmp_path / "mixed.jsonl")
    assert report.read == 50000 and len(convs) == report.kept == 15000
    assert report.skipped == {
        "invalid JSON line": 5000,
        "no 'conversations' or 'messages' field": 5000,
        "no assistant turn": 5000,
        "unknown role 'alien'": 5000,
        "message content is not text": 5000,
        "empty conversation": 5000,
        "record is a list, not an object": 5000,
    }
    assert "skipped 5000: no assistant turn" in report.summary()


def test_empty_and_broken_files_are_clear_errors(tmp_path):
    for name, text in [("empty.json", ""), ("empty.jsonl", "\n\n"), ("blank.json", "  \n")]:
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match="is empty"):
            read_all(tmp_path / name)
    (tmp_path / "bad.json").write_text('[{"id": 1}, {"id": oops}]')
    with pytest.raises(ValueError, match="invalid JSON in element 1"):
        read_all(tmp_path / "bad.json")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unsupported file type"):
        read_all(tmp_path / "x.csv")
    with pytest.raises(FileNotFoundError):
        read_all(tmp_path / "missing.jsonl")


@pytest.mark.parametrize(
    "name, hint",
    [
        ("data/nope.jsonl", "a name ending in .jsonl is a file, not a hub id"),
        ("runs/conversations", "with no local 'runs/' directory"),
        ("./nope", "no such file or directory"),
    ],
)
def test_missing_local_looking_data_fails_at_once_naming_it(tmp_path, monkeypatch, name, hint):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    with pytest.raises(FileNotFoundError) as e:
        read_all(name)
    assert str(e.value).startswith(f"data {name!r} does not exist (") and hint in str(e.value)


def test_data_only_the_hub_could_hold_is_one_line_when_it_cannot_be_fetched(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as e:
        read_all("no-such-org/no-such-dataset")
    message = str(e.value)
    assert message.startswith("could not load data 'no-such-org/no-such-dataset' from the Hugging Face Hub: ")
    assert "give a local file or directory" in message and "\n" not in message


def test_truncated_json_array_keeps_the_whole_records(tmp_path):
    text = json.dumps([SHAREGPT_RECORD, SHAREGPT_RECORD])
    (tmp_path / "cut.json").write_text(text[: len(text) - 20])  # cut inside the second record
    convs, report = read_all(tmp_path / "cut.json")
    assert len(convs) == 1 and report.skipped == {"last record cut off (file truncated)": 1}


def test_undecodable_lines_are_counted_like_malformed_ones_and_each_reason_says_where_it_first_occurred(tmp_path):
    """One byte that is not UTF-8 costs its line, not the run; the summary says which line to look at."""
    good = json.dumps(SHAREGPT_RECORD).encode()
    latin1 = json.dumps({**SHAREGPT_RECORD, "id": "café"}, ensure_ascii=False).encode("latin-1")
    lines = [b"", good, latin1, good, b"{not json", latin1, json.dumps({"text": "x"}).encode(), good]
    (tmp_path / "mixed.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    convs, report = read_all(tmp_path / "mixed.jsonl")
    assert len(convs) == report.kept == 3 and report.read == 7
    assert report.skipped == {
        "line is not UTF-8": 2,
        "invalid JSON line": 1,
        "no 'conversations' or 'messages' field": 1,
    }
    assert report.first == {
        "line is not UTF-8": "line 3",  # file lines, the blank first one included
        "invalid JSON line": "line 5",
        "no 'conversations' or 'messages' field": "line 7",
    }
    assert "  skipped 2: line is not UTF-8 (first: line 3)" in report.summary().splitlines()


def test_a_json_file_that_is_not_utf8_is_one_line_naming_the_file_and_the_byte(tmp_path):
    text = json.dumps([SHAREGPT_RECORD, {**SHAREGPT_RECORD, "id": "café"}], ensure_ascii=False)
    (tmp_path / "latin1.json").write_bytes(text.encode("latin-1"))
    offset = text.index("é")
    with pytest.raises(ValueError) as e:
        read_all(tmp_path / "latin1.json")
    assert str(e.value) == (
        f"{tmp_path / 'latin1.json'} is not UTF-8: byte 0xe9 at offset {offset} cannot be decoded; "
        "re-encode the file as UTF-8"
    )


def test_json_records_are_located_by_index(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps([SHAREGPT_RECORD, {"text": "x"}, {"text": "y"}]))
    _, report = read_all(tmp_path / "a.json")
    assert report.first == {"no 'conversations' or 'messages' field": "record 1"}


def test_wrong_schema_file_fails_tokenize_with_the_reasons(tmp_path, smollm2):
    (tmp_path / "w.jsonl").write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n")
    with pytest.raises(ValueError, match=r"(?s)no usable conversations.*no 'conversations' or 'messages' field"):
        tokenize_dataset(str(tmp_path / "w.jsonl"), tmp_path / "out", SMOLLM2, tokenizer=smollm2[1])


# ------------------------------------------------------------------------ chat templates, masks

LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ ' ' + message['content'] + eos_token }}{% endif %}{% endfor %}"
)


def with_template(tokenizer, template, special=()):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = template
    if special:
        tok.add_special_tokens({"additional_special_tokens": list(special)})
    return tok


def assistant_texts(conv):
    return [m["content"] for m in conv["messages"] if m["role"] == "assistant"]


@pytest.mark.parametrize("template", ["smollm2", "llama3", "mistral"])
def test_mask_is_exactly_assistant_content_plus_end_of_turn(template, smollm2):
    tok = smollm2[1]
    if template == "llama3":
        tok = with_template(tok, LLAMA3, ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"])
    elif template == "mistral":
        tok = with_template(tok, MISTRAL)
    eot = {"smollm2": "<|im_end|>", "llama3": "<|eot_id|>", "mistral": tok.eos_token}[template]
    for conv in CONVERSATIONS:
        s = tokenize_conversation(tok, conv["messages"])
        spans = masked_spans(tok, s["input_ids"], s["loss_mask"])
        expected = [t + eot for t in assistant_texts(conv)]
        if template == "mistral":  # its ' ' + content: the space merges into the first content token
            spans = [sp.removeprefix(" ") for sp in spans]
        assert spans == expected, (template, conv["id"])


def test_mask_keeps_content_whitespace_and_is_not_fooled_by_repeats(smollm2):
    tok = smollm2[1]
    messages = [
        {"role": "user", "content": "Say OK."},
        {"role": "assistant", "content": "OK."},
        {"role": "user", "content": "OK."},
        {"role": "assistant", "content": "  OK.\n"},
    ]
    s = tokenize_conversation(tok, messages)
    # the repeated "OK." of the user turn is not masked; the second reply keeps its whitespace, and its
    # first token, which merges the template's "\n" with the leading spaces, counts as the reply's
    assert masked_spans(tok, s["input_ids"], s["loss_mask"]) == ["OK.<|im_end|>", "\n  OK.\n<|im_end|>"]


def test_system_prompt_override_and_truncation(smollm2):
    tok = smollm2[1]
    conv = CONVERSATIONS[1]["messages"]
    default = tok.decode(tokenize_conversation(tok, conv)["input_ids"])
    assert "named SmolLM" in default  # SmolLM2's template inserts its own system prompt
    s = tokenize_conversation(tok, conv, system_prompt="Be brief.")
    text = tok.decode(s["input_ids"])
    assert "Be brief." in text and "named SmolLM" not in text
    full = tokenize_conversation(tok, conv)
    cut = tokenize_conversation(tok, conv, max_length=len(full["input_ids"]) - 5)
    assert len(cut["input_ids"]) == len(full["input_ids"]) - 5
    assert torch.equal(cut["input_ids"], full["input_ids"][:-5])
    assert torch.equal(cut["loss_mask"], full["loss_mask"][:-5])
    with pytest.raises(SkipSample, match="no assistant tokens within max_length"):
        tokenize_conversation(tok, conv, max_length=10)
    with pytest.raises(SkipSample, match="no assistant turn"):
        tokenize_conversation(tok, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  "}])


def test_template_errors_are_reported_skips(smollm2, tmp_path):
    strict = (
        "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('roles must alternate') }}{% endif %}{{ m['content'] }}{% endfor %}"
    )
    tok = with_template(smollm2[1], strict)
    with pytest.raises(SkipSample, match="chat template error: roles must alternate"):
        tokenize_conversation(tok, CONVERSATIONS[2]["messages"])  # starts with a system message


def test_show_mask_makes_spans_visible(smollm2):
    tok = smollm2[1]
    s = tokenize_conversation(tok, CONVERSATIONS[0]["messages"])
    plain = show_mask(tok, s["input_ids"], s["loss_mask"], color=False)
    assert "[[The capital of France is Paris.<|im_end|>]]" in plain
    assert plain.replace("[[", "").replace("]]", "") == tok.decode(s["input_ids"])
    coloured = show_mask(tok, s["input_ids"], s["loss_mask"])
    assert "\x1b[42;30mThe capital of France is Paris.<|im_end|>\x1b[0m" in coloured


# --------------------------------------------------------------------------- tokenized dataset, vocab


def test_tokenized_dataset_matches_tokenize_conversation(small_tokenized, smollm2):
    data = ShardedSamples(small_tokenized)
    m = data.manifest
    assert m["format"] == "eagle-tokenized" and m["num_samples"] == len(CONVERSATIONS) and m["max_length"] == 128
    assert m["target"]["vocab_size"] == 49152 and m["tokenizer"] == SMOLLM2
    for i, conv in enumerate(CONVERSATIONS):
        ref = tokenize_conversation(smollm2[1], conv["messages"], 128)
        assert torch.equal(data[i]["input_ids"], ref["input_ids"])
        assert torch.equal(data[i]["loss_mask"], ref["loss_mask"])
    vmap = read_vocab_map(small_tokenized)
    assert torch.equal(vmap["counts"], count_tokens((data[i] for i in range(len(data))), 49152))


def test_vocab_map_definition():
    counts = torch.tensor([5, 0, 9, 1, 9, 0, 3, 2])
    vmap = build_vocab_map(counts, draft_vocab_size=4)
    draft_ids = [0, 2, 4, 6]  # the four most frequent, ascending
    assert vmap["d2t"].dtype == torch.int64 and vmap["t2d"].dtype == torch.bool
    assert (torch.arange(4) + vmap["d2t"]).tolist() == draft_ids
    assert vmap["t2d"].nonzero().flatten().tolist() == draft_ids
    assert vmap["coverage"] == pytest.approx(26 / 29)
    tie = build_vocab_map(torch.tensor([1, 1, 1, 1]), draft_vocab_size=2)  # ties go to the lower id
    assert (torch.arange(2) + tie["d2t"]).tolist() == [0, 1]
    full = build_vocab_map(counts, draft_vocab_size=32000)  # capped at V
    assert len(full["d2t"]) == 8 and full["t2d"].all() and full["coverage"] == 1.0
    fill = torch.tensor([0, 0, 0, 0, 0, 0, 0, 0, 0, 4, 0, 7])  # wider text ranks the ids the data never shows
    filled = build_vocab_map(torch.tensor([1, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0]), draft_vocab_size=4, fill=fill)
    assert (torch.arange(4) + filled["d2t"]).tolist() == [0, 2, 9, 11] and torch.equal(filled["fill"], fill)


# ------------------------------------------------------------------------------------ regeneration


def test_regenerate_replaces_assistant_turns_with_greedy_target_output(tiny_llama, tmp_path):
    model, tok = tiny_llama  # a random model: fast, and its replies are surely not the originals
    convs = [copy.deepcopy(CONVERSATIONS[1]), copy.deepcopy(CONVERSATIONS[0])]  # 2 turns and 1 turn
    out = tmp_path / "regen.jsonl"
    counts = regenerate(model, tok, convs, out, batch_size=2, max_new_tokens=8)
    assert counts == {"written": 2, "skipped_done": 0, "empty": 0}
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["c1", "c0"]
    c1 = rows[0]["messages"]
    assert [m["role"] for m in c1] == ["user", "assistant", "user", "assistant"]
    assert c1[0] == convs[0]["messages"][0] and c1[2] == convs[0]["messages"][2]  # user turns kept
    # turn 2 is conditioned on the regenerated turn 1; both equal an unbatched greedy generate
    for k in (1, 3):
        prompt = tok.apply_chat_template(c1[:k], tokenize=False, add_generation_prompt=True)
        ids = tok(prompt, return_tensors="pt", add_special_tokens=False)
        ref = model.generate(**ids, max_new_tokens=8, do_sample=False)
        assert c1[k]["content"] == tok.decode(ref[0, ids["input_ids"].shape[1] :], skip_special_tokens=True).strip()
    assert c1[1]["content"] != "1, 2, 3, 4, 5."
    # resume: ids already written are skipped, a torn last line (a kill mid-write) is repaired
    with out.open("a") as f:
        f.write('{"id": "c2", "messa')
    counts = regenerate(model, tok, [convs[0], copy.deepcopy(CONVERSATIONS[2])], out, batch_size=2, max_new_tokens=4)
    assert counts == {"written": 1, "skipped_done": 1, "empty": 0}
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["c1", "c0", "c2"]


def test_the_cli_regenerates_in_the_data_engines_dtype(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    """`eagle-prep regenerate` loads the target in bf16 where the machine multiplies it fast, as distil and capture
    do, and in the dtype `--engine-dtype` names."""
    from eagle_train import bf16

    data = tmp_path / "convs.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in CONVERSATIONS[:2]))
    args = ["regenerate", "--target", str(tiny_llama_dir), "--data", str(data), "--max-new-tokens", "4"]
    for fast, flag, dtype in [
        (True, [], "bfloat16"),
        (False, [], "float32"),
        (True, ["--engine-dtype", "float32"], "float32"),
    ]:
        monkeypatch.setattr(bf16, "bf16_is_fast", lambda fast=fast: fast)
        cli.main([*args, "--out", str(tmp_path / f"{dtype}-{len(flag)}.jsonl"), *flag])
        assert f"s, {dtype} -> " in capsys.readouterr().out
    assert len((tmp_path / "bfloat16-0.jsonl").read_text().splitlines()) == 2


def test_regenerate_max_turns_keeps_the_first_turns_only(tiny_llama, tmp_path):
    model, tok = tiny_llama
    out = tmp_path / "regen.jsonl"
    regenerate(model, tok, [copy.deepcopy(CONVERSATIONS[1])], out, max_new_tokens=4, max_turns=1)
    assert [m["role"] for m in json.loads(out.read_text())["messages"]] == ["user", "assistant"]
    with pytest.raises(ValueError, match="max_turns must be >= 1"):
        regenerate(model, tok, [], tmp_path / "none.jsonl", max_turns=0)


def test_regenerate_drops_an_assistant_turn_that_answers_nothing(tiny_llama, tmp_path):
    model, tok = tiny_llama
    opener = {
        "id": "g",
        "messages": [{"role": "assistant", "content": "Hi! How can I help?"}]
        + copy.deepcopy(CONVERSATIONS[0]["messages"]),
    }
    alone = {"id": "a", "messages": [{"role": "assistant", "content": "Hello."}]}
    out = tmp_path / "regen.jsonl"
    assert regenerate(model, tok, [opener, alone], out, max_new_tokens=4) == {
        "written": 1,
        "skipped_done": 0,
        "empty": 1,
    }
    row = json.loads(out.read_text())
    assert [m["role"] for m in row["messages"]] == [m["role"] for m in CONVERSATIONS[0]["messages"]]


# ------------------------------------------------------------------------------------------- CLI


def test_cli_show_mask_and_vocab(conversations_jsonl, small_tokenized, tmp_path, capsys):
    cli.main(["show-mask", "--data", str(conversations_jsonl), "--index", "2", "--no-color"])
    out = capsys.readouterr().out
    assert "[[Hello.<|im_end|>]]" in out and "You are terse." in out and "loss-masked" in out
    template = tmp_path / "mistral.jinja"
    template.write_text(MISTRAL)
    cli.main(["show-mask", "--data", str(conversations_jsonl), "--template", str(template), "--no-color"])
    assert "[INST] What is the capital of France? [/INST][[ The capital" in capsys.readouterr().out
    data = shutil.copytree(small_tokenized, tmp_path / "tokenized")
    cli.main(["vocab", "--data", str(data), "--draft-vocab-size", "50"])
    assert "draft vocab 50 of 49152 ids covers" in capsys.readouterr().out
    assert len(read_vocab_map(data)["d2t"]) == 50
    with pytest.raises(SystemExit):
        cli.main(["tokenize", "--help"])
    assert "--max-length" in capsys.readouterr().out


def test_vocab_fill_keeps_every_id_the_data_uses_and_adds_the_wider_answers_most_frequent(
    small_tokenized, smollm2, tmp_path, capsys
):
    from eagle_train.trainer import vocab_map_of_size

    wider = [
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Tomatoes, tomatoes! " * k}]}
        for k in (1, 3)
    ] + [{"messages": [{"role": "user", "content": "Tomatoes?"}, {"role": "assistant", "content": "Zebras graze."}]}]
    source = tmp_path / "wider.jsonl"
    source.write_text("".join(json.dumps(c) + "\n" for c in wider))
    data = shutil.copytree(small_tokenized, tmp_path / "tokenized")
    used = read_vocab_map(data)["counts"] > 0
    size = int(used.sum()) + 3
    cli.main(["vocab", "--data", str(data), "--draft-vocab-size", str(size), "--fill-from", str(source)])
    assert "3 draft ids the data never uses, chosen by" in capsys.readouterr().out
    vmap = read_vocab_map(data)
    reference = torch.zeros(49152, dtype=torch.int64)  # the wider answers' tokens, user turns left out
    for c in wider:
        for token in smollm2[1](c["messages"][1]["content"], add_special_tokens=False)["input_ids"]:
            reference[token] += 1
    assert torch.equal(vmap["fill"], reference)
    unused = reference.masked_fill(used, -1)
    ranked = torch.sort(-unused, stable=True).indices[:3]  # most frequent first, ties to the lower id
    assert torch.equal(vmap["t2d"], used | torch.zeros_like(used).index_fill(0, ranked, True))
    narrowed = vocab_map_of_size(vmap, size - 1)  # a run's smaller draft vocabulary keeps the same rule
    assert (narrowed["t2d"] <= vmap["t2d"]).all() and not narrowed["t2d"][ranked[2]]
    with pytest.raises(SystemExit, match="fill_conversations must be >= 1"):
        cli.main(["vocab", "--data", str(data), "--fill-from", str(source), "--fill-conversations", "0"])


def test_cli_run_config_end_to_end(conversations_jsonl, tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text(
        f"target: {SMOLLM2}\ndata: {conversations_jsonl}\nout_dir: {tmp_path / 'run'}\n"
        "prep:\n  num_conversations: 3\n  max_length: 64\n"
        "  capture: {dtype: float8_e4m3fn, token_budget: 128, shard_tokens: 64}\n"
        f"  vocab_fill: {{source: {conversations_jsonl}}}\n"
    )
    cli.main(["run", "--config", str(config), "prep.num_conversations=2", "prep.capture.token_budget=64"])
    out = capsys.readouterr().out
    assert "read 2 records, kept 2" in out and "tokenized 2 conversations" in out
    store = ShardedSamples(tmp_path / "run" / "store")
    assert len(store) == 2 and store.manifest["dtype"] == "float8_e4m3fn" and store.has_hidden
    assert "store " in out and "bytes/token" in out
    filled = read_vocab_map(tmp_path / "run" / "tokenized")
    assert "draft ids the data never uses, chosen by" in out and filled["fill"].sum() > 0
    assert torch.equal(read_vocab_map(tmp_path / "run" / "store")["d2t"], filled["d2t"])


def test_cli_run_again_keeps_the_vocab_fill_counts_until_the_fill_changes(
    conversations_jsonl, tmp_path, monkeypatch, capsys
):
    """A second `eagle-prep run` on a finished store (the quickstart with another drafter) takes the fill counts it
    kept instead of counting the fill source again; other fill settings, or `eagle-prep vocab`, count again."""
    config = tmp_path / "c.yaml"
    config.write_text(
        f"target: {SMOLLM2}\ndata: {conversations_jsonl}\nout_dir: {tmp_path / 'run'}\n"
        "prep:\n  num_conversations: 2\n  max_length: 96\n  draft_vocab_size: 64\n"
        "  distil: {enabled: true, max_new_tokens: 4, batch_size: 2}\n  capture: {dtype: float32}\n"
        f"  vocab_fill: {{source: {conversations_jsonl}, conversations: 3}}\n"
    )
    counted, count = [], cli.count_answer_tokens
    monkeypatch.setattr(cli, "count_answer_tokens", lambda *args: counted.append(args[3]) or count(*args))
    store = tmp_path / "run" / "store"
    cli.main(["run", "--config", str(config)])
    first = (store / "vocab_map.safetensors").read_bytes()
    assert counted == [3] and read_vocab_map(store)["fill"].sum() > 0
    capsys.readouterr()
    cli.main(["run", "--config", str(config)])
    assert counted == [3] and (store / "vocab_map.safetensors").read_bytes() == first
    assert f"vocab fill: kept the counts of 3 conversations of {conversations_jsonl}" in capsys.readouterr().out
    cli.main(["run", "--config", str(config), "prep.vocab_fill.conversations=2"])
    assert counted == [3, 2]
    cli.main(["vocab", "--data", str(store), "--fill-from", str(conversations_jsonl), "--fill-conversations", "2"])
    assert counted == [3, 2, 2]


@pytest.mark.parametrize("where", ["file", "override"])
def test_cli_run_refuses_a_misspelt_key(conversations_jsonl, tmp_path, where):
    config = tmp_path / "c.yaml"
    config.write_text(
        f"data: {conversations_jsonl}\nout_dir: {tmp_path / 'run'}\n"
        + ("prep:\n  num_conversation: 3\n" if where == "file" else "")
    )
    extra = ["prep.capture.dtpye=float32"] if where == "override" else []
    with pytest.raises(SystemExit, match="unknown key.*(num_conversation|dtpye).*prep.num_conversations"):
        cli.main(["run", "--config", str(config), *extra])
    assert not (tmp_path / "run").exists()
    config.write_text(f"data: {conversations_jsonl}\nout_dir: {tmp_path / 'run'}\n")
    with pytest.raises(SystemExit, match="fill_conversations must be >= 1"):  # before any data is made
        cli.main(["run", "--config", str(config), "prep.vocab_fill.source=sharegpt", "prep.vocab_fill.conversations=0"])
    assert not (tmp_path / "run").exists()


def test_cli_bad_input_is_one_line_naming_the_command_not_a_traceback(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "no answer"}]}) + "\n")
    with pytest.raises(SystemExit, match="eagle-prep tokenize: error: no usable conversations"):
        cli.main(["tokenize", "--data", str(bad), "--out", str(tmp_path / "out")])


def test_tokenize_limit_counts_usable_samples_and_workers_change_nothing(conversations_jsonl, smollm2, tmp_path):
    bad = json.dumps({"messages": [{"role": "user", "content": "no answer"}]})
    lines = conversations_jsonl.read_text().splitlines()
    (tmp_path / "d.jsonl").write_text("\n".join([bad, lines[0], bad, *lines[1:]]) + "\n")
    results = []
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        manifest, report, _ = tokenize_dataset(
            str(tmp_path / "d.jsonl"), out, SMOLLM2, max_length=128, limit=4, tokenizer=smollm2[1], workers=workers
        )
        assert manifest["num_samples"] == report.kept == 4  # 4 usable samples, whatever was skipped before
        assert report.skipped["no assistant turn"] == 2 and report.read == 6  # not what workers read ahead
        assert report.first["no assistant turn"] == "line 1"
        results.append(ShardedSamples(out))
    a, b = results
    assert all(
        torch.equal(a[i]["input_ids"], b[i]["input_ids"]) and torch.equal(a[i]["loss_mask"], b[i]["loss_mask"])
        for i in range(4)
    )


def test_a_conversation_tokenization_skips_is_named_by_its_id_in_the_summary(conversations_jsonl, smollm2, tmp_path):
    long = json.dumps(
        {"id": "long", "messages": [{"role": "user", "content": "word " * 200}, *CONVERSATIONS[0]["messages"][-1:]]}
    )
    (tmp_path / "d.jsonl").write_text("\n".join([conversations_jsonl.read_text().strip(), long]) + "\n")
    _, report, _ = tokenize_dataset(
        str(tmp_path / "d.jsonl"), tmp_path / "out", SMOLLM2, max_length=64, tokenizer=smollm2[1]
    )
    assert report.first["no assistant tokens within max_length"] == "conversation long"


@pytest.mark.parametrize(
    "yaml_prep, flags",
    [
        ("", []),  # the defaults: one declaration for both
        (
            "prep:\n  num_conversations: 7\n  max_length: 300\n  draft_vocab_size: 512\n"
            "  distil: {max_new_tokens: 20, turns: all, batch_size: 3}\n"
            "  capture: {aux_layer_ids: [1, 2, 3], dtype: float32}\n",
            ["--limit", "7", "--max-length", "300", "--draft-vocab-size", "512", "--max-new-tokens", "20"]
            + ["--turns", "all", "--batch-size", "3", "--aux-layers", "1,2,3", "--dtype", "float32"],
        ),
    ],
)
def test_a_run_key_and_its_flag_make_the_same_call(monkeypatch, tmp_path, yaml_prep, flags):
    """`eagle-prep run`'s YAML keys and a subcommand's flags are the same knobs: the same values, and the same
    defaults, reach the same library call."""
    calls = []
    monkeypatch.setattr(cli, "distil_store", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(cli, "fill_vocab_map", lambda *args: None)
    config = tmp_path / "prep.yaml"
    config.write_text(f"out_dir: {tmp_path}\n{yaml_prep}")
    cli.main(["run", "--config", str(config), "prep.distil.enabled=true"])
    cli.main(["distil", "--out", str(tmp_path / "store"), *flags])
    from_yaml, from_flags = calls

    def same(value):
        return tuple(value) if isinstance(value, list) else str(value) if isinstance(value, type(tmp_path)) else value

    assert {k: same(v) for k, v in from_yaml.items()} == {k: same(from_flags[k]) for k in from_yaml}
    assert len(from_yaml) == 14  # every knob of distil, and out
