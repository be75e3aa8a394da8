"""Exporting heads in the layouts the serving engines load, and reading such directories back. Heads are
loaded from any of these (and from our checkpoints and GGUF files) by `eagle_train.checkpoint.load_draft_head`.

    export_head(head, "out/", "eagle3", dtype="bf16", data="sharegpt", steps=1000)
    export_head(head, "out/", "dspark", target_embedding=target.get_input_embeddings().weight)
    config, tensors = read_export("out/")             # any eagle3 / speculators / peagle / dflash / dspark directory

llama.cpp's single-file GGUF is written by `eagle_train.export.gguf.export_gguf`. What each engine
makes of a directory is the engines package's to say (`engines.check_directory`).
"""

from pathlib import Path

import torch

from eagle_train.draft_config import DraftConfig
from eagle_train.export.card import write_model_card
from eagle_train.export.draft_files import DraftFiles
from eagle_train.export.layouts import (
    DTYPES,
    EMBEDDING_TENSOR,
    INTEGER_TENSORS,
    LAYOUTS,
    MASK_EMBEDDING_FILE,
    PROVENANCE_KEY,
    detect_layout,
    layout,
)
from eagle_train.files import write_json, write_safetensors
from eagle_train.methods import family_of, row
from eagle_train.target import load_tokenizer
from eagle_train.vocab_map import t2d_from_d2t

__all__ = ["export_head", "read_export", "LAYOUTS"]


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


def ships_target_embedding(format: str, head) -> bool:
    """Whether a `format` export of `head` carries the target's token embedding (`Layout.ships_embedding`), which
    a head that does not own one must be given (`export_head(target_embedding=...)`)."""
    return layout(format).ships_embedding(head.config) and not head.owns_embedding


def export_head(head, out_dir, format: str = "eagle3", dtype="bf16", target_embedding=None, **provenance) -> Path:
    """Write `head` to `out_dir` as config.json + model.safetensors (+ README.md) in `format`.

    Floating tensors are cast to `dtype` (a shipped target embedding: `shipped_embedding`); d2t stays int64 and t2d
    bool. `provenance` (e.g. data, steps, eval_results, speculative_tokens and verifier for speculators) goes into
    config.json's "eagle_train" block and the model card. `target_embedding` (the target's input embedding, [V, H])
    is required where the layout ships it (`ships_target_embedding`: speculators' EAGLE-3 heads, dspark for a learnt
    mask), else the one attached to the head (`DraftHead.attach_embedding`): a head loaded alone holds the
    constructor's random one. A head the layout's reader would not read as trained is refused (`Layout.refusal`);
    what a reader of the written layout cannot read is the layout's `notice`, which eagle-export prints.
    """
    lay = layout(format)
    dtype = resolve_dtype(dtype)
    method = row(head.config.method)
    if lay.name not in method.layouts:
        fits = [name for name in method.layouts if not layout(name).refusal(head.config)]  # those that take this head
        uses = " or ".join(f"--format {name}" + " --target T" * ships_target_embedding(name, head) for name in fits)
        raise ValueError(f"a {method.title} head cannot be written in the {lay.name} layout (use {uses})")
    check_vocab_map(head)
    refusal = lay.refusal(head.config)
    if refusal:
        raise ValueError(refusal)
    ships_embedding = ships_target_embedding(lay.name, head)
    if ships_embedding:
        if target_embedding is None and head.embedding_attached:
            target_embedding = head.embed_tokens.weight
        check_target_embedding(head.config, target_embedding, lay.name)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, t in head.saved_state_dict().items():
        if lay.mask_file and family_of(head.config.method) == "block" and name in block_skipped(head.config, lay):
            continue
        if name in INTEGER_TENSORS and not lay.vocab_map:
            continue
        t = t.detach().cpu()
        tensors[lay.to_file(name, head.config.method)] = (t if name in INTEGER_TENSORS else t.to(dtype)).contiguous()
    card_fields = {k: provenance.pop(k) for k in ("eval_results",) if k in provenance}
    config = lay.write_config(head.config, dtype, provenance)
    write_json(out / "config.json", config)
    if ships_embedding:
        mask = tensors.get("mask_embedding")
        tensors[EMBEDDING_TENSOR] = shipped_embedding(head.config, target_embedding, mask, dtype)
    if lay.mask_file and "mask_embedding" in tensors:
        write_mask_embedding(out, head.config.mask_token_id, tensors.pop("mask_embedding"))
    write_safetensors(out / "model.safetensors", tensors, metadata={"format": "pt"})
    if lay.ships_tokenizer:
        load_tokenizer(head.config.target).save_pretrained(out)
    write_model_card(out, config, lay.name, dtype, **card_fields)
    return out


def check_target_embedding(cfg, embedding, layout_name: str) -> None:
    """A layout shipping the target's embedding needs it, and of the head's target's size."""
    if embedding is None:
        raise ValueError(
            f"the {layout_name} layout ships the target's token embedding, which its reader never takes from the "
            "target: pass target_embedding (eagle-export --target TARGET)"
        )
    if tuple(embedding.shape) != (cfg.vocab_size, cfg.hidden_size):
        raise ValueError(
            f"the target embedding is {list(embedding.shape)}, the head needs [{cfg.vocab_size}, {cfg.hidden_size}]"
            f" (vocab_size, hidden_size): pass the embedding of the target the head was trained on ({cfg.target})"
        )


def shipped_embedding(cfg, embedding, mask, dtype) -> torch.Tensor:
    """The target's token embedding as it ships: an EAGLE-3 head's in the dtype given (vLLM keeps one apart from the
    target's unless the two are equal in the served dtype, so it is never rounded further); a block head's in `dtype`
    with row `mask_token_id` its learnt mask embedding `mask` (what vLLM's DSpark embeds the mask slots with)."""
    if family_of(cfg.method) != "block":
        return embedding.detach().cpu().contiguous()
    out = embedding.detach().cpu().to(dtype, copy=True).contiguous()
    out[cfg.mask_token_id] = mask.to(dtype)
    return out


def block_skipped(cfg, lay) -> tuple[str, ...]:
    """Vocab-map tensors a block layout leaves out: both for a full vocabulary (vLLM's block models then have no
    parameter for d2t and the load fails), else t2d (engines skip it; it follows from d2t) unless the layout's
    reader needs it (`Layout.block_t2d`: speculators' from_pretrained refuses a reduced vocabulary without it)."""
    if cfg.draft_vocab_size == cfg.vocab_size:
        return ("t2d", "d2t")
    return () if lay.block_t2d else ("t2d",)


def write_mask_embedding(out: Path, mask_token_id: int, embedding: torch.Tensor) -> None:
    """A block head's learnt mask embedding as the dict both engines read (vLLM's DFlash loader also takes a
    bare tensor, llama.cpp's converter only the dict)."""
    torch.save({"mask_token_id": int(mask_token_id), "embedding": embedding.contiguous()}, out / MASK_EMBEDDING_FILE)


def read_mask_embedding(directory: Path) -> torch.Tensor | None:
    """The embedding in a directory's mask_embedding.pt (dict or bare tensor), None without the file."""
    path = Path(directory) / MASK_EMBEDDING_FILE
    if not path.is_file():
        return None
    state = torch.load(path, map_location="cpu", weights_only=True)
    return state["embedding"] if isinstance(state, dict) else state


def read_export(directory, target_config=None) -> tuple[DraftConfig, dict[str, torch.Tensor]]:
    """The config and tensors (under head names) of an engine-layout directory (eagle3, speculators,
    peagle, dflash, dspark; a block head's mask embedding from mask_embedding.pt, else from the mask row of a
    dspark directory's embed_tokens; a copy of the target's embedding is dropped: `is_target_embedding`), for
    `eagle_train.checkpoint.load_draft_head` to build the head from. The target's config is needed only
    when config.json does not say which target layers the head reads and the defaults need the target's
    layer count."""
    files = DraftFiles(directory)
    lay = detect_layout(files.config)
    cfg = lay.read_config(files.config, target_config)
    tensors = {lay.from_file(n, cfg.method): t for n, t in files.tensors().items()}
    mask = read_mask_embedding(files.directory) if lay.mask_file else None
    if EMBEDDING_TENSOR in tensors and is_target_embedding(lay, cfg, files.config):  # the head borrows the target's
        shipped = tensors.pop(EMBEDDING_TENSOR)
        if family_of(cfg.method) == "block":
            mask = shipped[cfg.mask_token_id] if mask is None else mask
    if mask is not None:
        tensors["mask_embedding"] = mask
    if family_of(cfg.method) == "block":
        block_recipe_from_files(cfg, files.config, tensors)
    return cfg, tensors


def is_target_embedding(lay, cfg: DraftConfig, config: dict) -> bool:
    """Whether a directory's embed_tokens is a copy of the target's: always in a block head's (vLLM's DSpark reads the
    target's there), and where we shipped one for a head that borrows it (`Layout.ships_embedding`; our provenance
    block marks our exports); a head trained elsewhere may have trained its own."""
    if family_of(cfg.method) == "block":
        return True
    return PROVENANCE_KEY in config and lay.ships_embedding(cfg) and not row(cfg.method).head_class.owns_embedding


def block_recipe_from_files(cfg: DraftConfig, config: dict, tensors: dict) -> None:
    """block_mask / block_lm_head of a block export whose config.json does not state them (another trainer's, as
    z-lab's): without a mask embedding the mask slots are the target's row, and without an lm_head a
    full-vocabulary head drafts through the target's."""
    ours = config.get(PROVENANCE_KEY) or {}
    if "block_mask" not in ours and "mask_embedding" not in tensors:
        cfg.block_mask = "target"
    if "block_lm_head" not in ours and "lm_head.weight" not in tensors and cfg.draft_vocab_size == cfg.vocab_size:
        cfg.block_lm_head = "target"
