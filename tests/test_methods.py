"""A method is one folder plus one row: another method (`tests/twin_method/`: its head class, builder and own config
key), registered as a row naming them by reference under a key of its own, with an export layout of its own, trains
with its key in the run's config, exports and is evaluated by the built-in runtime with no other file changed."""

import dataclasses
import json

import pytest

from eagle_train import methods, train_config
from eagle_train.export.layouts import LAYOUTS, PROVENANCE_KEY
from eagle_train.train_checkpoint import read_state

TWIN = dataclasses.replace(
    methods.METHODS["eagle3"],
    title="EAGLE-3 twin",
    head_at="twin_method.head:TwinHead",
    build_head_at="twin_method.train:build_twin_head",
    train_keys_at="twin_method.config:TrainKeys",
    layouts=("twin",),
)
# the twin's own layout: the eagle3 layout's keys (vLLM reads them as EAGLE-3's), told apart by the method it holds
TWIN_LAYOUT = dataclasses.replace(
    LAYOUTS["eagle3"],
    name="twin",
    engines=("vllm",),
    matches=lambda c: (c.get(PROVENANCE_KEY) or {}).get("method") == "twin",
)


def test_every_row_names_what_it_needs():
    for name, row in methods.METHODS.items():
        assert row.family in methods.FAMILIES, name
        assert callable(row.build_head) and callable(row.objective) and isinstance(row.head_class, type)
        assert (row.drafts is None) == (row.family != "block"), name  # a block's drafts follow its config
        for keys in (row.train_keys, row.head_keys):  # keyword-only: they follow the required common fields
            assert keys is None or all(f.kw_only for f in dataclasses.fields(keys)), name
    with pytest.raises(ValueError, match=f"'medusa' is not one of {', '.join(methods.METHODS)}$"):
        methods.row("medusa")


def test_a_fifth_method_is_one_row(monkeypatch, tiny_llama_dir, small_tokenized, tmp_path, capsys):
    from eagle_cli.evaluate import main as evaluate
    from eagle_cli.export import main as export
    from eagle_cli.train import main as train
    from eagle_train.checkpoint import load_draft_head
    from engines import ENGINES

    monkeypatch.setitem(methods.METHODS, "twin", TWIN)
    monkeypatch.setattr(train_config, "TrainConfig", train_config.train_config_class())  # as if the row were at import
    monkeypatch.setitem(LAYOUTS, "twin", TWIN_LAYOUT)
    monkeypatch.setattr(ENGINES["vllm"], "layouts", (*ENGINES["vllm"].layouts, "twin"))
    run, out = tmp_path / "run", tmp_path / "export"
    train(
        ["--config", "eagle3_smollm2", "method=twin", "mode=online", f"target={tiny_llama_dir}"]
        + [f"data_path={small_tokenized}", f"output_dir={run}", "max_steps=2", "warmup_steps=1", "ttt_length=2"]
        + ["tokens_per_batch=256", "max_length=128", "eval_fraction=0", "report_to=none", "save_every=0"]
        + ["twin_note=its own key"]
    )
    config = read_state(run / "checkpoint-2")["config"]
    assert config["twin_note"] == "its own key" and config["ttt_length"] == 2
    head = load_draft_head(run / "final")
    assert head.config.method == "twin" and type(head).__name__ == "TwinHead"
    with pytest.raises(SystemExit) as exported:  # vLLM's rules: the tiny target's layers suit its aux layer ids
        export(
            [str(run / "final"), "--format", "twin", "--out", str(out), "--target", str(tiny_llama_dir)]
            + ["--engine", "vllm"]
        )
    assert exported.value.code == 0
    assert "vLLM (twin layout)" in capsys.readouterr().out
    for draft in (run / "final", out):  # the checkpoint (the twin's row) and the engine layout it was written in
        results = tmp_path / "eval.json"
        evaluate(
            ["--target", str(tiny_llama_dir), "--draft", str(draft), "--bench", "mt_bench", "--num-prompts", "1"]
            + ["--max-new-tokens", "8", "--chain", "2", "--no-ngram", "--out", str(results)]
        )
        summary = json.loads(results.read_text())["summary"]
        assert summary["turns"] == 2 and summary["turns_identical_to_plain"] == 2
    assert "chain K=2" in capsys.readouterr().out


@dataclasses.dataclass(kw_only=True)
class DepthKeys:
    num_depths: int = 3  # P-EAGLE's key, defined again


@dataclasses.dataclass(kw_only=True)
class SeedKeys:
    seed: int = 1  # a common key, defined again


@pytest.mark.parametrize(
    "keys,first",
    [
        ("DepthKeys", "eagle_train.methods.peagle.config:TrainKeys (peagle)"),
        ("SeedKeys", "eagle_train.train_config:CommonTrainConfig"),
    ],
)
def test_a_key_defined_twice_is_refused_naming_both(monkeypatch, keys, first):
    monkeypatch.setitem(methods.METHODS, "twin", dataclasses.replace(TWIN, train_keys_at=f"{__name__}:{keys}"))
    with pytest.raises(TypeError) as refused:
        train_config.train_config_class()
    message = str(refused.value)
    assert message.startswith("config key ") and "is defined twice: by " in message and "\n" not in message
    assert first in message and message.endswith(f" and by {__name__}:{keys} (twin)")
