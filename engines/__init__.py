"""The serving engines a head is exported for, one module each, and the one registry of them.

An `Engine` (engines/engine.py) owns everything about its engine: the export layouts its loader reads and what that
loader does to a directory (the static rules `inspect` applies, engines/rules.py), how it is
installed or found, and, for the engines that run here (vLLM, llama.cpp), how it decodes live and
what its counters mean. SGLang and TensorRT-LLM are checked by rule only. The core (eagle_train)
writes the files; this package says what each engine makes of them.

    reports = check_directory("out/", ["vllm", "sglang", "trtllm"], target_config)
    report = ENGINES["llamacpp"].check_live("head.gguf", "smollm2-135m", source="runs/eagle3/final")
"""

from eagle_train.export.draft_files import DraftFiles
from eagle_train.export.layouts import detect_layout
from eagle_train.head import non_finite_values
from engines.engine import Engine, EngineError
from engines.llamacpp import LlamaCpp
from engines.rules import EngineReport, is_parallel
from engines.sglang import SGLang
from engines.trtllm import TensorRTLLM
from engines.vllm import Vllm

__all__ = [
    "DIRECTORY_ENGINES",
    "ENGINES",
    "PARALLEL_ENGINES",
    "Engine",
    "EngineError",
    "check_directory",
    "directory_engine",
]

ENGINES: dict[str, Engine] = {e.name: e for e in (LlamaCpp(), Vllm(), SGLang(), TensorRTLLM())}
DIRECTORY_ENGINES = tuple(name for name, e in ENGINES.items() if e.layouts)  # those that load export directories
PARALLEL_ENGINES = tuple(name for name, e in ENGINES.items() if e.parallel_drafting)


def directory_engine(name: str) -> Engine:
    if name not in DIRECTORY_ENGINES:
        raise ValueError(f"unknown engine {name!r}; choose from {', '.join(DIRECTORY_ENGINES)} or all")
    return ENGINES[name]


def check_directory(directory, engines=None, target_config=None) -> dict[str, EngineReport]:
    """Per engine, what it would load from `directory` and what would go wrong (engines/rules.py), and for all
    of them whether the weights are finite (a head that diverged loads everywhere and drafts garbage).
    `engines` defaults to the engines the directory's layout is meant for."""
    files = DraftFiles(directory)
    if not engines:
        try:
            engines = PARALLEL_ENGINES if is_parallel(files.config, files.meta) else detect_layout(files.config).engines
        except ValueError:
            engines = DIRECTORY_ENGINES
    reports = {name: directory_engine(name).inspect(files, target_config) for name in engines}
    broken = non_finite_values(files.tensors())
    if broken:
        for report in reports.values():
            report.add("error", f"the weights hold non-finite values ({broken}): do not deploy this head")
    return reports
