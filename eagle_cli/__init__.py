"""The command lines that may reach an engine: eagle-train (train.py), eagle-export (export.py) and eagle-eval
(evaluate.py)."""
