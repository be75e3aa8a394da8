"""The draft model (method draft_model): built from the target's own layers it computes what they compute, it drafts
losslessly in the built-in runtime, and it trains, saves and loads back through the shared trainer."""

import shutil
from pathlib import Path

import pytest
import torch
from test_trainer import config

from eagle_train.checkpoint import load_draft_head
from eagle_train.methods import check_method, method_of, objective_for
from eagle_train.methods.draft_model.model import DraftModel
from eagle_train.target import load_target_config
from eagle_train.train_config import validate
from eagle_train.trainer import train
from inference.drafting import TreeShape
from inference.generate import Runtime
from inference.sampling import Sampler


def draft_of(target_dir, layers, weights=True):
    config = load_target_config(str(target_dir))
    return DraftModel.from_target(
        config, layers, target=str(target_dir), weights_from=str(target_dir) if weights else None
    )


def test_a_draft_of_every_target_layer_computes_the_targets_logits(tiny_llama_dir, tiny_llama):
    target = tiny_llama[0]
    draft = draft_of(tiny_llama_dir, [0, 1, 2, 3])
    ids = torch.randint(0, 49152, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = target(input_ids=ids).logits
        got = draft.logits(draft.hidden(ids))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())
    assert draft.tied and "lm.lm_head.weight" not in draft.saved_state_dict()  # tied as the target ties them


def test_draft_layer_j_is_the_target_layer_it_names(tiny_llama_dir, tiny_llama):
    target = tiny_llama[0]
    draft = draft_of(tiny_llama_dir, [3, 1])
    for j, i in enumerate([3, 1]):
        mine, theirs = draft.lm.model.layers[j].state_dict(), target.model.layers[i].state_dict()
        assert mine.keys() == theirs.keys()
        assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert torch.equal(draft.lm.model.norm.weight, target.model.norm.weight)
    random = draft_of(tiny_llama_dir, [3, 1], weights=False)
    assert not torch.equal(random.lm.model.layers[0].mlp.up_proj.weight, target.model.layers[3].mlp.up_proj.weight)


@pytest.mark.parametrize("k", [1, 3])
def test_the_runtime_drafts_losslessly_and_a_draft_equal_to_the_target_is_always_accepted(
    k, tiny_llama_dir, tiny_llama
):
    target = tiny_llama[0]
    prompt = torch.randint(3, 49152, (7,), generator=torch.Generator().manual_seed(1)).tolist()
    whole, cut = draft_of(tiny_llama_dir, [0, 1, 2, 3]), draft_of(tiny_llama_dir, [0])
    for draft in (whole, cut):
        runtime = Runtime(target, draft, TreeShape.chain(k), cuda_graphs=False)
        spec, plain = runtime.generate(prompt, 20), runtime.generate_plain(prompt, 20)
        assert spec.output_ids == plain.output_ids
    assert spec.forwards > 0 and all(a <= k for a in spec.accepted)
    exact = Runtime(target, whole, TreeShape.chain(k), cuda_graphs=False).generate(prompt, 20)
    assert exact.accepted[:-1] == [k] * (len(exact.accepted) - 1)  # every round but the cut last one
    # sampling: q is p itself, so every draft is accepted (min(1, p/q) = 1): the drafts' q reach the sampler
    sampled = Runtime(target, whole, TreeShape.chain(k), Sampler(temperature=1.0), cuda_graphs=False, seed=0)
    result = sampled.generate(prompt, 20)
    assert result.accepted[:-1] == [k] * (len(result.accepted) - 1)


def run(cfg):
    return train(cfg, method_of(cfg).build_head, objective_for(cfg))


def test_eagle_eval_takes_any_causal_lm_directory_and_names_it_a_draft_model(tiny_llama_dir, tmp_path, capsys):
    """The target's own directory as the draft: every draft accepted (AL K+1), and the table and the verdict call
    it a draft model beside n-gram and the two together."""
    import json

    from eagle_cli.evaluate import main

    out = tmp_path / "r.json"
    args = ["--target", str(tiny_llama_dir), "--draft", str(tiny_llama_dir), "--chain", "2", "--num-prompts", "1"]
    main([*args, "--max-new-tokens", "12", "--bench", "gsm8k", "--out", str(out)])
    summary = json.loads(out.read_text())["summary"]
    assert summary["label"] == "draft model" and summary["acceptance_length"] > 2.5
    assert {row["label"] for row in summary["drafters"].values()} >= {"draft model + n-gram"}
    assert "draft model vs n-gram (free): draft model AL" in capsys.readouterr().out


def test_a_draft_model_learns_and_loads_back_as_it_was_saved(train_store, smollm2, tmp_path):
    overrides = ["method=draft_model", "draft_num_layers=1", "eval_fraction=0.2", "num_epochs=2", "ttt_length=2"]
    done = run(config(train_store, tmp_path / "a", *overrides))
    assert done["eval_after"]["loss"] < done["eval_before"]["loss"]
    assert done["eval_after"]["count_rounds"] > 0 and 1 <= done["eval_after"]["chain_al"] <= 3
    draft = load_draft_head(tmp_path / "a" / "final", smollm2[0])
    assert isinstance(draft, DraftModel) and draft.config.num_hidden_layers == 1
    assert draft.config.draft_vocab_size == smollm2[0].config.vocab_size  # the whole vocabulary, as engines serve it
    first_layer = smollm2[0].model.layers[0].self_attn.q_proj.weight
    assert not torch.equal(draft.lm.model.layers[0].self_attn.q_proj.weight, first_layer)  # trained away from it
    again = run(config(train_store, tmp_path / "b", *overrides, f"init_from={tmp_path / 'a' / 'final'}", "max_steps=1"))
    assert again["eval_before"]["loss"] == pytest.approx(done["eval_after"]["loss"], rel=1e-5)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["draft_layers=[0,30]"], r"draft_layers must name layers of the 30-layer target \(0 to 29\)"),
        (["draft_layers=[0,1]", "draft_num_layers=3"], "draft_layers names 2 layers and draft_num_layers says 3"),
        (["draft_init=zeros"], "draft_init must be one of target, random"),
    ],
)
def test_its_keys_are_checked_before_any_compute(overrides, match, train_store, smollm2, tmp_path):
    cfg = config(train_store, tmp_path, "method=draft_model", *overrides)
    validate(cfg, smollm2[0].config)  # the common checks pass: the method's own refuse
    with pytest.raises(ValueError, match=match) as err:
        check_method(cfg, smollm2[0].config)
    assert "\n" not in str(err.value)


def test_the_model_directory_export_is_what_transformers_loads_and_reads_back(tiny_llama_dir, tiny_llama, tmp_path):
    from conftest import tiny_target
    from transformers import AutoModelForCausalLM

    from eagle_train.export import export_head
    from eagle_train.target import load_tokenizer

    target, tokenizer = tiny_llama
    draft = draft_of(tiny_llama_dir, [2, 0])
    out = export_head(draft, tmp_path / "export", "draft_model", dtype="fp32")
    loaded = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.randint(0, 49152, (1, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = draft.logits(draft.hidden(ids))
        torch.testing.assert_close(loaded(input_ids=ids).logits, want, rtol=0, atol=1e-5 * want.abs().max().item())
    assert load_tokenizer(str(out)).get_vocab() == tokenizer.get_vocab()  # the target's tokenizer ships with it
    back = load_draft_head(out, target)
    assert isinstance(back, DraftModel) and back.config.num_hidden_layers == 2
    mine, theirs = draft.saved_state_dict(), back.saved_state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)

    other = tmp_path / "other"  # a causal LM of another vocabulary: refused in one line
    tiny_target(vocab_size=1000, num_hidden_layers=2).save_pretrained(other)
    with pytest.raises(ValueError, match=r"vocabulary \(1000 tokens\) is not the target's \(49152\)") as err:
        load_draft_head(other, target)
    assert "\n" not in str(err.value)


def llamacpp_draft(smollm2, layers, path):
    """(the target's GGUF, a draft of SmolLM2's `layers` as the GGUF llama.cpp's converter writes, the draft)."""
    from eagle_train.target import SMOLLM2, target_gguf
    from engines import llamacpp_build
    from engines.llamacpp import draft_gguf

    if llamacpp_build.tools_dir() is None:
        pytest.skip("no llama.cpp build (EAGLE_LLAMACPP_BIN unset, none in the cache): `eagle-llamacpp build`")
    draft = DraftModel.from_target(smollm2[0].config, layers, target=SMOLLM2, weights_from=SMOLLM2)
    return target_gguf(SMOLLM2), draft_gguf(draft, path, target_gguf(SMOLLM2), "f32"), draft


PROMPT = "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n"


def test_llamacpp_drafts_with_the_converters_gguf(smollm2, tmp_path):
    from gguf import GGUFReader

    from eagle_train.export.gguf import with_tokenizer
    from eagle_train.target import SMOLLM2
    from engines.llamacpp_build import LlamaCppError
    from engines.llamacpp_rules import static_findings
    from engines.llamacpp_run import drafting, run_head, run_plain, same_text

    target, gguf, _ = llamacpp_draft(smollm2, [0, 1], tmp_path / "draft.gguf")
    assert drafting(gguf).spec_type == "draft-simple"
    assert not static_findings(gguf, SMOLLM2, None)  # llama.cpp's own vocabulary rule: the target's tokenizer
    plain, spec = run_plain(target, PROMPT, 24, threads=1), run_head(target, gguf, PROMPT, 24, 3, threads=1)
    assert same_text(plain, spec) and spec.drafted > 0

    # one token's text otherwise: the rule refuses the pair, and so does llama.cpp itself
    other = Path(shutil.copy(gguf, tmp_path / "other.gguf"))
    with_tokenizer(other, GGUFReader(tokenizer_file(target, tmp_path / "tokenizer.gguf", changed=100)))
    (finding,) = static_findings(other, SMOLLM2, None)
    assert finding.severity == "error" and "1 tokens differ from the target's (the first: id 100)" in finding.message
    with pytest.raises(LlamaCppError, match="the target and draft vocabs are not compatible"):
        run_head(target, other, PROMPT, 24, 3, threads=1)


def tokenizer_file(target, path, changed: int) -> Path:
    """A GGUF of the target GGUF's tokenizer keys alone, token `changed`'s text altered."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    from eagle_train.export.gguf import copy_keys, field_value

    reader = GGUFReader(target)
    writer = GGUFWriter(path, arch="llama")
    copy_keys(reader, writer, lambda key: key.startswith("tokenizer.") and key != "tokenizer.ggml.tokens")
    tokens = field_value(reader.fields["tokenizer.ggml.tokens"])
    tokens[changed] = tokens[changed] + b"~"
    writer.add_key_value("tokenizer.ggml.tokens", tokens, GGUFValueType.ARRAY)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.slow
def test_llamacpp_accepts_a_target_drafting_for_itself_and_the_file_reads_back_as_the_draft(smollm2, tmp_path):
    from engines.llamacpp_run import run_head, run_plain, same_text

    target, gguf, draft = llamacpp_draft(smollm2, list(range(30)), tmp_path / "draft.gguf")
    plain, spec = run_plain(target, PROMPT, 24, threads=1), run_head(target, gguf, PROMPT, 24, 3, threads=1)
    assert same_text(plain, spec)
    assert spec.drafted > 0 and spec.accepted >= 0.9 * spec.drafted
    back = load_draft_head(gguf, smollm2[0])  # the model transformers reads in the file
    mine, theirs = draft.saved_state_dict(), back.saved_state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_init_from_a_sibling_model_fine_tunes_it_and_another_tokenizer_is_refused(
    tiny_llama_dir, train_store, smollm2, tmp_path
):
    """init_from any causal LM directory with the target's tokenizer (here a 4-layer Llama of hidden 32 with
    SmolLM2's tokenizer, a stand-in for Qwen3-0.6B beside Qwen3-8B) trains as it is; another tokenizer is refused."""
    overrides = ["method=draft_model", "max_steps=2", "eval_fraction=0.2"]
    done = run(config(train_store, tmp_path / "run", *overrides, f"init_from={tiny_llama_dir}"))
    assert done["eval_after"]["loss"] < done["eval_before"]["loss"]
    tuned = load_draft_head(tmp_path / "run" / "final", smollm2[0])
    assert (tuned.config.model_config["hidden_size"], tuned.config.num_hidden_layers) == (32, 4)

    other = tmp_path / "other"
    shutil.copytree(tiny_llama_dir, other)
    tokenizer = smollm2[1].__class__.from_pretrained(str(other))
    tokenizer.add_tokens(["<not-in-the-target>"])
    tokenizer.save_pretrained(other)
    cfg = config(train_store, tmp_path / "refused", *overrides, f"init_from={other}")
    with pytest.raises(ValueError, match="does not share the target's tokenizer") as err:
        check_method(cfg, smollm2[0].config)
    assert "\n" not in str(err.value)
