"""The one table of target architectures per stage, and its one-line refusals."""

from types import SimpleNamespace

import pytest

from eagle_train.architectures import ARCHITECTURES, check_supported, supported
from eagle_train.draft_config import DraftConfig


def target(model_type: str):
    return SimpleNamespace(model_type=model_type)


def test_training_takes_every_listed_type_and_the_runtime_the_dense_rope_ones():
    assert supported("training") == sorted(ARCHITECTURES)
    assert supported("runtime") == ["llama", "mistral", "qwen2", "qwen3"]


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_a_head_trains_for_a_moe_target_and_the_runtime_refuses_it_in_one_line_with_the_reason(model_type):
    check_supported(target(model_type), "training")
    with pytest.raises(ValueError, match=r"runtime does not take .*mixture-of-experts.*--engine vllm") as err:
        check_supported(target(model_type), "runtime")
    assert "\n" not in str(err.value)


def test_an_unknown_type_is_refused_by_training_naming_the_known_ones():
    config = SimpleNamespace(text_config=target("gemma3"))
    with pytest.raises(ValueError, match=r"training a draft head does not take target model_type 'gemma3'.*llama"):
        check_supported(config, "training")
    with pytest.raises(ValueError, match="does not take target model_type 'gemma3'"):
        DraftConfig.from_target_config(config)


# ------------------------------------------------------------------------------ refused before any compute


@pytest.fixture(scope="module")
def gemma2_dir(tmp_path_factory):
    """A saved tiny random Gemma2 (a decoder training does not take) with SmolLM2's tokenizer."""
    from transformers import AutoModelForCausalLM, Gemma2Config

    from eagle_train.target import SMOLLM2, load_tokenizer

    sizes = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    config = Gemma2Config(vocab_size=49152, num_hidden_layers=2, **sizes)
    path = tmp_path_factory.mktemp("tiny-gemma2")
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    load_tokenizer(SMOLLM2).save_pretrained(path)
    return path


REFUSAL = r"^eagle-prep \w+: error: training a draft head does not take target model_type 'gemma2': .*--target"


@pytest.mark.parametrize("command", ["distil", "capture", "tokenize", "regenerate", "run"])
def test_eagle_prep_refuses_a_target_training_cannot_take_before_loading_it(
    command, gemma2_dir, conversations_jsonl, tmp_path, monkeypatch
):
    from data_prep import cli

    monkeypatch.setattr(cli, "load_target", lambda *a, **k: pytest.fail("the target loaded"))
    out = tmp_path / "out"
    if command == "run":
        config = tmp_path / "prep.yaml"
        config.write_text(f"target: {gemma2_dir}\ndata: {conversations_jsonl}\nout_dir: {out}\n")
        argv = ["run", "--config", str(config)]
    else:
        data = tmp_path / "no-tokenized-dir" if command == "capture" else conversations_jsonl
        argv = [command, "--target", str(gemma2_dir), "--data", str(data), "--out", str(out)]
    with pytest.raises(SystemExit, match=REFUSAL) as err:
        cli.main(argv)
    assert "\n" not in str(err.value) and not out.exists()


def test_training_refuses_a_target_it_cannot_take_before_loading_it(gemma2_dir, tmp_path, monkeypatch):
    import importlib.util
    from pathlib import Path

    from eagle_train import trainer
    from eagle_train.eagle3_train import build_eagle3_head, eagle3_objective
    from eagle_train.train_config import load_train_config

    monkeypatch.setattr(trainer, "build_model", lambda *a: pytest.fail("the target loaded"))
    overrides = [f"target={gemma2_dir}", f"data_path={tmp_path / 'store'}", f"output_dir={tmp_path / 'run'}"]
    with pytest.raises(ValueError, match="does not take target model_type 'gemma2'"):
        trainer.train(load_train_config(None, overrides), build_eagle3_head, eagle3_objective(3, 0.8, False))
    for script in ("train_eagle3.py", "train_peagle.py"):  # the scripts say it in one line
        path = Path(__file__).parents[1] / "scripts" / script
        spec = importlib.util.spec_from_file_location(script[:-3], path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        with pytest.raises(SystemExit, match=r"^error: training a draft head does not take .*'gemma2'") as err:
            module.main(overrides)
        assert "\n" not in str(err.value)
    assert not (tmp_path / "run").exists()
