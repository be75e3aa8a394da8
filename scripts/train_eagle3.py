"""Train an EAGLE-3 draft head.

    accelerate launch scripts/train_eagle3.py --config configs/eagle3_smollm2.yaml [key=value ...]

Every key of eagle_train.train_config.TrainConfig can be set in the YAML file or overridden on the
command line (`learning_rate=3e-4 ttt_length=5 mode=online resume=auto`). Offline mode reads a
hidden-state store (`eagle-prep run`/`capture`); online mode reads a tokenized dataset and runs
the target per batch. Checkpoints go to <output_dir>/checkpoint-<step>, the last head to
<output_dir>/final.
"""

from eagle_train.eagle3_train import build_eagle3_head, eagle3_objective
from eagle_train.train_config import config_from_command_line, one_line_refusals
from eagle_train.trainer import train


def main(argv=None):
    cfg = config_from_command_line(__doc__, "eagle3", argv)
    objective = eagle3_objective(
        cfg.ttt_length,
        cfg.ttt_decay,
        cfg.gradient_checkpointing,
        cfg.fused_loss,
        cfg.tv_weight,
        cfg.rejection_weight,
        cfg.feature_noise,
    )
    with one_line_refusals():  # train() checks the config before any compute
        train(cfg, build_eagle3_head, objective)


if __name__ == "__main__":
    main()
