"""What an engine makes of a draft model's directory (the draft_model layout): a causal LM that vLLM serves as
`draft_model`, SGLang as STANDALONE and TensorRT-LLM as Draft_Target, each loading it as a model of its own with the
target's vocabulary. The checks every one of them makes at load, from config.json and the tensors' names and shapes
(no weight is read): the model transformers builds from that config is what the files must hold."""

import torch

from eagle_train.architectures import config_from_dict, text_config
from eagle_train.export.draft_files import DraftFiles
from eagle_train.export.layouts import draft_model_read
from engines.rules import EngineReport

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def inspect(eng, files: DraftFiles, target_config=None) -> EngineReport:
    """What engine `eng` would do with the draft model directory in `files`."""
    report = EngineReport(eng.name, "draft_model", eng, reads_target_states=False)
    try:
        report.config = draft_model_read(files.config)
        draft = config_from_dict(report.config.model_config)
    except (KeyError, ValueError) as e:
        report.add("error", f"config.json does not make a model: {e}")
        return report
    report.context_length = getattr(draft, "max_position_embeddings", None)
    check_weights(report, eng, files, draft)
    if target_config is not None:
        check_target(report, eng, draft, text_config(target_config))
    if not any((files.directory / name).is_file() for name in TOKENIZER_FILES):
        report.add(
            "warning",
            "no tokenizer files: a reader that loads the draft as a model of its own (SGLang, transformers) looks "
            "for its tokenizer there; copy the target's (eagle-export --format draft_model does)",
        )
    return report


def check_weights(report, eng, files: DraftFiles, draft) -> None:
    """The tensors of the model the config builds, with their shapes: a missing one the engine leaves at its init."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(draft)
    want = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    if model.get_output_embeddings().weight is model.get_input_embeddings().weight:
        want.pop("lm_head.weight", None)  # tied: the files keep it once, as the embedding
    got = {name: tuple(shape) for name, (shape, _, _) in files.meta.items()}
    missing = sorted(set(want) - set(got))
    if missing:
        shown = ", ".join(missing[:3]) + (" ..." if len(missing) > 3 else "")
        report.add(
            "error",
            f"{eng.title} builds {type(model).__name__} with {len(missing)} tensors the files lack ({shown}): it would "
            "leave them at init; export the whole model",
            cause="missing weights",
        )
    else:
        report.add("info", f"{eng.title} builds {type(model).__name__} and loads all {len(want)} tensors by name")
    wrong = [
        f"{name} {list(got[name])} (wants {list(shape)})"
        for name, shape in want.items()
        if got.get(name, shape) != shape
    ]
    if wrong:
        report.add(
            "error", f"tensors whose shapes config.json contradicts: {', '.join(wrong[:3])}", cause="wrong shapes"
        )
    report.ignored = sorted(set(got) - set(want) - {"lm_head.weight"})
    if report.ignored:
        report.add("warning", f"{eng.title} ignores tensors the model does not have: {', '.join(report.ignored[:3])}")


def check_target(report, eng, draft, target) -> None:
    """The target's vocabulary (every engine verifies draft ids as the target's) and context."""
    if draft.vocab_size != target.vocab_size:
        report.add(
            "error",
            f"vocabulary {draft.vocab_size} != the target's {target.vocab_size}: {eng.title} refuses a draft model of "
            "another vocabulary (its drafts are target token ids); use a draft with the target's tokenizer",
            cause="another vocabulary",
        )
    ours, theirs = getattr(draft, "max_position_embeddings", None), getattr(target, "max_position_embeddings", None)
    if ours and theirs and ours < theirs:
        report.add(
            "warning",
            f"the draft's context is {ours} positions, the target's {theirs}: " + eng.short_context_effect(ours),
        )
