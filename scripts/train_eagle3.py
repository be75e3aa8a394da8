"""Train an EAGLE-3 draft head.

    accelerate launch scripts/train_eagle3.py --config configs/eagle3_smollm2.yaml [key=value ...]

Every key of eagle_train.train_config.TrainConfig can be set in the YAML file or overridden on the
command line (`learning_rate=3e-4 ttt_length=5 mode=online resume=auto`). Offline mode reads a
hidden-state store (`eagle-prep run`/`capture`); online mode reads a tokenized dataset and runs
the target per batch. Checkpoints go to <output_dir>/checkpoint-<step>, the last head to
<output_dir>/final.
"""

import sys

from eagle_train.eagle3_train import build_eagle3_head, eagle3_objective
from eagle_train.target import load_target_config
from eagle_train.train_config import config_from_command_line, validate
from eagle_train.trainer import train


def main(argv=None):
    cfg = config_from_command_line(__doc__, "eagle3", argv)
    try:  # train() checks again; here a refusal is one line, not a traceback
        validate(cfg, load_target_config(cfg.target))
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")
    objective = eagle3_objective(cfg.ttt_length, cfg.ttt_decay, cfg.gradient_checkpointing, cfg.fused_loss)
    train(cfg, build_eagle3_head, objective)


if __name__ == "__main__":
    main()
