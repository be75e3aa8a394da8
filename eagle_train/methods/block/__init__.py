"""The block drafters, DFlash and DSpark: a block of drafts from one forward, the target's layers as keys and values
(`head`), trained on blocks at random anchors (`loss`; `train`: the head builder and objective; `config`: their keys and
the keys' checks)."""
