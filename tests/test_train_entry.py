"""eagle-train: shipped configs by name, the keys a run takes from its data, and one path from config to objective."""

import json
import shutil

import pytest
import torch
from conftest import TINY_TARGET
from transformers import LlamaConfig, LlamaForCausalLM

from eagle_cli.train import main
from eagle_train.config_files import SHIPPED, config_file, shipped_names
from eagle_train.methods import METHODS, objective_for
from eagle_train.methods.peagle.train import PEagleObjective
from eagle_train.store import MANIFEST, VOCAB_MAP, read_manifest
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
    assert "  peagle: num_depths, num_segments\n" in text and "  dflash, dspark: block_size, " in text  # keys by method


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


def recording_model(seen: dict):
    """A stand-in for the head: records the loss function's arguments (positional in seen["args"], keywords
    merged into `seen`) and returns a loss of them."""

    def model(fn, *args, **kwargs):
        seen.update(kwargs, args=args)
        return args[0].sum(), {}

    return model


def test_every_objective_key_of_the_config_reaches_the_loss():
    cfg = TrainConfig(
        ttt_length=5, ttt_decay=0.7, tv_weight=0.3, rejection_weight=0.2, gradient_checkpointing=True, fused_loss=True
    )
    seen = {}
    batch = {key: torch.zeros(1, 4) for key in ("aux_hidden", "input_ids", "loss_mask", "target_probs", "in_draft")}
    objective_for(cfg)(recording_model(seen), batch, lambda loss: None)
    seen.pop("args")
    assert seen == {
        "ttt_length": 5,
        "decay": 0.7,
        "checkpoint_logits": True,
        "fused_loss": True,
        "tv_weight": 0.3,
        "rejection_weight": 0.2,
    }
    # P-EAGLE's default segments at 4096 tokens and K=5: 4096 * (1 + .7 + .49 + .343 + .2401) elements (each depth
    # kept at 0.7^d, at least 0.2) = 11,359, at 4,096 a segment: 3 segments
    peagle = objective_for(TrainConfig(method="peagle", num_depths=5, tv_weight=0.4, max_length=4096))
    assert isinstance(peagle, PEagleObjective)
    assert (peagle.num_depths, peagle.num_segments, peagle.tv_weight) == (5, 3, 0.4)
    assert objective_for(TrainConfig(method="peagle", num_segments=2, max_length=4096)).num_segments == 2


# Two sequences of 8 tokens: anchors are the positions 1 <= a <= 6 whose token and the next are supervised
LOSS_MASK = torch.tensor([[0, 1, 1, 1, 1, 1, 0, 0], [0, 0, 0, 1, 1, 0, 0, 0]])  # anchors: 1, 2, 3, 4; and 3


def block_call(cfg, feature_noise_on=True) -> dict:
    """What the block objective of `cfg` hands the loss for LOSS_MASK's batch: {"aux", "anchors", "valid"} and its
    keywords."""
    seen = {}
    batch = {
        "aux_hidden": torch.ones(2, 8, 3 * 4),
        "input_ids": torch.zeros(2, 8, dtype=torch.long),
        "loss_mask": LOSS_MASK,
        "target_probs": torch.zeros(2, 8, 4),
        "in_draft": torch.ones(2, 8, dtype=torch.bool),
        "generator": torch.Generator().manual_seed(0),
    }
    with torch.set_grad_enabled(feature_noise_on):
        objective_for(cfg)(recording_model(seen), batch, lambda loss: None)
    aux, _, _, _, _, anchors, valid = seen.pop("args")
    return {"aux": aux, "anchors": anchors.tolist(), "valid": valid.tolist(), **seen}


def test_every_block_key_of_the_config_reaches_the_loss_or_the_head():
    # DFlash at block 8: gamma the DFlash paper's 4; more anchors asked than there are: every one, the rest invalid
    dflash = block_call(TrainConfig(method="dflash", block_size=8, num_anchors=8, tv_weight=0.1, confidence_weight=0))
    assert torch.equal(dflash.pop("aux"), torch.ones(2, 8, 12))  # no feature_noise: the batch's own
    assert dflash == {
        "anchors": [[1, 2, 3, 4], [3, 1, 1, 1]],
        "valid": [[True, True, True, True], [True, False, False, False]],
        "gamma": 4.0,
        "tv_weight": 0.1,
        "confidence_weight": 0,
    }
    # DSpark with 2 anchors a sequence, block_gamma as set, feature noise on the training batches only
    keys = dict(block_size=6, num_anchors=2, block_gamma=2.5, tv_weight=0.2, confidence_weight=0.3, feature_noise=0.5)
    cfg = TrainConfig(method="dspark", **keys)
    dspark = block_call(cfg)
    assert not torch.equal(dspark["aux"], torch.ones(2, 8, 12))
    first, second = dspark["anchors"]
    assert len(set(first)) == 2 and set(first) <= {1, 2, 3, 4} and first == sorted(first)
    assert (second, dspark["valid"]) == ([3, 1], [[True, True], [True, False]])
    assert (dspark["gamma"], dspark["tv_weight"], dspark["confidence_weight"]) == (2.5, 0.2, 0.3)
    assert torch.equal(block_call(cfg, feature_noise_on=False)["aux"], torch.ones(2, 8, 12))  # evaluation: none
    assert block_call(TrainConfig(method="dspark", block_size=6))["gamma"] == 3.0  # no block_gamma: half of block 6

    # the head's keys: block_size, and markov_rank with the DSpark options it implies (null: rank 64)
    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(**TINY_TARGET)).eval()
    vocab = TINY_TARGET["vocab_size"]
    vocab_map = {"d2t": torch.zeros(vocab, dtype=torch.long), "t2d": torch.ones(vocab, dtype=torch.bool)}
    for keys, want in [  # (block_size, sample_from_anchor, markov_rank, confidence_head)
        (dict(method="dspark", block_size=6, markov_rank=8), (6, True, 8, True)),
        (dict(method="dspark"), (8, True, 64, True)),
        (dict(method="dspark", markov_rank=0), (8, True, 0, False)),
        (dict(method="dflash", block_size=4), (4, False, 0, False)),
    ]:
        cfg = TrainConfig(mask_token_id=vocab - 1, **keys)
        head = METHODS[cfg.method].build_head(cfg, target, vocab_map).config
        assert (head.block_size, head.sample_from_anchor, head.markov_rank, head.confidence_head) == want, keys
