"""The draft model's plug-ins for the shared trainer loop (`eagle_train.trainer.train`): the builder, the objective
(distillation toward the target's distribution at every answer position) and its checks (its keys': `config`).

The target's distribution comes as for every head (`training_parts.target_distribution`: the stored or engine-made
final states through the target's lm_head), over the whole vocabulary, so no target forward runs for it offline.
Position t reads x_0..x_t and drafts x_{t+1}: it is trained where x_{t+1} is an answer token.
"""

import torch

from eagle_train.methods.draft_model.config import draft_layers, validate_draft_model
from eagle_train.methods.draft_model.model import DraftModel
from eagle_train.target import load_tokenizer
from eagle_train.train_config import TrainConfig
from eagle_train.training_parts import chain_rounds, head_from_init, loss_rows, shift_left


def check_draft_model(cfg: TrainConfig, target_config) -> None:
    """Its keys (`config.validate_draft_model`), and a draft to start from that shares the target's tokenizer: a check
    `config` cannot hold, since reading a head imports the head config that composes `config`'s keys."""
    validate_draft_model(cfg, target_config)
    if cfg.init_from:
        check_same_tokenizer(cfg.init_from, cfg.target)


def check_same_tokenizer(draft: str, target: str) -> None:
    """Refuse, in one line, a draft whose tokenizer is not the target's: its ids would mean other tokens."""
    from eagle_train.checkpoint import locate_head

    found = locate_head(draft)
    if found.ours:
        return  # ours: built for a target, checked by `check_fits`
    theirs, ours = load_tokenizer(str(found.path)), load_tokenizer(target)
    if theirs.get_vocab() != ours.get_vocab():
        raise ValueError(
            f"{draft} does not share the target's tokenizer ({len(theirs)} tokens against {len(ours)}, or the same "
            "count mapped to other ids): a draft model must tokenize as the target does; pick a sibling of the "
            "target's family or train one from the target (leave init_from unset)"
        )


def build_draft_model(cfg: TrainConfig, target_model, vocab_map: dict | None) -> DraftModel:
    """A draft of the target's layers `draft_layers` (their weights with draft_init=target), or the draft model at
    `init_from` (ours, or any transformers causal LM directory with the target's tokenizer). The data's vocab map is
    not used: a draft model drafts over the whole vocabulary, as engines serve it."""
    if cfg.init_from:
        return head_from_init(cfg, target_model)
    config = target_model.config
    layers = draft_layers(cfg, config.num_hidden_layers)
    weights_from = cfg.target if cfg.draft_init == "target" else None
    return DraftModel.from_target(config, layers, target=cfg.target, weights_from=weights_from)


def distillation_loss(model: DraftModel, input_ids, loss_mask, target_probs, in_draft, tv_weight: float, chain: int):
    """Per-position loss toward the target's distribution where x_{t+1} is an answer token the target's argmax agrees
    with (`in_draft`, always true on the target's own greedy answers), and the greedy chain walk of `chain` drafts a
    round over the text (`training_parts.chain_rounds`: draft i of a round at anchor t is position t+1+i's)."""
    b, t = input_ids.shape
    supervised = shift_left(loss_mask.bool(), 1, False) & in_draft
    hidden = model.hidden(input_ids)
    rows, agree = loss_rows(model.logits(hidden[supervised]), target_probs[supervised], tv_weight)
    count = supervised.sum()
    loss = rows.sum() / count.clamp(min=1)
    right = torch.zeros(b, t + chain, dtype=torch.bool)
    right[:, :t][supervised.cpu()] = agree.cpu()
    correct = torch.stack([right[:, 1 + i : 1 + i + t] for i in range(chain)], dim=1)
    rounds, _ = chain_rounds(correct, loss_mask.cpu())
    metrics = {
        "loss": loss.detach(),
        "loss_0": loss.detach(),
        "acc_0": (agree.sum() / count.clamp(min=1)).detach(),
        "count_0": count.detach(),
        "count_rounds": torch.tensor(len(rounds)),
        "count_chain_tokens": torch.tensor(sum(a + 1 for *_, a in rounds)),
    }
    return loss, metrics


def draft_model_objective(cfg: TrainConfig):
    """The trainer's objective for a draft model: one distillation forward and backward per micro-batch; its chain
    walk drafts `ttt_length` tokens a round, as EAGLE-3's eval does."""
    options = {"tv_weight": cfg.tv_weight, "chain": cfg.ttt_length}

    def objective(model, batch, backward):
        loss, metrics = model(
            distillation_loss,
            batch["input_ids"],
            batch["loss_mask"],
            batch["target_probs"],
            batch["in_draft"],
            **options,
        )
        backward(loss)
        return metrics

    return objective
