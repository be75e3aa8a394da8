"""DFlash and DSpark through the shared trainer on the real SmolLM2 store: they learn, resume exactly, load back
as the head they were (DSpark by default, DFlash too with -m slow), and their keys are checked before any compute."""

import pytest
import torch
from test_trainer import config, losses

from eagle_train.checkpoint import load_draft_head
from eagle_train.methods import check_method, method_of, objective_for
from eagle_train.train_config import validate
from eagle_train.trainer import train


def run(cfg):
    return train(cfg, method_of(cfg).build_head, objective_for(cfg))


BLOCK = ["block_size=4", "num_anchors=8", "eval_fraction=0.2", "num_epochs=2"]


@pytest.mark.parametrize(  # three trainings each: DSpark (DFlash's head with its options on) by default
    "method", [pytest.param("dflash", marks=pytest.mark.slow), "dspark"]
)
def test_a_block_head_learns_resumes_exactly_and_loads_back(method, train_store, smollm2, tmp_path):
    overrides = [f"method={method}", *BLOCK, "markov_rank=8" if method == "dspark" else "markov_rank=null"]
    straight = run(config(train_store, tmp_path / "a", *overrides))
    assert straight["eval_after"]["loss"] < straight["eval_before"]["loss"]
    assert straight["eval_after"]["count_rounds"] > 0 and "chain_al" in straight["eval_after"]
    assert ("confidence_bce" in straight["history"][0]) == (method == "dspark")
    stop = len(straight["history"]) // 2
    first = run(config(train_store, tmp_path / "b", *overrides, f"stop_after_step={stop}"))
    resumed = run(config(train_store, tmp_path / "b", *overrides, "resume=auto"))
    assert losses(first) + losses(resumed) == losses(straight)  # the anchors' draws are the batches' own

    head = load_draft_head(tmp_path / "b" / "final", smollm2[0])
    cfg = head.config
    assert (cfg.method, cfg.block_size, cfg.sample_from_anchor) == (method, 4, method == "dspark")
    assert cfg.mask_token_id == 16  # SmolLM2's spare special token: its embedding is the head's own, learnt
    assert head.embed_tokens.weight.data_ptr() == smollm2[0].get_input_embeddings().weight.data_ptr()
    assert not torch.equal(head.mask_embedding, torch.zeros_like(head.mask_embedding))


def test_the_published_recipe_trains_on_the_targets_mask_row_and_lm_head(train_store, smollm2, tmp_path):
    """block_mask: target and block_lm_head: target: the head learns over the whole vocabulary, saves neither
    borrowed tensor and loads back on the target's."""
    overrides = ["method=dflash", *BLOCK, "num_epochs=1", "block_mask=target", "block_lm_head=target"]
    done = run(config(train_store, tmp_path, *overrides))
    assert done["eval_after"]["loss"] < done["eval_before"]["loss"]
    target = smollm2[0]
    head = load_draft_head(tmp_path / "final", target)
    assert head.config.draft_vocab_size == target.config.vocab_size and not hasattr(head, "mask_embedding")
    assert head.lm_head.weight.data_ptr() == target.get_output_embeddings().weight.data_ptr()
    assert "lm_head.weight" not in head.saved_state_dict()


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["method=dflash", "markov_rank=8"], "markov_rank is DSpark's"),
        (["method=dflash", "block_size=1"], "block_size .* must be >= 2"),
        (["method=dspark", "num_anchors=0"], "num_anchors .* must be >= 1"),
        (["method=dspark", "block_gamma=0"], "block_gamma must be > 0"),
        (["method=dflash", "rejection_weight=1"], "rejection_weight weighs EAGLE-3's"),
        (["method=dflash", "aux_layer_ids=[0,15,27]", "mode=online"], "layer index 0 is the embedding's"),
        (["method=dflash", "block_mask=shared"], "block_mask 'shared' is not one of"),
        (["method=dspark", "block_lm_head=tied"], "block_lm_head 'tied' is not one of"),
        (["method=dflash", "block_lm_head=target", "draft_vocab_size=1000"], "drafts over the target's whole"),
    ],
)
def test_block_keys_are_refused_before_any_compute(overrides, match, train_tokenized, smollm2, tmp_path):
    cfg = config(train_tokenized, tmp_path, "mode=online", *overrides)
    validate(cfg, smollm2[0].config)  # the common checks pass: the method's own refuse
    with pytest.raises(ValueError, match=match) as err:
        check_method(cfg, smollm2[0].config)
    assert "\n" not in str(err.value)
