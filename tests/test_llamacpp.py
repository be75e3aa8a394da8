"""llama.cpp in the loop: its output parsed from captured samples and fake tools, `build()` with faked
steps; with a real build (EAGLE_LLAMACPP_BIN or `eagle-llamacpp build`), an exported SmolLM2 head decodes
exactly as llama.cpp's plain decoding at the built-in runtime's tokens per forward."""

import json
import stat
import tarfile
from types import SimpleNamespace

import pytest
import torch

from eagle_cli.evaluate import main
from engines import llamacpp, llamacpp_build, llamacpp_run

# ---- parsing captured output (no llama.cpp needed) ----------------------------------------------

PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
SPECULATIVE_STDERR = """Read 100 bytes from binary file /tmp/prompt.txt
0.00.312.135 E llama_init_from_model: failed to initialize the context: eagle3 requires ctx_other to be set
0.00.527.824 I common_speculative_init_result: loading draft model 'head.gguf'
0.01.824.229 I encoded   21 tokens in    0.295 seconds, speed:  179.386 t/s
0.01.824.252 I decoded    8 tokens in    0.200 seconds, speed:   40.000 t/s
0.01.824.265 I
0.01.824.279 I n_draft   = 3
0.01.824.292 I n_predict = 8
0.01.824.306 I n_drafted = 15
0.01.824.319 I n_accept  = 3
0.01.824.333 I accept    = 20.000%
0.01.824.510 I common_perf_print: prompt eval time =     395.45 ms /    42 tokens (...)
0.01.824.524 I common_perf_print:        eval time =      12.00 ms /     1 runs (...)
"""
COMPLETION_STDERR = """Read 100 bytes from binary file /tmp/prompt.txt
0.00.664.915 I common_perf_print: prompt eval time =      99.54 ms /    21 tokens (...)
0.00.664.915 I common_perf_print:        eval time =      62.27 ms /     7 runs (...)
0.00.664.916 I common_perf_print:       total time =     350.81 ms /    68 tokens
"""


def test_speculative_output_parsed_into_forwards():
    run = llamacpp_run.parse_speculative(
        f"\n\n{PROMPT}The capital of France is Paris.\n\n\n\n", SPECULATIVE_STDERR, PROMPT
    )
    assert run.text == "The capital of France is Paris."
    assert (run.prompt_tokens, run.tokens, run.drafted, run.accepted) == (21, 8, 15, 3)
    assert run.forwards == 5  # each round keeps its accepted drafts + one target token: 8 - 3
    assert run.tokens_per_forward == pytest.approx(8 / 5) and run.tokens_per_s == pytest.approx(40.0)
    assert run.target_seconds == pytest.approx(0.40745)  # the target's perf counters: batched + single forwards


def test_completion_output_parsed_with_and_without_end_of_text():
    stopped = llamacpp_run.parse_completion("The capital of France is Paris. [end of text]\n\n\n", COMPLETION_STDERR)
    assert (stopped.text, stopped.eos, stopped.prompt_tokens) == ("The capital of France is Paris.", True, 21)
    assert (stopped.tokens, stopped.forwards, stopped.decoded) == (8, 8, 7)  # the first token is the prompt's
    assert stopped.tokens_per_s == pytest.approx(7 / 0.06227) and stopped.target_seconds == pytest.approx(0.16181)
    cut = llamacpp_run.parse_completion("The capital of\n\n", COMPLETION_STDERR)
    assert (cut.text, cut.eos) == ("The capital of", False)


def test_output_without_counters_or_echo_is_an_error_quoting_stderr():
    with pytest.raises(llamacpp_build.LlamaCppError, match=r"no .*n_accept.*\n.*Read 100 bytes"):
        llamacpp_run.parse_speculative(
            f"\n\n{PROMPT}x\n\n\n\n", SPECULATIVE_STDERR.replace("n_accept", "n_acc"), PROMPT
        )
    with pytest.raises(llamacpp_build.LlamaCppError, match="did not echo the prompt"):
        llamacpp_run.parse_speculative("\n\nsomething else\n\n\n\n", SPECULATIVE_STDERR, PROMPT)


def test_identity_allows_the_speculative_overshoot_but_not_a_different_stop():
    plain = llamacpp_run.parse_completion("Paris is\n\n", COMPLETION_STDERR)
    stopped = llamacpp_run.parse_completion("Paris. [end of text]\n\n\n", COMPLETION_STDERR)
    spec = llamacpp_run.parse_speculative(f"\n\n{PROMPT}Paris is the\n\n\n\n", SPECULATIVE_STDERR, PROMPT)
    assert llamacpp_run.same_text(plain, spec)  # its last round drafted past n
    assert not llamacpp_run.same_text(stopped, spec)


# ---- the tools' command lines, with fake tools ----------------------------------------------------


def fake_tools(tmp_path, monkeypatch, exit_code=0):
    """A bin dir whose tools log their arguments, echo the prompt file like llama.cpp and print `stderr`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (tmp_path / "speculative.err").write_text(SPECULATIVE_STDERR)
    (tmp_path / "completion.err").write_text(COMPLETION_STDERR)
    prompt_file = 'f=$(for a; do [ "$prev" = -bf ] && echo "$a"; prev=$a; done)'
    scripts = {
        "llama-speculative-simple": f"{prompt_file}\nprintf '\\n\\n'; cat \"$f\"; printf 'Paris.\\n\\n\\n\\n'\n"
        f"cat {tmp_path}/speculative.err >&2",
        "llama-completion": f"printf 'Paris. [end of text]\\n\\n\\n'; cat {tmp_path}/completion.err >&2",
    }
    for name, body in scripts.items():
        path = bin_dir / name
        path.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/{name}.args\n{body}\nexit {exit_code}\n')
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("EAGLE_LLAMACPP_BIN", str(bin_dir))
    return lambda name: (tmp_path / f"{name}.args").read_text().split()


def test_runs_pass_n_k_and_threads_the_way_the_tools_count(tmp_path, monkeypatch):
    args = fake_tools(tmp_path, monkeypatch)
    head = llamacpp_run.run_head("t.gguf", "h.gguf", PROMPT, 16, 3, threads=1)
    assert head.text == "Paris." and head.forwards == 5
    spec = args("llama-speculative-simple")
    assert spec[spec.index("-n") + 1] == "15"  # the loop stops past -n: n - 1 asks for n
    assert spec[spec.index("--spec-draft-n-max") + 1] == "3" and spec[spec.index("-t") + 1] == "1"
    assert {"--no-escape", "-bf"} <= set(spec) and spec[spec.index("--temp") + 1] == "0"
    llamacpp_run.run_ngram("t.gguf", PROMPT, 16, 3)
    ngram = args("llama-speculative-simple")[len(spec) :]
    assert "-md" not in ngram and "-t" not in ngram
    # the lookup key at its measured best, 2 tokens (llama.cpp's default, 12, rarely fires), K drafts
    key, drafts = (ngram[ngram.index(f"--spec-ngram-simple-size-{x}") + 1] for x in "nm")
    assert (key, drafts) == ("2", "3")
    plain = llamacpp_run.run_plain("t.gguf", PROMPT, 16)
    completion = args("llama-completion")
    assert (plain.text, plain.eos) == ("Paris.", True) and completion[completion.index("-n") + 1] == "16"
    [measured] = llamacpp_run.measure("t.gguf", "h.gguf", [PROMPT], 3, 16)
    assert measured["identical"] and measured["tokens_per_forward"] == pytest.approx(8 / 5)


def test_eval_counts_forwards_as_tokens_less_accepted_drafts(tmp_path, monkeypatch, capsys):
    """eagle-eval --engine llamacpp on the fake tools (8 tokens, 3 accepted drafts per speculative run): every
    turn's forwards are 8 - 3 = 5, the pooled AL 16 / 10, tokens/s llama.cpp's own, turn 2 follows plain's text."""
    fake_tools(tmp_path, monkeypatch)
    head, out = tmp_path / "head.gguf", tmp_path / "r.json"
    head.write_bytes(b"")  # the fake tools never read it
    main(
        [
            *("--engine", "llamacpp", "--target", "smollm2-135m", "--draft", str(head), "--bench", "mt_bench"),
            *("--num-prompts", "1", "--max-new-tokens", "8", "--chain", "3", "--out", str(out)),
        ]
    )
    record = json.loads(out.read_text())
    first, second = record["prompts"][0]["turns"]
    assert second["prompt_tokens"] > first["prompt_tokens"] and first["answer"] == "Paris."
    drafters = ("spec", "ngram", "ngram-map-k", "ngram-mod", "ngram-cache", "hybrid")
    for turn in (first, second):
        for drafter in drafters:
            run = turn[drafter]
            assert (run["tokens"], run["accepted_total"], run["forwards"], run["emitted"]) == (8, 3, 5, 8)
            assert run["identical"]  # plain stopped at "Paris." [end of text], the speculative run wrote "Paris."
        assert (turn["plain"]["forwards"], turn["plain"]["timed_tokens"]) == (8, 7)
    summary = record["summary"]
    assert summary["acceptance_length"] == pytest.approx(16 / 10) and summary["accepted_drafts"] == 6
    assert summary["ngram"]["acceptance_length"] == pytest.approx(16 / 10)
    assert summary["spec_tokens_per_s"] == pytest.approx(16 / 0.4)  # decoded / seconds, pooled
    assert summary["plain_tokens_per_s"] == pytest.approx(14 / (2 * 0.06227))
    assert summary["speedup"] == pytest.approx((16 / 0.4) / (14 / (2 * 0.06227)))
    assert summary["acceptance_per_position"] is None  # llama.cpp counts accepted drafts in total only
    printed = capsys.readouterr().out
    assert "acceptance length (AL)      1.600   (16 tokens / 10 verification forwards)" in printed
    assert "acceptance per position     -" in printed and "2/2" in printed
    # each free type and head + n-gram is a row; the verdict names a configuration only with an interval
    labels = [summary["drafters"][d]["label"] for d in drafters[1:]]
    assert labels == [
        "n-gram (free, ngram-simple key 2)",
        "n-gram (free, ngram-map-k key 2)",
        "n-gram (free, ngram-mod key 2)",
        "n-gram (free, ngram-cache)",
        "head + n-gram",
    ]
    assert all(any(line.strip().startswith(label) for line in printed.splitlines()) for label in labels)
    assert summary["verdict"]["deploy"] is None and "verdict: cannot tell" in printed  # 2 turns bound no interval


def test_each_free_type_and_head_plus_ngram_is_run_and_served_with_its_own_flags(tmp_path, monkeypatch):
    """The flags each drafter runs with are the flags the verdict tells a user to serve with."""
    fake_tools(tmp_path, monkeypatch)
    engine = llamacpp.LlamaCppTurns("t.gguf", "h.gguf", None, 3, None)
    served = engine.configurations("target.gguf", "HEAD.gguf")
    assert served["hybrid"].serve == (
        "llama-server -m target.gguf -md HEAD.gguf --spec-type ngram-simple,draft-eagle3 "
        "--spec-ngram-simple-size-n 2 --spec-ngram-simple-size-m 3 --spec-draft-n-max 3"
    )
    assert served["ngram-mod"].serve == (
        "llama-server -m target.gguf --spec-type ngram-mod --spec-ngram-mod-n-match 2 --spec-ngram-mod-n-min 1 "
        "--spec-ngram-mod-n-max 3"
    )
    head_alone = "llama-server -m target.gguf -md HEAD.gguf --spec-type draft-eagle3 --spec-draft-n-max 3"
    assert served["spec"].serve == head_alone
    engine.tokenizer = SimpleNamespace(decode=lambda ids, **kw: PROMPT)
    for name, configuration in served.items():
        engine.decode(name, [[1]], 8)
        ran = (tmp_path / "llama-speculative-simple.args").read_text().splitlines()[-1]
        flags = configuration.serve.removeprefix("llama-server -m target.gguf ").replace("HEAD.gguf", "h.gguf")
        assert flags in ran, name


def test_eval_all_lines_up_llama_cpp_beside_the_builtin_runtime(random_head, tmp_path, monkeypatch, capsys):
    """--engine all: llama.cpp (the fake tools) decodes the turns the built-in runtime's plain answers make, in
    the one table; --threads goes to llama.cpp alone."""
    args = fake_tools(tmp_path, monkeypatch)
    out = tmp_path / "all.json"
    main(
        [
            *("--engine", "all", "--target", "smollm2-135m", "--draft", str(random_head[0]), "--bench", "mt_bench"),
            *("--num-prompts", "1", "--max-new-tokens", "4", "--chain", "2", "--threads", "1", "--out", str(out)),
        ]
    )
    record = json.loads(out.read_text())
    assert {"builtin", "llamacpp"} <= set(record)
    for b, c in zip(record["builtin"]["prompts"][0]["turns"], record["llamacpp"]["prompts"][0]["turns"]):
        assert c["prompt_ids"] == b["prompt_ids"] and c["answer"] == b["answer"]  # turn 2 follows builtin's answer
    assert record["llamacpp"]["summary"]["acceptance_length"] == pytest.approx(16 / 10)
    spec = args("llama-speculative-simple")
    assert spec[spec.index("-t") + 1] == "1"
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.strip().startswith("llamacpp")]
    assert [row[1] for row in rows] == ["head", *["n-gram"] * 4, "head"] and rows[0][2] == "1.600"


def test_failed_run_quotes_the_end_of_stderr(tmp_path, monkeypatch):
    fake_tools(tmp_path, monkeypatch, exit_code=1)
    with pytest.raises(
        llamacpp_build.LlamaCppError, match=r"(?s)llama-speculative-simple failed \(exit 1\).*n_accept  = 3"
    ):
        llamacpp_run.run_head("t.gguf", "h.gguf", PROMPT, 8, 3)


def test_no_build_says_how_to_build(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("EAGLE_LLAMACPP_BIN", raising=False)
    monkeypatch.setenv("EAGLE_TRAIN_CACHE", str(tmp_path))
    with pytest.raises(llamacpp_build.LlamaCppError, match="eagle-llamacpp build"):
        llamacpp_build.require_tools()
    with pytest.raises(SystemExit, match="build one with: eagle-llamacpp build"):
        llamacpp_build.main(["where"])
    monkeypatch.setenv("EAGLE_LLAMACPP_BIN", str(tmp_path))
    with pytest.raises(llamacpp_build.LlamaCppError, match="does not hold llama-completion"):
        llamacpp_build.tools_dir()


# ---- build(), its steps faked ---------------------------------------------------------------------


def fake_build(tmp_path, monkeypatch, fail_at=None):
    """Steps that write what pip and cmake would (an sdist, then the tools), or fail at `fail_at`."""
    monkeypatch.setenv("EAGLE_TRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("EAGLE_LLAMACPP_BIN", raising=False)  # CI points it at its real build
    monkeypatch.setattr(llamacpp_build.shutil, "which", lambda name: f"/usr/bin/{name}")
    calls = []

    def step(cmd, log):
        cmd = [str(c) for c in cmd]
        calls.append(cmd)
        if fail_at and fail_at in cmd:
            log.write("error: something broke\n")
            log.flush()
            raise llamacpp_build.LlamaCppError("step failed")
        if "download" in cmd:
            source = tmp_path / "llama_cpp_python-9.9/vendor/llama.cpp"
            source.mkdir(parents=True, exist_ok=True)
            (source / "CMakeLists.txt").write_text("project(llama)\n")
            (source / "convert_hf_to_gguf.py").write_text("")
            (source / "conversion").mkdir(exist_ok=True)
            (source / "gguf-py").mkdir(exist_ok=True)
            git = tmp_path / "llama_cpp_python-9.9/.git/modules/vendor/llama.cpp"  # the real sdist carries one
            git.mkdir(parents=True, exist_ok=True)
            (git / "config").write_text("")
            with tarfile.open(f"{cmd[cmd.index('-d') + 1]}/llama_cpp_python-9.9.tar.gz", "w:gz") as tar:
                tar.add(tmp_path / "llama_cpp_python-9.9", "llama_cpp_python-9.9")
        elif "-S" in cmd:
            assert cmd[cmd.index("-S") + 1].endswith("llama_cpp_python-9.9/vendor/llama.cpp")
            assert "-DCMAKE_BUILD_RPATH_USE_ORIGIN=ON" in cmd
        elif "--build" in cmd:
            out = tmp_path / "fake-bin"
            out.mkdir(exist_ok=True)
            bin_dir = f"{cmd[cmd.index('--build') + 1]}/bin"
            for tool in llamacpp_build.TOOLS:
                (out / tool).write_text("")
            llamacpp_build.shutil.copytree(out, bin_dir)

    monkeypatch.setattr(llamacpp_build, "step", step)
    return calls


def test_build_once_per_version_and_flags_into_the_cache(tmp_path, monkeypatch):
    calls = fake_build(tmp_path, monkeypatch)
    bin_dir = llamacpp_build.build("9.9", jobs=2)
    assert bin_dir.parent.parent == tmp_path / "cache/llamacpp" and bin_dir.parent.name.startswith("9.9-")
    assert bin_dir.name == "bin" and llamacpp_build.has_tools(bin_dir)
    assert "llama-cpp-python==9.9" in calls[0] and calls[2][-2:] == ["-j", "2"]
    assert {p.name for p in bin_dir.parent.iterdir()} == {"bin", "convert", "build.log"}  # the work dir is gone
    assert llamacpp_build.converter_script("9.9") == bin_dir.parent / "convert" / "convert_hf_to_gguf.py"
    assert llamacpp_build.build("9.9") == bin_dir and len(calls) == 3  # reused, nothing rerun
    # other build flags (a build that SIGILLs on this CPU, say) are never taken for this build
    monkeypatch.setattr(llamacpp_build, "CMAKE_FLAGS", (*llamacpp_build.CMAKE_FLAGS, "-DGGML_AVX512=OFF"))
    assert llamacpp_build.build("9.9") != bin_dir and len(calls) == 6


def test_failed_build_leaves_nothing_that_looks_built(tmp_path, monkeypatch):
    fake_build(tmp_path, monkeypatch, fail_at="--build")
    with pytest.raises(llamacpp_build.LlamaCppError, match="step failed"):
        llamacpp_build.build("9.9")
    home = llamacpp_build.home("9.9")
    assert {p.name for p in home.iterdir()} == {"build.log"}
    calls = fake_build(tmp_path, monkeypatch)
    assert llamacpp_build.has_tools(llamacpp_build.build("9.9")) and len(calls) == 3  # the next build starts over


def test_missing_toolchain_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE_TRAIN_CACHE", str(tmp_path))
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(llamacpp_build.shutil, "which", lambda name: None)
    with pytest.raises(llamacpp_build.LlamaCppError, match="needs cmake: pip install cmake"):
        llamacpp_build.build("9.9")
    monkeypatch.setattr(llamacpp_build.shutil, "which", lambda name: "/usr/bin/cmake" if name == "cmake" else None)
    with pytest.raises(llamacpp_build.LlamaCppError, match="needs a C\\+\\+ compiler: apt-get install g\\+\\+"):
        llamacpp_build.build("9.9")


# ---- eagle-eval --engine llamacpp: what is refused before llama.cpp runs ------------------------------


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--target", "HuggingFaceTB/SmolLM2-135M-Instruct"], "needs --target as a .gguf file or an alias"),
        (["--tree", "3,2,4"], "--tree: the built-in runtime's"),
        (["--temperature", "0.7"], "decodes greedily"),
        (["--chain", "0"], "must be >= 1"),
    ],
)
def test_eval_llamacpp_refuses_what_it_cannot_do(extra, message, tmp_path):
    args = ["--engine", "llamacpp", "--target", "smollm2-135m", "--draft", str(tmp_path / "h.gguf"), *extra]
    with pytest.raises(SystemExit, match=message):
        main([*args, "--out", str(tmp_path / "r.json")])


# ---- a real llama.cpp build ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def target_gguf():
    if llamacpp_build.tools_dir() is None:
        pytest.skip(
            "no llama.cpp build (EAGLE_LLAMACPP_BIN unset, none in the cache): `eagle-llamacpp build` builds one"
        )
    from eagle_train.target import SMOLLM2
    from eagle_train.target import target_gguf as gguf_of

    return gguf_of(SMOLLM2)


@pytest.fixture(scope="module")
def random_head(smollm2, tmp_path_factory):
    """An untrained SmolLM2 head saved as a checkpoint and exported to GGUF: (directory, gguf)."""
    from eagle_train.export.gguf import export_gguf
    from eagle_train.methods.eagle3.head import Eagle3Head
    from eagle_train.target import SMOLLM2

    torch.manual_seed(0)
    head = Eagle3Head.from_target(smollm2[0], draft_vocab_size=8192)
    path = tmp_path_factory.mktemp("head")
    head.save_pretrained(path / "checkpoint")
    return path / "checkpoint", export_gguf(head, path / "head.gguf", SMOLLM2)


def templated(tokenizer, question):
    from inference.evaluate import chat_ids

    ids = chat_ids(tokenizer, [{"role": "user", "content": question}])
    return ids, tokenizer.decode(ids, clean_up_tokenization_spaces=False)


def test_exported_head_decodes_as_plain_at_the_builtin_runtimes_tokens_per_forward(smollm2, random_head, target_gguf):
    from eagle_train.checkpoint import load_draft_head
    from inference.drafting import TreeShape
    from inference.generate import Runtime
    from inference.sampling import Sampler

    model, tokenizer = smollm2
    ids, prompt = templated(tokenizer, "What is the capital of France? Answer in one word.")
    plain = llamacpp_run.run_plain(target_gguf, prompt, 16, threads=1)
    head = llamacpp_run.run_head(target_gguf, random_head[1], prompt, 16, 3, threads=1)
    assert head.prompt_tokens == plain.prompt_tokens == len(ids)  # llama.cpp read the prompt as templated
    assert head.drafted > 0 and llamacpp_run.same_text(plain, head)
    builtin_head = load_draft_head(random_head[0], model).eval()
    eos = {tokenizer.eos_token_id}
    runtime = Runtime(model, builtin_head, TreeShape.chain(3), Sampler(0.0, 0, 1.0), eos_token_ids=eos)
    builtin = runtime.generate(ids, 16)
    assert tokenizer.decode(builtin.output_ids, skip_special_tokens=True) == plain.text
    # Same head, same text: the counts differ at the ends (llama.cpp's first round drafts, the built-in
    # prefill does not; its last round may overshoot by K tokens) and where the numerics flip a draft. A trained
    # head on 12 MT-Bench turns x 32 tokens, K=3, f32 GGUF: within 0.056 per turn (pooled 1.307 vs 1.296);
    # this untrained one gives 1.0 in both.
    assert head.tokens_per_forward == pytest.approx(builtin.acceptance_length, abs=0.1)


def test_ngram_drafting_runs_without_a_head(smollm2, target_gguf):
    sentence = "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm windowsill."
    _, prompt = templated(smollm2[1], f'Repeat the following text exactly: "{sentence}"')
    plain = llamacpp_run.run_plain(target_gguf, prompt, 24, threads=1)
    ngram = llamacpp_run.run_ngram(target_gguf, prompt, 24, 3, threads=1)
    assert llamacpp_run.same_text(plain, ngram)
    assert ngram.accepted > 0 and ngram.tokens_per_forward > 1.5  # the copy is drafted from the prompt


def test_broken_head_fails_with_llama_cpps_reason(random_head, target_gguf, tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(random_head[1].read_bytes()[:100_000])
    with pytest.raises(llamacpp_build.LlamaCppError, match="(?s)exit 1.*failed to load draft model"):
        llamacpp_run.run_head(target_gguf, broken, PROMPT, 4, 2, threads=1)


def test_eval_llamacpp_exports_the_checkpoint_and_writes_one_record(random_head, target_gguf, tmp_path, capsys):
    out = tmp_path / "r.json"
    main(
        [
            *("--engine", "llamacpp", "--target", "smollm2-135m", "--draft", str(random_head[0])),
            *("--bench", "gsm8k", "--num-prompts", "1", "--max-new-tokens", "8", "--chain", "2", "--threads", "1"),
            *("--out", str(out)),
        ]
    )
    record = json.loads(out.read_text())
    assert record["engine"] == "llamacpp" and record["drafting"]["depth"] == 2
    turn = record["prompts"][0]["turns"][0]
    assert turn["spec"]["identical"] and turn["ngram"]["identical"]
    assert turn["spec"]["tokens"] >= 8 and turn["plain"]["tokens"] == 8
    summary = record["summary"]
    assert summary["turns_identical_to_plain"] == 1 and summary["ngram"]["turns_identical_to_plain"] == 1
    printed = capsys.readouterr().out
    assert "acceptance length (AL)" in printed and "n-gram (free)" in printed
