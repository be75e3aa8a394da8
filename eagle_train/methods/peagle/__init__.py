"""P-EAGLE: all K drafts from one forward (`head`), trained on (anchor, depth) elements (`batch`) with sequence
partitioning (`train`: its head builder and objective; `config`: its keys and their checks)."""
