"""The methods: one row per method, read by every stage instead of testing a method's name.

`eagle_train.trainer.train(cfg, build_head, objective)` is the loop every method shares; a row names what
differs: the head builder, the objective built from the `TrainConfig` alone, and the checks of the method's
own keys (after `train_config.validate`'s common ones); and, for the stages after training, its title, its
drafting family (`FAMILIES`: the runtime has one drafter per family) and how many drafts one forward gives
by default. A new method is a new row.
"""

from collections.abc import Callable
from dataclasses import dataclass

from eagle_train.block_train import block_objective, build_block_head, validate_block
from eagle_train.dflash import num_drafts
from eagle_train.eagle3_train import build_eagle3_head, eagle3_objective
from eagle_train.peagle_train import build_peagle_head, peagle_objective, validate_peagle
from eagle_train.train_config import TrainConfig

FAMILIES = {  # how a head drafts, which decides the runtime's drafter and the engines' speculative method
    "chain": "K sequential draft steps a round, or a tree",
    "parallel": "all K drafts from one forward",
    "block": "a block of drafts from one forward, the target's layers as keys and values",
}


@dataclass(frozen=True)
class Method:
    title: str  # as tables and messages name it
    family: str  # one of FAMILIES
    build_head: Callable  # (cfg, target_model, vocab_map) -> head
    objective: Callable  # (cfg) -> objective(model, batch, backward) -> metrics
    check: Callable | None = None  # (cfg, target_config) -> None, raising ValueError naming the fix
    drafts: Callable | None = None  # (DraftConfig) -> drafts one forward gives; None: the user's K
    summary: str = ""  # one line for --help


METHODS = {
    "eagle3": Method(
        "EAGLE-3",
        "chain",
        build_eagle3_head,
        eagle3_objective,
        summary="EAGLE-3: one fused decoder layer, trained with training-time test (ttt_length drafts unrolled)",
    ),
    "peagle": Method(
        "P-EAGLE",
        "parallel",
        build_peagle_head,
        peagle_objective,
        validate_peagle,
        summary="P-EAGLE: all num_depths drafts in one forward pass, trained with sequence partitioning",
    ),
    "dflash": Method(
        "DFlash",
        "block",
        build_block_head,
        block_objective,
        validate_block,
        num_drafts,
        summary="DFlash: a block of block_size - 1 drafts in one forward, the target's layers as keys and values",
    ),
    "dspark": Method(
        "DSpark",
        "block",
        build_block_head,
        block_objective,
        validate_block,
        num_drafts,
        summary="DSpark: DFlash drafting from the anchor's slot too, with a Markov logit bias and a confidence head",
    ),
}


def row(method: str) -> Method:
    """The row of a method named in a config or an export; ValueError naming the methods there are."""
    if method not in METHODS:
        raise ValueError(f"method {method!r} is not one of {', '.join(METHODS)}")
    return METHODS[method]


def method_of(cfg: TrainConfig) -> Method:
    """The row of `cfg.method`."""
    return row(cfg.method)


def objective_for(cfg: TrainConfig):
    """The objective of `cfg.method`, every setting from `cfg`: the one way a config becomes an objective."""
    return method_of(cfg).objective(cfg)


def check_method(cfg: TrainConfig, target_config) -> None:
    """The checks of `cfg.method`'s own keys; run after `train_config.validate`, whose common checks they rely on."""
    check = method_of(cfg).check
    if check is not None:
        check(cfg, target_config)
