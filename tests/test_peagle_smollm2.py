"""P-EAGLE on the real SmolLM2 target and a real captured store: mask token choice, exact
partitioning and learning on real hidden states, train/serve consistency of the parallel drafts."""

from types import SimpleNamespace

import pytest
import torch
from test_peagle_batch import runner
from test_peagle_head import parallel_drafts, training_logits

from eagle_train.hidden_states import TargetLogits
from eagle_train.methods.peagle.train import PEagleObjective, build_peagle_head
from eagle_train.store import ShardedSamples, read_vocab_map
from eagle_train.trainer import pad_samples
from eagle_train.training_parts import target_distribution

K = 4


@pytest.fixture(scope="module")
def peagle_setup(smollm2, small_store):
    model, _ = smollm2
    cfg = SimpleNamespace(
        init_from="", mask_token_id=None, num_depths=K, draft_num_layers=None, aux_layer_ids=None, target="smollm2-135m"
    )
    torch.manual_seed(0)
    head = build_peagle_head(cfg, model, read_vocab_map(small_store))
    data = ShardedSamples(small_store)
    padded = pad_samples([data[i] for i in range(3)], 128)
    probs, in_draft = target_distribution(padded["final_hidden"], TargetLogits.of(model), head.t2d)
    batch = dict(
        input_ids=padded["input_ids"],
        loss_mask=padded["loss_mask"],
        aux_hidden=padded["aux_hidden"],
        target_probs=probs,
        in_draft=in_draft,
    )
    return head, batch, data


def test_mask_token_is_a_spare_special_token_absent_from_the_data(peagle_setup):
    head, _, data = peagle_setup
    assert head.config.mask_token_id == 16  # <empty_output>
    assert head.config.num_hidden_layers == 2 and len(head.layers) == 1
    assert all((data.tokens(i)["input_ids"] != 16).all() for i in range(len(data)))


def test_partitioning_is_exact_and_training_learns_on_real_hidden_states(peagle_setup):
    head, batch, _ = peagle_setup
    head = head.float()

    def grads(segments):
        head.zero_grad()
        torch.manual_seed(1)
        metrics = PEagleObjective(K, segments)(runner(head), batch, lambda loss: loss.backward())
        return {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}, metrics

    ref, m1 = grads(1)
    got, m3 = grads(3)
    assert m1["count_3"] > 0
    assert abs(float(m1["loss"] - m3["loss"])) < 1e-5 * float(m1["loss"])
    for name, g in ref.items():
        assert (got[name] - g).norm() <= 1e-5 * g.norm() + 1e-12, name
    assert ref["mask_hidden"].norm() > 0 and ref["embed_tokens.weight"][16].norm() > 0  # both learn

    opt = torch.optim.AdamW(head.parameters(), lr=1e-3)
    losses = []
    for _ in range(3):
        torch.manual_seed(1)
        opt.zero_grad()
        losses.append(float(PEagleObjective(K, 2)(runner(head), batch, lambda loss: loss.backward())["loss"]))
        opt.step()
    assert losses[-1] < 0.9 * losses[0], losses


def test_parallel_drafts_equal_training_outputs_on_real_hidden_states(peagle_setup):
    head, _, data = peagle_setup
    sample = data[0]
    ids, aux = sample["input_ids"][None], sample["aux_hidden"][None]
    p = len(sample["input_ids"]) - 3
    with torch.no_grad():
        _, logits = parallel_drafts(head, K, 256).catch_up(aux[:, : p + 1], ids[:, 1 : p + 2], 0)
        expected = training_logits(head, aux, ids, p, K)
    assert (logits - expected).abs().max() < 1e-3 * expected.abs().max()
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))
