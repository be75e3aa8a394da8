"""Train a P-EAGLE draft head (all K drafts in one forward pass).

    accelerate launch scripts/train_peagle.py --config configs/peagle_smollm2.yaml [key=value ...]

Same loop, data, checkpoints, resume and logging as scripts/train_eagle3.py (eagle_train.trainer);
only the head and the objective differ. P-EAGLE keys: num_depths (K), draft_num_layers (N; null:
2 below target hidden size 2048, else 4), mask_token_id (null: a spare special token the data never
uses), num_segments (null: from max_length and K, see peagle_batch.default_num_segments).
"""

from eagle_train.peagle_train import PEagleObjective, build_peagle_head, segments_for, validate_peagle
from eagle_train.target import load_target_config
from eagle_train.train_config import config_from_command_line, one_line_refusals, validate
from eagle_train.trainer import train


def main(argv=None):
    cfg = config_from_command_line(__doc__, "peagle", argv)
    with one_line_refusals():
        target_config = load_target_config(cfg.target)
        validate(cfg, target_config)  # the P-EAGLE keys' checks rely on the common ones
        validate_peagle(cfg, target_config)
        train(cfg, build_peagle_head, PEagleObjective(cfg.num_depths, segments_for(cfg), cfg.tv_weight))


if __name__ == "__main__":
    main()
