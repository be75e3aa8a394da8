"""The one table of target architectures per stage, and its one-line refusals."""

import pytest
from conftest import load_script

from eagle_train.architectures import check_supported
from eagle_train.draft_config import DraftConfig


def config(model_type: str, **changes):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **changes)


@pytest.mark.parametrize(
    ("model_type", "reason"),
    [("gpt2", "keeps no decoder layers at model.model.layers"), ("t5", "encoder-decoder")],
)
def test_training_refuses_a_model_capture_cannot_read_in_one_line_with_the_reason(model_type, reason):
    with pytest.raises(ValueError, match=rf"training a draft head does not take .*'{model_type}': .*{reason}") as err:
        check_supported(config(model_type), "training")
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=f"does not take target model_type '{model_type}'"):
        DraftConfig.from_target_config(config(model_type))


def test_the_runtime_refuses_layers_a_kv_cache_cannot_roll_back_and_training_takes_them():
    hybrid = config("lfm2", num_hidden_layers=4, layer_types=["conv", "full_attention", "conv", "full_attention"])
    check_supported(hybrid, "training")
    with pytest.raises(ValueError, match=r"runtime does not take .*'lfm2': its conv layers .*--engine vllm") as err:
        check_supported(hybrid, "runtime")
    assert "\n" not in str(err.value)


def test_a_model_whose_forward_the_slot_cache_cannot_run_is_refused_in_one_line():
    """Bamba's Mamba layers keep a state of their own: refused from the config where it says so, else by the
    runtime's check of itself against a plain forward (transformers versions differ)."""
    from transformers import AutoModelForCausalLM

    from inference.hf_target import HFTarget

    sizes = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    mamba = dict(mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16, mamba_chunk_size=16)  # not its 9B defaults
    bamba = config("bamba", num_hidden_layers=4, **sizes, **mamba)
    check_supported(bamba, "training")
    with pytest.raises(
        ValueError, match=r"runtime (does not take|cannot verify drafts for) target model_type 'bamba'"
    ) as err:
        HFTarget(AutoModelForCausalLM.from_config(bamba).eval())
    assert "\n" not in str(err.value)


# ------------------------------------------------------------------------------ refused before any compute


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    """A saved tiny random GPT-2 (its layers are at transformer.h: training does not take it) with SmolLM2's
    tokenizer."""
    from transformers import AutoModelForCausalLM, GPT2Config

    from eagle_train.target import SMOLLM2, load_tokenizer

    path = tmp_path_factory.mktemp("tiny-gpt2")
    AutoModelForCausalLM.from_config(GPT2Config(vocab_size=49152, n_embd=32, n_layer=2, n_head=4)).save_pretrained(path)
    load_tokenizer(SMOLLM2).save_pretrained(path)
    return path


REFUSAL = r"^eagle-prep \w+: error: training a draft head does not take target model_type 'gpt2': .*--target"


@pytest.mark.parametrize("command", ["distil", "capture", "tokenize", "regenerate", "run"])
def test_eagle_prep_refuses_a_target_training_cannot_take_before_loading_it(
    command, gpt2_dir, conversations_jsonl, tmp_path, monkeypatch
):
    from data_prep import cli

    monkeypatch.setattr(cli, "load_target", lambda *a, **k: pytest.fail("the target loaded"))
    out = tmp_path / "out"
    if command == "run":
        config = tmp_path / "prep.yaml"
        config.write_text(f"target: {gpt2_dir}\ndata: {conversations_jsonl}\nout_dir: {out}\n")
        argv = ["run", "--config", str(config)]
    else:
        data = tmp_path / "no-tokenized-dir" if command == "capture" else conversations_jsonl
        argv = [command, "--target", str(gpt2_dir), "--data", str(data), "--out", str(out)]
    with pytest.raises(SystemExit, match=REFUSAL) as err:
        cli.main(argv)
    assert "\n" not in str(err.value) and not out.exists()


def test_training_refuses_a_target_it_cannot_take_before_loading_it(gpt2_dir, tmp_path, monkeypatch):
    from eagle_train import trainer
    from eagle_train.methods import objective_for
    from eagle_train.methods.eagle3.train import build_eagle3_head
    from eagle_train.train_config import load_train_config

    monkeypatch.setattr(trainer, "build_model", lambda *a: pytest.fail("the target loaded"))
    overrides = [f"target={gpt2_dir}", f"data_path={tmp_path / 'store'}", f"output_dir={tmp_path / 'run'}"]
    cfg = load_train_config(None, overrides)
    with pytest.raises(ValueError, match="does not take target model_type 'gpt2'"):
        trainer.train(cfg, build_eagle3_head, objective_for(cfg))
    for script in ("train_eagle3.py", "train_peagle.py"):  # the scripts say it in one line
        module = load_script(script)
        with pytest.raises(SystemExit, match=r"^error: training a draft head does not take .*'gpt2'") as err:
            module.main(overrides)
        assert "\n" not in str(err.value)
    assert not (tmp_path / "run").exists()
