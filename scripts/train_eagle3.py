"""Train an EAGLE-3 draft head.

    accelerate launch scripts/train_eagle3.py --config configs/eagle3_smollm2.yaml [key=value ...]

Every key of eagle_train.train_config.TrainConfig can be set in the YAML file or overridden on the
command line (`learning_rate=3e-4 ttt_length=5 mode=online resume=auto`). Offline mode reads a
hidden-state store (`eagle-prep run`/`capture`); online mode reads a tokenized dataset and runs
the target per batch. Checkpoints go to <output_dir>/checkpoint-<step>, the last head to
<output_dir>/final.
"""

import argparse
import sys

from eagle_train.train_config import field_names, load_train_config
from eagle_train.trainer import build_eagle3_head, train
from eagle_train.ttt import eagle3_objective


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="config keys: " + ", ".join(field_names()))
    parser.add_argument("--config", help="YAML run config (e.g. configs/eagle3_smollm2.yaml)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    args = parser.parse_args(argv)
    try:
        cfg = load_train_config(args.config, args.overrides)
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")
    if cfg.method != "eagle3":
        sys.exit(f"error: method={cfg.method}: this script trains EAGLE-3 heads (P-EAGLE: scripts/train_peagle.py)")
    objective = eagle3_objective(cfg.ttt_length, cfg.ttt_decay, cfg.gradient_checkpointing, cfg.fused_loss)
    train(cfg, build_eagle3_head, objective)


if __name__ == "__main__":
    main()
