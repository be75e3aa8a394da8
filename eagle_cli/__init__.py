"""The command lines that drive the engines: eagle-export (export.py) and eagle-eval (evaluate.py)."""
