"""The fifth method's builder: a TwinHead sized for the target with the data's vocab map, or the one at init_from."""

from eagle_train.training_parts import head_from_init
from twin_method.head import TwinHead


def build_twin_head(cfg, target_model, vocab_map):
    if cfg.init_from:
        return head_from_init(cfg, target_model)
    head = TwinHead.from_target(
        target_model,
        method=cfg.method,
        draft_vocab_size=len(vocab_map["d2t"]),
        aux_layer_ids=cfg.aux_layer_ids,
        target=cfg.target,
    )
    head.set_vocab_map(vocab_map["d2t"], vocab_map["t2d"])
    return head
