"""Train a P-EAGLE draft head (all K drafts in one forward pass).

    accelerate launch scripts/train_peagle.py --config configs/peagle_smollm2.yaml [key=value ...]

Same loop, data, checkpoints, resume and logging as scripts/train_eagle3.py (eagle_train.trainer);
only the head and the objective differ. P-EAGLE keys: num_depths (K), draft_num_layers (N; null:
2 below target hidden size 2048, else 4), mask_token_id (null: a spare special token the data never
uses), num_segments (null: from max_length and K, see peagle_batch.default_num_segments).
"""

import argparse
import sys

from eagle_train.peagle_train import PEagleObjective, build_peagle_head, segments_for, validate_peagle
from eagle_train.target import load_target_config
from eagle_train.train_config import field_names, load_train_config
from eagle_train.trainer import train


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="config keys: " + ", ".join(field_names()))
    parser.add_argument("--config", help="YAML run config (e.g. configs/peagle_smollm2.yaml)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    args = parser.parse_args(argv)
    try:
        cfg = load_train_config(args.config, args.overrides)
        if cfg.method != "peagle":
            raise ValueError(f"method={cfg.method}: this script trains P-EAGLE heads "
                             "(EAGLE-3: scripts/train_eagle3.py)")
        validate_peagle(cfg, load_target_config(cfg.target))
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")
    train(cfg, build_peagle_head, PEagleObjective(cfg.num_depths, segments_for(cfg)))


if __name__ == "__main__":
    main()
