"""Exporting heads in the layouts the serving engines load, and importing such directories back.

    export_head(head, "out/", "eagle3", dtype="bf16", data="sharegpt", steps=1000)
    head = import_head("out/", target_model)          # any eagle3 / speculators directory
    import_checkpoint("released-head/", "ckpt/")      # -> ckpt/head/, loadable by the trainer

llama.cpp's single-file GGUF is written by `eagle_train.export.gguf.export_gguf`. What each engine
makes of a directory is the engines package's to say (`engines.check_directory`).
"""

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from eagle_train.export.card import write_model_card
from eagle_train.export.draft_files import DraftFiles
from eagle_train.export.layouts import DTYPES, HEAD_CLASSES, INTEGER_TENSORS, LAYOUTS, detect_layout, layout
from eagle_train.vocab_map import t2d_from_d2t

__all__ = ["export_head", "import_head", "import_checkpoint", "LAYOUTS"]


def resolve_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"export dtype {dtype} is not one of {', '.join(DTYPES)}")
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown export dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def check_vocab_map(head) -> None:
    """The head's d2t/t2d must describe one vocabulary: engines only read d2t."""
    cfg = head.config
    ids = torch.arange(cfg.draft_vocab_size) + head.d2t.cpu()
    if ids.min() < 0 or ids.max() >= cfg.vocab_size or ids.unique().numel() != ids.numel():
        raise ValueError(
            "the head's d2t maps draft ids outside the target vocabulary or twice to one id: "
            "set the data's vocab map with head.set_vocab_map(d2t, t2d) before exporting"
        )
    if not torch.equal(t2d_from_d2t(head.d2t.cpu(), cfg.vocab_size), head.t2d.cpu()):
        raise ValueError(
            "the head's t2d does not mark exactly the target ids d2t maps to: "
            "set both from one vocab map (head.set_vocab_map)"
        )


def export_head(head, out_dir, format: str = "eagle3", dtype="bf16", **provenance) -> Path:
    """Write `head` to `out_dir` as config.json + model.safetensors (+ README.md) in `format`.

    Floating tensors are cast to `dtype`; d2t stays int64 and t2d bool. `provenance` (e.g. data,
    steps, eval_results, speculative_tokens for speculators) goes into config.json's "eagle_train"
    block and the model card.
    """
    lay = layout(format)
    dtype = resolve_dtype(dtype)
    if lay.name not in ("speculators", head.config.method):
        raise ValueError(
            f"a {head.config.method} head cannot be written in the {lay.name} layout "
            f"(use --format {head.config.method} or --format speculators)"
        )
    check_vocab_map(head)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, t in head.saved_state_dict().items():
        t = t.detach().cpu()
        tensors[lay.to_file(name)] = (t if name in INTEGER_TENSORS else t.to(dtype)).contiguous()
    card_fields = {k: provenance.pop(k) for k in ("eval_results",) if k in provenance}
    config = lay.write_config(head.config, dtype, provenance)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    write_model_card(out, config, lay.name, dtype, **card_fields)
    return out


def import_head(directory, target_model=None, target_config=None):
    """The head stored in an engine-layout directory (eagle3 or speculators), in fp32.

    The token embedding is the file's own when it has one, else `target_model`'s (EAGLE-3 heads
    share the target's). The target (model or config) is needed only when config.json does not
    say which target layers the head reads and the defaults need the target's layer count.
    """
    files = DraftFiles(directory)
    lay = detect_layout(files.config)
    if target_model is not None and target_config is None:
        target_config = target_model.config
    cfg = lay.read_config(files.config, target_config)
    if cfg.method not in HEAD_CLASSES:
        raise ValueError(f"{directory}: no head class for method {cfg.method!r} (known: {', '.join(HEAD_CLASSES)})")
    head = HEAD_CLASSES[cfg.method](cfg)
    state = {lay.from_file(name): t for name, t in files.tensors().items()}
    expected = head.saved_state_dict()
    # An EAGLE-3 head shares the target's embedding; a file may still carry a copy (or its own).
    own_embedding = None if "embed_tokens.weight" in expected else state.pop("embed_tokens.weight", None)
    if "d2t" not in state and cfg.draft_vocab_size == cfg.vocab_size:  # a full-vocabulary head: identity
        state["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
    missing = sorted(set(expected) - set(state) - {"t2d"})
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"{directory} ({lay.name} layout): missing tensors {missing}, tensors this head does not have {unexpected}"
        )
    for name, t in state.items():
        if tuple(t.shape) != tuple(expected[name].shape):
            raise ValueError(
                f"{directory}: {name} is {list(t.shape)}, config.json implies "
                f"{list(expected[name].shape)}: config.json and the weights disagree"
            )
        if name == "d2t" and t.is_floating_point():
            raise ValueError(f"{directory}: d2t is {t.dtype}; offsets must be integers (re-export it as int64)")
    if "t2d" not in state:  # optional in engine layouts: it follows from d2t
        state["t2d"] = t2d_from_d2t(state["d2t"].long(), cfg.vocab_size)
    head.load_state_dict(
        {k: v.long() if k == "d2t" else v.bool() if k == "t2d" else v.float() for k, v in state.items()}, strict=False
    )
    if own_embedding is not None:
        head.use_own_embedding(own_embedding)
    elif target_model is not None and "embed_tokens.weight" not in expected:
        head.use_target_embedding(target_model)
    return head


def import_checkpoint(directory, out, target_config=None) -> Path:
    """Turn an engine-layout directory into a training checkpoint (`out/head/`) the trainer can
    resume or fine-tune from and `eagle_train.checkpoint.load_draft_head` reads."""
    head = import_head(directory, target_config=target_config)
    head.save_pretrained(Path(out) / "head")
    return Path(out)
