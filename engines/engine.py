"""What every serving engine is (`Engine`, whose defaults describe an engine that reads no export directory and
has no live decode here) and the error an engine raises (`EngineError`). Each engine's module (llamacpp, sglang,
trtllm, vllm) subclasses `Engine`; the registry of them is the package's (engines/__init__.py). This module
imports no engine module.
"""

import re

from eagle_train.export.draft_files import DraftFiles
from eagle_train.export.layouts import is_causal_lm
from eagle_train.hidden_states import engine_aux_layer_ids
from engines import live, model_rules, rules
from engines.rules import EngineReport, stack


class EngineError(RuntimeError):
    """The engine is missing, refused a file or failed while decoding."""


class Engine:
    """One serving engine. The defaults describe an engine that reads no export directory and has no
    live decode here; each engine's module overrides what its engine does."""

    name = ""  # the registry key and --engine value
    title = ""  # how reports name it

    # ---- its loader: what it does to an export directory (engines/rules.py applies these)
    layouts: tuple[str, ...] = ()  # the config layouts its loader reads; () = none (a file of its own)
    top: dict = {}  # head tensor name -> engine parameter (absent: the engine has none)
    unknown_tensors = "ignored"  # what a file tensor with no parameter does: "crash" (the load fails) or "ignored"
    parallel_drafting = False  # has P-EAGLE (all K drafts in one pass)
    loads_file_embedding = False  # uses a file's own embed_tokens (else always the target's)
    d2t_only_when_reduced = False  # has a d2t parameter only for a reduced draft vocabulary
    tied_embedding_severity = "error"  # tie_word_embeddings true
    without_d2t = ""  # what it uses for the vocab map when a reduced-vocabulary file has no d2t
    float_d2t_effect = ""  # what a floating-point d2t does besides losing ids
    caps_context_at_draft = False  # a short draft context caps the served context

    def rename(self, tensor: str, n_layers: int, params: set) -> str | None:
        """The engine parameter its load_weights puts file tensor `tensor` in (None: skipped)."""
        raise NotImplementedError(f"{self.title} loads no export directory")

    def layer_prefix(self, i: int, n: int) -> str:
        """The parameter prefix of draft layer i of n."""
        raise NotImplementedError(f"{self.title} loads no export directory")

    def engine_param(self, head_name: str, n_layers: int):
        """(engine parameter, shard) holding a head tensor, or None when the engine has no place for it."""
        m = re.match(r"^(midlayer|layers\.(\d+))\.(.*)$", head_name)
        if m:
            layer = int(m.group(2)) if m.group(2) else 0
            return stack(self.layer_prefix(layer, n_layers) + m.group(3))
        return (self.top[head_name], None) if head_name in self.top else None

    def captured_aux(self, config: dict, n_layers: int | None) -> tuple[int, ...] | None:
        """The target layers (HF hidden_states indices) it captures for this config: (2, N//2, N-3) unasked."""
        return engine_aux_layer_ids(n_layers) if n_layers else None

    def aux_fix(self, intended: tuple[int, ...]) -> str:
        """How to make it capture the layers the head was trained on."""
        return ""

    def config_keys_read(self, config: dict) -> set:
        """Which of rules.ENGINE_KEYS it reads from this config.json (the others it ignores)."""
        return set()

    def no_draft_vocab_size(self, report: EngineReport, cfg) -> None:
        report.add("warning", f"no draft_vocab_size: {self.title} assumes the full vocabulary ({cfg.vocab_size})")

    def check_norm_before_residual(self, report: EngineReport, config: dict) -> None:
        if config.get("norm_before_residual"):
            report.add(
                "error",
                f"norm_before_residual true: {self.title} ignores the key and keeps the un-normed "
                "residual, so this head's outputs would silently differ; serve it with vLLM",
            )

    def check_layout_keys(self, report: EngineReport, config: dict, layout_name: str) -> None:
        """Keys of a layout's own that this engine needs (none by default)."""

    def file_embedding_replaced(self, report: EngineReport, parallel: bool) -> None:
        """Said when the file has an embed_tokens the engine replaces with the target's (nothing by default)."""

    def short_context_effect(self, draft_context: int) -> str:
        """What a draft context shorter than the target's does."""
        return ""

    def check_parallel(self, report: EngineReport, files: DraftFiles, cfg) -> None:
        """Its P-EAGLE rules (only engines with parallel_drafting have any)."""

    def check_target_architecture(self, report: EngineReport, target_config) -> None:
        """Whether it serves EAGLE-3 heads on the target's architecture (no limit known by default)."""

    def inspect(self, files: DraftFiles, target_config=None) -> EngineReport:
        """What it would do with the directory in `files` (no weights are read but d2t): a draft model by the rules
        of a model loaded as one (engines/model_rules.py), a head by EAGLE-3's (engines/rules.py)."""
        if is_causal_lm(files.config):
            return model_rules.inspect(self, files, target_config)
        return rules.inspect(self, files, target_config)

    # ---- running it: how it is found, how a head gets into it, how it decodes live
    live_title = ""  # how the live check names it
    decodes_live = False  # eagle-eval and the live check can run it here

    def missing(self) -> str:
        """ "" when it can run here, else why not and how to get it."""
        return f"{self.title} does not run here: eagle-export --check checks its loader by rule only"

    def check_refusal(self, target: str | None, threads: int | None) -> str:
        """Why eagle-export --check cannot check for it with this --target and --threads ("" when it can)."""
        return ""

    def prepare(self, artifact, target: str, source, tmp):
        """(the file it loads, the head it should hold or None): a head is exported into `tmp` first."""
        raise NotImplementedError(self.missing())

    def static_findings(self, file, target: str, source_head) -> list:
        """The rule findings on what it would load from `file`, against the target and the source head."""
        raise NotImplementedError(self.missing())

    def read_back(self, file, model):
        """The head `file` holds, for the built-in runtime to run when no source head is given."""
        raise NotImplementedError(self.missing())

    def run_live(self, file, target: str, questions: list[str], k: int, n: int, threads: int | None):
        """(live.Pooled tokens per forward over the first-turn `questions`, how many texts equal plain
        decoding's); raises EngineError when the engine fails with the file."""
        raise NotImplementedError(self.missing())

    def check_live(
        self,
        artifact,
        target: str,
        source=None,
        threads: int | None = None,
        prompts: int = live.PROMPTS,
        new_tokens: int = live.NEW_TOKENS,
        k: int = live.K,
    ) -> live.LiveReport:
        """The rule findings, then its live comparison with the built-in runtime (engines/live.py); where the
        engine is missing, the report is SKIPPED (exit 3), never a pass."""
        return live.check(self, artifact, target, source, threads, prompts, new_tokens, k)

    def evaluate(self, options, answers: list[list[str]] | None = None) -> dict:
        """eagle-eval's bench through this engine (`inference.evaluate.EvalOptions`): plain, head and n-gram
        drafting through `inference.evaluate.run_bench`; later turns follow `answers` when given, else its
        plain answers. The record has a "title" (its table's) and `summarise_drafters`' "summary"."""
        raise NotImplementedError(self.missing())
