"""Warm start: the head's logits are the target's over the draft vocabulary, and an export keeps them."""

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from eagle_train.checkpoint import load_draft_head
from eagle_train.export import export_head
from eagle_train.methods import check_method
from eagle_train.methods.eagle3.head import Eagle3Head
from eagle_train.methods.eagle3.train import build_eagle3_head
from eagle_train.train_config import TrainConfig, validate
from eagle_train.warm_start import warm_start_from_target

DRAFT_VOCAB = 1000


def new_head(model) -> Eagle3Head:
    """A fresh head for `model` with a random sorted draft vocabulary (d2t not all zero)."""
    torch.manual_seed(0)
    head = Eagle3Head.from_target(model, draft_vocab_size=DRAFT_VOCAB, target="tiny-llama")
    ids = torch.randperm(model.config.vocab_size)[:DRAFT_VOCAB].sort().values
    t2d = torch.zeros(model.config.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    head.set_vocab_map(ids - torch.arange(DRAFT_VOCAB), t2d)
    return head


@pytest.fixture
def warm_head(tiny_llama):
    model, _ = tiny_llama
    head = new_head(model)
    warm_start_from_target(head, model)
    return head


def test_warm_started_logits_are_the_targets_on_the_draft_vocab(tiny_llama, warm_head):
    model, _ = tiny_llama
    h = torch.randn(2, 5, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    target_ids = torch.arange(DRAFT_VOCAB) + warm_head.d2t
    with torch.no_grad():
        got = warm_head.logits(h)
        reference = F.linear(model.model.norm(h), model.lm_head.weight[target_ids])
        full = model.lm_head(model.model.norm(h))
    assert torch.equal(got, reference)
    torch.testing.assert_close(got, full[..., target_ids])
    # a copy: training the head leaves the target alone
    assert warm_head.lm_head.weight.data_ptr() != model.lm_head.weight.data_ptr()


def test_export_round_trip_keeps_the_warm_start(tmp_path, tiny_llama, warm_head):
    model, _ = tiny_llama
    export_head(warm_head, tmp_path / "warm", "eagle3", dtype="fp32")
    export_head(new_head(model), tmp_path / "cold", "eagle3", dtype="fp32")
    back = load_draft_head(tmp_path / "warm", model)
    assert torch.equal(back.lm_head.weight, warm_head.lm_head.weight)
    assert torch.equal(back.norm.weight, warm_head.norm.weight)
    assert torch.equal(back.d2t, warm_head.d2t)
    warm, cold = (load_file(tmp_path / d / "model.safetensors") for d in ("warm", "cold"))
    assert {k: (v.shape, v.dtype) for k, v in warm.items()} == {k: (v.shape, v.dtype) for k, v in cold.items()}


def test_train_config_warm_start_reaches_the_eagle3_builder(tiny_llama, warm_head):
    model, _ = tiny_llama
    vocab_map = {"d2t": warm_head.d2t.clone(), "t2d": warm_head.t2d.clone()}
    cold = build_eagle3_head(TrainConfig(), model, vocab_map)
    warm = build_eagle3_head(TrainConfig(warm_start=True), model, vocab_map)
    assert torch.equal(warm.lm_head.weight, warm_head.lm_head.weight)
    assert torch.equal(warm.norm.weight, warm_head.norm.weight)
    assert not torch.equal(cold.lm_head.weight, warm.lm_head.weight)


@pytest.mark.parametrize(
    "bad,check",
    [
        ({"warm_start": True, "init_from": "some-head"}, validate),
        ({"freeze_lm_head": True}, check_method),
        ({"warm_start": True, "method": "peagle"}, check_method),
        ({"warm_start": True, "freeze_lm_head": True, "method": "dflash"}, check_method),
    ],
)
def test_warm_start_is_refused_where_it_means_nothing(tiny_llama, bad, check):
    model, _ = tiny_llama
    with pytest.raises(ValueError, match="freeze_lm_head" if "freeze_lm_head" in bad else "warm_start"):
        check(TrainConfig(**bad), model.config)


def test_a_frozen_lm_head_stays_the_targets_rows_while_the_rest_trains(tiny_llama_dir, small_tokenized, tmp_path):
    """speculators' recipe: the draft lm_head starts as the target's rows of the draft vocabulary and stays so."""
    from eagle_cli.train import main as train

    runs = {}
    for frozen in (True, False):
        run = tmp_path / f"frozen-{frozen}"
        train(
            ["--config", "eagle3_smollm2", "mode=online", f"target={tiny_llama_dir}", f"data_path={small_tokenized}"]
            + [f"output_dir={run}", "max_steps=3", "warmup_steps=0", "ttt_length=2", "tokens_per_batch=256"]
            + ["max_length=128", "eval_fraction=0", "report_to=none", "warm_start=true", f"freeze_lm_head={frozen}"]
            + ["learning_rate=1e-2", "mixed_precision=no"]
        )
        runs[frozen] = load_draft_head(run / "final")
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    rows = model.get_output_embeddings().weight[
        runs[True].draft_to_target_ids(torch.arange(runs[True].config.draft_vocab_size))
    ]
    assert torch.equal(runs[True].lm_head.weight, rows.float())
    assert not torch.allclose(runs[False].lm_head.weight, rows.float())
    assert not torch.allclose(runs[True].fc.weight, runs[False].fc.weight)  # the rest trained, differently


def test_a_target_whose_final_norm_is_not_a_plain_rms_norm_is_refused():
    """Gemma 2 normalises by (1 + weight): copying its weight would start the head from another function."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    sizes = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    gemma = Gemma2ForCausalLM(Gemma2Config(vocab_size=1200, num_hidden_layers=3, **sizes)).eval()
    with pytest.raises(ValueError, match=r"Gemma2RMSNorm does not scale by that weight alone: train without") as err:
        warm_start_from_target(new_head(gemma), gemma)
    assert "\n" not in str(err.value)
