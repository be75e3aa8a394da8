"""EAGLE-3: one fused decoder layer (`head`), trained with training-time test (`ttt`) through the shared trainer
(`train`: its head builder and objective; `config`: its keys and their checks)."""
