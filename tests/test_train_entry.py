"""eagle-train: shipped configs by name, the keys a run takes from its data, and one path from config to objective."""

import json
import shutil

import pytest

from eagle_train.config_files import SHIPPED, config_file, shipped_names
from eagle_train.methods import METHODS, objective_for
from eagle_train.peagle_train import PEagleObjective, segments_for
from eagle_train.store import MANIFEST, VOCAB_MAP, read_manifest
from eagle_train.train import main
from eagle_train.train_config import TrainConfig, load_train_config


def test_a_config_is_a_path_that_exists_or_a_shipped_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # an empty directory, as after a wheel install
    assert config_file("eagle3_smollm2") == config_file("eagle3_smollm2.yaml") == SHIPPED / "eagle3_smollm2.yaml"
    assert config_file("configs/smollm2_sharegpt.yaml") == SHIPPED / "smollm2_sharegpt.yaml"
    mine = tmp_path / "eagle3_smollm2.yaml"
    mine.write_text("learning_rate: 1.0e-3\n")
    assert config_file("eagle3_smollm2.yaml").resolve() == mine  # a file that exists wins
    with pytest.raises(FileNotFoundError, match=r"^config /else/peagle_smollm2.yaml is neither .*: .*eagle3_smollm2"):
        config_file("/else/peagle_smollm2.yaml")  # a missing path never falls back to a shipped file
    assert {"eagle3_smollm2", "peagle_smollm2"} <= set(shipped_names("method"))
    assert "smollm2_sharegpt" in shipped_names("prep") and "smollm2_sharegpt" not in shipped_names("method")
    assert (SHIPPED / "accelerate" / "ddp.yaml").is_file() and (SHIPPED / "deepspeed" / "zero2.json").is_file()


def test_help_explains_the_methods_overrides_data_output_and_launch(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    for needed in [*METHODS, "key=value", "mode=online", "resume=auto", "checkpoint-<step>", "accelerate launch"]:
        assert needed in text, needed
    assert str(SHIPPED / "accelerate") in text and "eagle3_smollm2" in text


def data_like(store, out, **manifest_changes):
    """A copy of `store`'s manifest and vocab map (what a run's config reads) with `manifest_changes`."""
    out.mkdir()
    shutil.copy(store / VOCAB_MAP, out / VOCAB_MAP)
    manifest = {**read_manifest(store), **manifest_changes}
    (out / MANIFEST).write_text(json.dumps(manifest))
    return out


def test_unset_keys_come_from_the_data(train_store, train_tokenized, tmp_path):
    store = data_like(train_store, tmp_path / "store", max_length=96, aux_layer_ids=[1, 10, 20])
    cfg = load_train_config(None, [f"data_path={store}"])
    assert (cfg.max_length, cfg.aux_layer_ids, cfg.draft_vocab_size) == (96, [1, 10, 20], 256)
    online = load_train_config(None, [f"data_path={train_tokenized}", "mode=online"])
    assert (online.max_length, online.aux_layer_ids, online.draft_vocab_size) == (128, None, 256)
    shorter = load_train_config(None, [f"data_path={store}", "max_length=64", "draft_vocab_size=128"])
    assert (shorter.max_length, shorter.draft_vocab_size) == (64, 128)  # truncation and a smaller map: as asked


def test_a_value_the_store_contradicts_is_refused_in_one_line(train_store, tmp_path, capsys):
    with pytest.raises(SystemExit) as refused:
        main([f"data_path={train_store}", f"output_dir={tmp_path}", "aux_layer_ids=[3,15,27]"])
    message = str(refused.value)
    assert message.startswith(f"error: aux_layer_ids=[3, 15, 27] but the store at {train_store} holds aux layers")
    assert "leave aux_layer_ids unset" in message and "\n" not in message
    assert not list(tmp_path.iterdir())


def test_every_objective_key_of_the_config_reaches_the_loss():
    cfg = TrainConfig(
        ttt_length=5, ttt_decay=0.7, tv_weight=0.3, rejection_weight=0.2, gradient_checkpointing=True, fused_loss=True
    )
    seen = {}

    def model(fn, *args, **kwargs):
        seen.update(kwargs)
        return args[0].sum(), {}

    import torch

    batch = {key: torch.zeros(1, 4) for key in ("aux_hidden", "input_ids", "loss_mask", "target_probs", "in_draft")}
    objective_for(cfg)(model, batch, lambda loss: None)
    assert seen == {
        "ttt_length": 5,
        "decay": 0.7,
        "checkpoint_logits": True,
        "fused_loss": True,
        "tv_weight": 0.3,
        "rejection_weight": 0.2,
    }
    peagle = TrainConfig(method="peagle", num_depths=5, tv_weight=0.4, max_length=4096)
    objective = objective_for(peagle)
    assert isinstance(objective, PEagleObjective)
    assert (objective.num_depths, objective.num_segments, objective.tv_weight) == (5, segments_for(peagle), 0.4)
    assert objective.num_segments > 1
