"""eagle-train: train a draft head for a causal LM from a run config.

    eagle-train --config eagle3_smollm2 [key=value ...]
    accelerate launch [--config_file configs/accelerate/ddp.yaml --num_processes 8] -m eagle_cli.train \\
        --config CONFIG [key=value ...]

--config is a YAML file, or the name of a config this package ships (listed below). Every key of the run
(listed below) can be set in it or on the command line as key=value, which wins: learning_rate=3e-4
aux_layer_ids=[2,15,27] output_dir=runs/x. A key the run does not have is refused with the list.

Methods (the config's `method:` key):
{methods}

Data: offline (mode=offline, the default) reads the hidden states of a store from `eagle-prep run` or
`eagle-prep distil`/`capture`; online (mode=online) reads a tokenized dataset (`eagle-prep tokenize`) and runs
the target on each batch; online with engine=vllm, a vLLM engine answers the conversations at data_path (any
eagle-prep source) as `eagle-prep distil --engine vllm` would while the head trains, and hands the samples over
through a buffer of at most buffer_gib on disk (engine_options go to vllm.LLM: tensor_parallel_size...). Left
unset (null), max_length, draft_vocab_size and, offline, aux_layer_ids are the data's (its manifest and vocab
map); a value the data contradicts is refused.

Output: checkpoints go to <output_dir>/checkpoint-<step> (every save_every steps and at the end; the newest
keep_checkpoints stay), the trained head to <output_dir>/final (eagle-export reads either), metrics to
<output_dir>/metrics.jsonl and report_to (tensorboard, wandb). resume=auto continues the newest checkpoint
in output_dir, resume=<checkpoint dir> that one; init_from=<head> starts a new run from a head's weights.

Several GPUs or processes: launch this module under `accelerate launch --config_file F --num_processes N`
with F one of the accelerate configs shipped in {shipped}/accelerate (ddp, fsdp, deepspeed_zero2,
deepspeed_zero3); the run config stays the same, and tokens_per_batch is per process.
Every refusal (a bad key or value, data of another target, a path that is not there) is one line, before any
compute where it can be.
"""

import argparse

from data_prep.feed import EngineFeed
from eagle_train.config_files import SHIPPED, config_file, shipped_names
from eagle_train.methods import METHODS, check_method, method_of, objective_for
from eagle_train.target import load_target_config
from eagle_train.train_config import (
    TrainConfig,
    from_data,
    keys_by_method,
    load_train_config,
    one_line_refusals,
    validate,
)
from eagle_train.trainer import train
from engines.vllm_child import missing


def description() -> str:
    methods = "\n".join(f"  {name}: {m.summary}" for name, m in METHODS.items())
    return __doc__.format(methods=methods, shipped=SHIPPED)


def keys_listing() -> str:
    """The config keys, the common ones first, then each method's own under the methods they belong to."""
    return "\n".join(f"  {owner}: {', '.join(names)}" for owner, names in keys_by_method().items())


def config_from_command_line(argv=None, method: str | None = None) -> TrainConfig:
    """`--config C key=value ...`; `method` (a script that trains one method) is the default and refuses a
    config of another. Exits with one line on a bad file, key or method."""
    parser = argparse.ArgumentParser(
        prog=None if method else "eagle-train",
        description=description(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"shipped configs: {', '.join(shipped_names('method'))}\nconfig keys:\n{keys_listing()}",
    )
    parser.add_argument("--config", help="a run YAML: a path, or a shipped config's name (eagle3_smollm2)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config keys, over the file's")
    args = parser.parse_args(argv)
    with one_line_refusals():
        path = config_file(args.config) if args.config else None
        cfg = load_train_config(path, args.overrides, defaults={"method": method} if method else None)
        method_of(cfg)
        if method and cfg.method != method:
            raise ValueError(
                f"method={cfg.method}: this script trains {method} heads (eagle-train trains the method the "
                "config names)"
            )
    return cfg


def run(cfg: TrainConfig) -> dict:
    """Check `cfg` (the common keys, then its method's), then train its method's head: `trainer.train`'s result.
    With engine=vllm, a vLLM engine makes the samples while the head trains (data_prep.feed)."""
    target_config = load_target_config(cfg.target)
    validate(cfg, target_config)
    check_method(cfg, target_config)
    if cfg.engine == "vllm":
        reason = missing()
        if reason:
            raise ValueError(f"engine=vllm: {reason}")
        with EngineFeed(cfg) as feed:
            cfg = from_data(feed.config)
            validate(cfg, target_config)
            return train(cfg, method_of(cfg).build_head, objective_for(cfg), data=feed.samples)
    return train(cfg, method_of(cfg).build_head, objective_for(cfg))


def main(argv=None, method: str | None = None) -> None:
    cfg = config_from_command_line(argv, method)
    with one_line_refusals():
        run(cfg)


if __name__ == "__main__":
    main()
