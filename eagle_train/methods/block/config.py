"""The block drafters' own keys and their checks (DFlash's and DSpark's, one set): the keys they add to
`TrainConfig` and to a head's `DraftConfig`, their defaults, `validate_block` and `whole_vocabulary`. It imports
nothing heavy, so the shared configs compose its keys at import."""

from dataclasses import dataclass

from eagle_train.architectures import text_config
from eagle_train.methods import row

BLOCK_SIZE = 8  # slots per block, 7 drafts a forward for DFlash, 8 for DSpark
NUM_ANCHORS = 32  # blocks per sequence
CONFIDENCE_WEIGHT = 1.0  # DSpark: the confidence loss's weight
MARKOV_RANK = 64  # DSpark: the Markov bias's rank
BLOCK_MASKS = ("learnt", "target")  # the mask slots' embedding (block_mask)
BLOCK_LM_HEADS = ("draft", "target")  # the lm_head the drafts are read through (block_lm_head)


@dataclass(kw_only=True)
class TrainKeys:
    # they share draft_num_layers (None: 1 below target hidden 2048, else 5) and mask_token_id with P-EAGLE
    block_size: int = BLOCK_SIZE  # slots per block: the anchor's and the masks'; DFlash drafts block_size - 1
    num_anchors: int = NUM_ANCHORS  # blocks per sequence and micro-batch, at random assistant positions
    block_gamma: float | None = None  # draft j's loss weighs exp(-(j-1)/gamma); None: 4 at block 8, 7 at 16
    causal: bool = False  # attention inside a block is causal (the engines' default: not)
    markov_rank: int | None = None  # DSpark's Markov bias rank; None: 64 for dspark, none for dflash
    confidence_weight: float = CONFIDENCE_WEIGHT  # DSpark: weight of the confidence head's loss
    # learnt: a trained mask embedding; target: the target's frozen row mask_token_id (the published recipe; what
    # z-lab's dflash and speculators read)
    block_mask: str = "learnt"
    # draft: the head's own lm_head over the draft vocabulary; target: the target's frozen lm_head over its whole
    # vocabulary (the published recipe; draft_vocab_size is the target's)
    block_lm_head: str = "draft"


@dataclass(kw_only=True)
class HeadKeys:
    block_size: int | None = None  # slots per block, the anchor's and the masks'
    causal: bool = False  # attention inside a block is causal (the engines' default: not)
    sample_from_anchor: bool = False  # the anchor's slot drafts the first token (DSpark's default)
    markov_rank: int = 0  # DSpark: rank of the logit bias from the token before each draft (0: none)
    confidence_head: bool = False  # DSpark: a head predicting whether each draft is accepted
    block_mask: str = "learnt"  # the mask slots' embedding, learnt or the target's row mask_token_id
    block_lm_head: str = "draft"  # the head's own lm_head, or the target's (full vocabulary, frozen)


def whole_vocabulary(cfg) -> bool:
    """Whether a new head of `cfg` drafts over the target's whole vocabulary: through the target's lm_head."""
    return cfg.block_lm_head == "target"


def validate_block(cfg, target_config) -> None:
    """The DFlash / DSpark keys of a TrainConfig, checked before any compute (the shared draft_num_layers and
    mask_token_id by `train_config.validate`)."""
    vocab = text_config(target_config).vocab_size
    if cfg.freeze_lm_head:
        raise ValueError(f"freeze_lm_head keeps EAGLE-3's warm-started lm_head: set it to false for {cfg.method}")
    if cfg.rejection_weight:
        raise ValueError(f"rejection_weight weighs EAGLE-3's chain walk (method eagle3): set it to 0 for {cfg.method}")
    if cfg.block_size < 2:
        raise ValueError(f"block_size (the anchor's slot plus the masks) must be >= 2, got {cfg.block_size}")
    if cfg.num_anchors < 1:
        raise ValueError(f"num_anchors (blocks per sequence) must be >= 1, got {cfg.num_anchors}")
    if cfg.block_gamma is not None and cfg.block_gamma <= 0:
        raise ValueError(f"block_gamma must be > 0 (or null for the block size's default), got {cfg.block_gamma}")
    if cfg.markov_rank and "markov_rank" not in row(cfg.method).head_options:
        raise ValueError(
            f"markov_rank is DSpark's Markov bias: use method dspark, or markov_rank null for {cfg.method}"
        )
    if cfg.markov_rank is not None and cfg.markov_rank < 0:
        raise ValueError(f"markov_rank must be >= 0 (0: no Markov bias; null: {MARKOV_RANK}), got {cfg.markov_rank}")
    if cfg.block_mask not in BLOCK_MASKS:
        raise ValueError(
            f"block_mask {cfg.block_mask!r} is not one of {BLOCK_MASKS} (learnt: a trained mask embedding; target: "
            "the target's row mask_token_id)"
        )
    if cfg.block_lm_head not in BLOCK_LM_HEADS:
        raise ValueError(
            f"block_lm_head {cfg.block_lm_head!r} is not one of {BLOCK_LM_HEADS} (draft: the head's own over the draft "
            "vocabulary; target: the target's, frozen)"
        )
    if cfg.block_lm_head == "target" and cfg.draft_vocab_size not in (None, vocab):
        raise ValueError(
            f"block_lm_head: target drafts over the target's whole vocabulary ({vocab}), draft_vocab_size is "
            f"{cfg.draft_vocab_size}: leave draft_vocab_size unset, or use block_lm_head: draft"
        )
    if cfg.aux_layer_ids is not None and min(cfg.aux_layer_ids) < 1:
        raise ValueError(
            f"aux_layer_ids {list(cfg.aux_layer_ids)}: a block head reads decoder layers' outputs, and layer index 0 "
            "is the embedding's: use ids >= 1 (capture a store with --aux-layers of ids >= 1)"
        )
