"""The peers' own code on a head directory, in .venv-peers (scripts/install_peers.sh), as a child process.

    .venv-peers/bin/python tests/peers/peer_child.py

The project's environment never imports `speculators` or z-lab's `dflash` (each pins its own stack): a test sends
requests to this script run with .venv-peers' python (tests/peers/run.py keeps one such child per test process, so
the libraries are imported once), one JSON object per line on its stdin; for each it writes one line on its stdout,
{"ok": true, ...} or {"ok": false, "error": ...}, and the safetensors files it names. What the libraries print goes
to stderr. Every path in a request is taken as given (relative paths from the working directory of the child). No
Hub: HF_HUB_OFFLINE is set, so a verifier named by a Hub id fails at once; give a local directory instead
("verifier" / "target", e.g. one made by op build_verifier).

Ops (request["op"]):

- build_verifier {config: a transformers config dict with model_type (llama, qwen3...), seed, dir}: a tiny causal
  LM with random weights, saved by save_pretrained: the verifier/target whose embed_tokens / lm_head / model.norm
  the peers read (speculators' load_verifier_weights; dflash's generate takes the target's embedding and head).
- build_and_save {library, model, config, seed, dir, [verifier], [inputs, out], ...}: the peer's model class with
  random weights, saved with its own save_pretrained into dir; then, if inputs is given, the forward below.
    speculators + eagle3 | peagle | dflash | dspark: config = keyword arguments of Eagle3SpeculatorConfig /
      PEagleSpeculatorConfig / DFlashSpeculatorConfig / DSparkSpeculatorConfig (the library's defaults for
      anything left out, e.g. norm_before_residual / norm_before_fc / fc_norm / norm_output all false);
      speculators_config, when left out, is a greedy proposal (speculative_tokens, default 3) with verifier
      {name_or_path: request["verifier"] or null}. A draft vocabulary smaller than
      transformer_layer_config.vocab_size gets a random t2d/d2t (or request["draft_token_ids"]). With a verifier,
      embed_tokens is the verifier's (dflash/dspark: and lm_head too when the vocabularies are equal), as the
      library's own from_training_args does; but for peagle, which trains its embedding (embed_requires_grad) and
      saves it, the random one stays, standing in for a trained one.
    dflash + dflash: config = a Qwen3Config dict for z-lab's DFlashDraftModel (num_target_layers, block_size,
      dflash_config {target_layer_ids, mask_token_id, ...}, is_causal, ...).
- load_and_run {library, dir, inputs, out, [verifier | target], [attn], [ttt_steps], [dtype]}: load dir with the
  library's own loader (the files as written; the only in-memory changes are a verifier path when
  request["verifier"] is given, and the attention implementation: request["attn"], for speculators "eager" unless
  "flex" is asked for, for dflash sdpa as its benchmark loads it) and run one forward.
  speculators peagle: request["num_depths"], ["down_sample_ratio"], ["down_sample_ratio_min"] (forward
  arguments; the library's defaults 8, 0.7, 0.2 when left out).

Forward inputs (tensors in the inputs safetensors file; B = 1, since the peers pack sequences into one row):

- speculators eagle3: hidden_states [1, T, n_aux*H] (the target's aux hidden states at positions 0..T-1),
  input_ids [1, T] (token t+1 beside hidden t: speculators' shift_batch), optional position_ids [1, T] (the
  library's default is 1 + arange(T)), optional document_ids [1, T] (default zeros). request["ttt_steps"] (default
  1). Saved: logits [1, T, draft_vocab] of step 0 (lm_head's output), logits_step{i} of every step, draft_tokens.
- speculators peagle: hidden_states [1, T, n_aux*H] and input_ids [1, T] as for eagle3 (token t+1 beside hidden t:
  its trainer's shift_batch too), optional loss_mask [1, T] (default ones) and document_ids. The library draws
  (anchor, depth) elements itself (data.py generate_cod_sample_indices, from torch's RNG seeded by
  request["seed"]): depth 0 every position 0..T-1, depth d a subset of the chains of depth d-1 whose next
  position is in loss_mask (a depth-1 chain starts at a - 1 for any loss_mask position a: give loss_mask[0] = 0
  unless a chain at anchor -1, which sees itself only, is wanted). Element (a, d) reads input_ids[a] and
  hidden_states[a] at depth 0, mask_token_id and mask_hidden beyond; its RoPE position is a + d (position_ids are
  not read); it attends to depth-0 elements at anchors <= a (within sliding_window of a + d in sliding layers) and
  to its own chain's depths <= d. Saved: logits [1, E, draft_vocab] (lm_head(norm(h)) of every element, in the
  library's order), anchor_pos [E] and depth [E].
- speculators dflash / dspark: hidden_states [1, T, n_aux*H], input_ids [1, T] (hidden t beside token t, no
  shift), anchor_positions [A] (each < T - block_size), optional position_ids [1, T] (default arange(T)) and
  document_ids. The library picks anchors at random among loss_mask positions; here loss_mask is one at exactly
  these anchors and max_anchors = A, which makes the pick these anchors, sorted. Block j: slot 0 is
  input_ids[a_j], the rest mask_token_id, positions a_j + k; it attends to the fc'd context at positions < a_j and
  (bidirectionally) to its own block. Saved: logits [1, A*block_size, draft_vocab] (dspark: with the Markov bias
  on the ground-truth previous tokens input_ids[a_j + k] (sample_from_anchor) or input_ids[a_j + k - 1]),
  confidence_logits [1, A*block_size] (dspark with a confidence head).
- dflash (z-lab): hidden_states [1, C, n_aux*H] (the context's features, positions 0..C-1), block_ids [1, bs]
  (slot 0 the last real token, at position C; the rest mask_token_id), optional position_ids [1, C + bs] (default
  arange(C + bs)); the target's embed_tokens [V, H] and lm_head [V, H] as tensors in inputs, or request["target"]
  a local causal-LM dir. Saved: logits [1, bs, V] for every slot (dflash_generate keeps slots 1..bs-1), hidden
  [1, bs, H] (the draft's normed output).
"""

import json
import math
import os
import sys
import traceback
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SPECULATORS_ATTN = {"flex": "simple_flex_attention", "eager": "eager", "sdpa": "sdpa"}


# ---- random weights ---------------------------------------------------------------------------------------


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Every floating parameter drawn from one seeded generator, in name order: matrices N(0, 1/fan_in),
    norm weights 1 + N(0, 0.1) (so a norm left out or misplaced shows), other vectors N(0, 0.02)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
            if not param.is_floating_point():
                continue
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if param.ndim >= 2:
                value = noise / math.sqrt(param.shape[-1])
            elif "norm" in name:
                value = 1 + 0.1 * noise
            else:
                value = 0.02 * noise
            param.copy_(value.to(param.dtype))


def random_draft_ids(vocab: int, draft_vocab: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + 1)
    return torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values


def vocab_maps(token_ids: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """speculators' convention (train/vocab_mapping.py): d2t[i] = target id - i (long), t2d a bool mask."""
    token_ids = token_ids.to(torch.long).sort().values
    d2t = token_ids - torch.arange(token_ids.numel(), dtype=torch.long)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[token_ids] = True
    return t2d, d2t


# ---- verifier ---------------------------------------------------------------------------------------------


def build_verifier(req: dict) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = dict(req["config"])
    config = AutoConfig.for_model(config.pop("model_type"), **config)
    model = AutoModelForCausalLM.from_config(config)
    randomize(model, int(req.get("seed", 0)))
    model.save_pretrained(req["dir"], safe_serialization=True)
    return {"model_class": type(model).__name__, "files": sorted(os.listdir(req["dir"]))}


# ---- speculators --------------------------------------------------------------------------------------------


def speculators_classes(name: str):
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
    from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.models.peagle import PEagleDraftModel, PEagleSpeculatorConfig

    return {
        "eagle3": (Eagle3SpeculatorConfig, Eagle3DraftModel),
        "peagle": (PEagleSpeculatorConfig, PEagleDraftModel),
        "dflash": (DFlashSpeculatorConfig, DFlashDraftModel),
        "dspark": (DSparkSpeculatorConfig, DSparkDraftModel),
    }[name]


def set_attn(config, attn: str | None) -> None:
    """speculators' models default to flex attention (a BlockMask in 128-token blocks, which its trainer pads
    to): on a CPU that runs unfused, and with ttt_steps > 1 fails unless T is a multiple of 128. "eager" (the
    default here) builds the same mask dense (speculators/models/attention.py create_float_mask)."""
    attn = attn or "eager"
    config.transformer_layer_config._attn_implementation = SPECULATORS_ATTN.get(attn, attn)


def speculators_build(req: dict):
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    config_cls, model_cls = speculators_classes(req["model"])
    kwargs = dict(req["config"])
    verifier = req.get("verifier")
    if "speculators_config" not in kwargs:
        architectures = []
        if verifier:
            architectures = VerifierConfig.from_pretrained(verifier).architectures
        kwargs["speculators_config"] = SpeculatorsConfig(
            algorithm=req["model"],
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=int(req.get("speculative_tokens", 3)))],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=verifier, architectures=architectures),
        )
    config = config_cls(**kwargs)
    set_attn(config, req.get("attn"))
    model = model_cls(config)
    seed = int(req.get("seed", 0))
    randomize(model, seed)
    if model.use_draft_vocab:
        ids = req.get("draft_token_ids")
        ids = (
            torch.tensor(ids)
            if ids is not None
            else random_draft_ids(model.verifier_vocab_size, model.draft_vocab_size, seed)
        )
        model.load_vocab_mappings(*vocab_maps(ids, model.verifier_vocab_size))
    if verifier:
        # from_training_args' order: the maps, then the verifier's embed_tokens (and, for a full-vocabulary
        # block draft, its lm_head), which dflash/dspark checkpoints leave out and reload from the verifier;
        # P-EAGLE trains its embedding from the verifier's, so a random one stands for the trained one here.
        if req["model"] != "peagle":
            model.embed_tokens.weight.data.fill_(torch.nan)
        if req["model"] not in ("eagle3", "peagle") and not model.use_draft_vocab:
            model.lm_head.weight.data.fill_(torch.nan)
        model.load_verifier_weights()
    model.save_pretrained(req["dir"])
    return model


def speculators_load(req: dict):
    from speculators import SpeculatorModel, SpeculatorModelConfig
    from speculators.model import DraftVocabMixin
    from speculators.models.eagle3 import Eagle3DraftModel

    config = SpeculatorModelConfig.from_pretrained(req["dir"])
    if "verifier" in req:  # in memory only: the files stay as written
        config.speculators_config.verifier.name_or_path = req["verifier"]
    set_attn(config, req.get("attn"))
    if config.speculators_config.verifier.name_or_path is not None:
        return SpeculatorModel.from_pretrained(req["dir"], config=config)
    # No verifier: DraftVocabMixin skips the verifier's weights (model.py _load_verifier_weights returns), but
    # Eagle3DraftModel.load_verifier_weights then calls AutoConfig.from_pretrained(None) (eagle3/core.py) and
    # fails; for this load it is the mixin's, so what the checkpoint lacks stays NaN (see nan_parameters).
    Eagle3DraftModel.load_verifier_weights = DraftVocabMixin.load_verifier_weights
    try:
        return SpeculatorModel.from_pretrained(req["dir"], config=config)
    finally:
        del Eagle3DraftModel.load_verifier_weights


def speculators_forward(model, inputs: dict, req: dict) -> dict:
    name = model.config.speculators_model_type
    hidden, ids = inputs["hidden_states"].to(model.dtype), inputs["input_ids"].long()
    T = ids.shape[1]
    document_ids = inputs.get("document_ids", torch.zeros(1, T, dtype=torch.long)).long()
    position_ids = inputs.get("position_ids")
    position_ids = position_ids.long() if position_ids is not None else None
    out = {}
    if name == "eagle3":
        steps = []
        hook = model.lm_head.register_forward_hook(lambda _m, _i, o: steps.append(o.detach().clone()))
        try:
            draft_tokens = model(
                hidden, ids, document_ids, position_ids=position_ids, ttt_steps=int(req.get("ttt_steps", 1))
            )
        finally:
            hook.remove()
        out["logits"] = steps[0]
        out.update({f"logits_step{i}": s for i, s in enumerate(steps)})
        out["draft_tokens"] = torch.stack(draft_tokens, 0)
        return out
    # peagle / dflash / dspark: forward returns (None, loss, metrics); the logits are caught on their way to
    # compute_metrics, which is replaced for this call (its targets come from verifier_last_hidden_states, not
    # needed here).
    import speculators.models.dflash.core as dflash_core
    import speculators.models.dspark.core as dspark_core
    import speculators.models.peagle.core as peagle_core

    verifier_last = torch.zeros(1, T, model.hidden_size, dtype=model.dtype)
    if name == "peagle":
        caught = {}

        def catch_peagle(logits, targets, loss_mask, anchor_pos, depth, **kwargs):
            caught.update(logits=logits.detach().clone(), anchor_pos=anchor_pos.clone(), depth=depth.clone())
            return torch.zeros(()), {}

        loss_mask = inputs.get("loss_mask", torch.ones(1, T)).float()
        depths = {k: req[k] for k in ("num_depths", "down_sample_ratio", "down_sample_ratio_min") if k in req}
        saved = peagle_core.compute_metrics
        peagle_core.compute_metrics = catch_peagle
        try:
            model(hidden, ids, document_ids, loss_mask=loss_mask, verifier_last_hidden_states=verifier_last, **depths)
        finally:
            peagle_core.compute_metrics = saved
        return caught

    anchors = inputs["anchor_positions"].long().view(-1)
    loss_mask = torch.zeros(1, T, dtype=torch.long)
    loss_mask[0, anchors] = 1
    caught = {}

    def catch(logits, targets, *args, **kwargs):
        caught["logits"] = logits.detach().clone()
        if name == "dspark" and args and args[0] is not None:
            caught["confidence_logits"] = args[0].detach().clone()
        return torch.zeros(()), {}

    module = dspark_core if name == "dspark" else dflash_core
    saved = module.compute_metrics
    module.compute_metrics = catch
    try:
        model(
            hidden,
            ids,
            loss_mask,
            verifier_last,
            document_ids,
            position_ids=position_ids,
            max_anchors=int(anchors.numel()),
        )
    finally:
        module.compute_metrics = saved
    out.update(caught)
    out["anchor_positions"] = anchors.sort().values
    return out


# ---- z-lab dflash ---------------------------------------------------------------------------------------------


class TargetWeights(torch.nn.Module):
    """The two pieces of the target dflash_generate uses: get_input_embeddings() and lm_head."""

    def __init__(self, embed: torch.Tensor, head: torch.Tensor):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding.from_pretrained(embed, freeze=True)
        self.lm_head = torch.nn.Linear(head.shape[1], head.shape[0], bias=False)
        self.lm_head.weight.data.copy_(head)

    def get_input_embeddings(self):
        return self.embed_tokens


def zlab_target(req: dict, inputs: dict, dtype: torch.dtype):
    if req.get("target"):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(req["target"], dtype=dtype).eval()
    return TargetWeights(inputs["embed_tokens"].to(dtype), inputs["lm_head"].to(dtype))


def zlab_build(req: dict):
    from dflash.model import DFlashDraftModel
    from transformers import Qwen3Config

    config = Qwen3Config(**req["config"])
    if req.get("attn"):
        config._attn_implementation = req["attn"]
    model = DFlashDraftModel(config)
    randomize(model, int(req.get("seed", 0)))
    model.save_pretrained(req["dir"], safe_serialization=True)
    return model


def zlab_load(req: dict, dtype: torch.dtype):
    from dflash.model import DFlash2DraftModel, DFlashDraftModel
    from transformers import AutoConfig

    # dflash/benchmark.py load_transformers_models: the class by architectures, sdpa
    config = AutoConfig.from_pretrained(req["dir"])
    cls = DFlash2DraftModel if "DFlash2DraftModel" in (config.architectures or []) else DFlashDraftModel
    return cls.from_pretrained(req["dir"], attn_implementation=req.get("attn") or "sdpa", dtype=dtype)


def zlab_forward(model, inputs: dict, req: dict) -> dict:
    from dflash.model import _draft_value, _output_head, _raw_input_embeddings

    dtype = model.dtype
    target = zlab_target(req, inputs, dtype)
    context = inputs["hidden_states"].to(dtype)
    block_ids = inputs["block_ids"].long()
    C, bs = context.shape[1], block_ids.shape[1]
    position_ids = inputs.get("position_ids")
    position_ids = position_ids.long() if position_ids is not None else torch.arange(C + bs).unsqueeze(0)
    noise = _raw_input_embeddings(target, block_ids, float(_draft_value(model.config, "input_embedding_scale", 1.0)))
    hidden = model(target_hidden=context, noise_embedding=noise, position_ids=position_ids, use_cache=False)
    return {"logits": model.compute_logits(hidden, _output_head(target)), "hidden": hidden}


# ---- requests -------------------------------------------------------------------------------------------------


def nan_parameters(model: torch.nn.Module) -> list[str]:
    """Weights still NaN after loading: speculators initialises verifier-owned ones to NaN (model.py
    _init_vocab) and fills them from the checkpoint or the verifier; any left means neither had them."""
    return [
        n
        for n, p in model.named_parameters()
        if p.is_floating_point() and bool(p.isnan().any()) and not n.startswith("verifier_")  # loss targets only
    ]


def run_forward(req: dict, model, library: str) -> dict:
    if not req.get("inputs"):
        return {}
    inputs = load_file(req["inputs"])
    with torch.no_grad():
        out = speculators_forward(model, inputs, req) if library == "speculators" else zlab_forward(model, inputs, req)
    out = {k: v.detach().to(torch.float32 if v.is_floating_point() else v.dtype).clone() for k, v in out.items()}
    save_file(out, req["out"])
    return {"out": req["out"], "outputs": {k: list(v.shape) for k, v in out.items()}}


def handle(req: dict) -> dict:
    op, library = req["op"], req.get("library")
    if op == "build_verifier":
        return build_verifier(req)
    dtype = DTYPES[req.get("dtype", "float32")]
    torch.manual_seed(int(req.get("seed", 0)))
    if op == "build_and_save":
        if library == "speculators":
            model = speculators_build(req)
        elif library == "dflash":
            if req.get("model", "dflash") != "dflash":
                raise ValueError("z-lab's dflash builds only model dflash (DFlashDraftModel)")
            model = zlab_build(req)
        else:
            raise ValueError(f"unknown library {library!r}")
    elif op == "load_and_run":
        if library == "speculators":
            model = speculators_load(req)
        elif library == "dflash":
            model = zlab_load(req, dtype)
        else:
            raise ValueError(f"unknown library {library!r}")
    else:
        raise ValueError(f"unknown op {op!r}")
    model = model.to(dtype).eval()
    result = {
        "library": library,
        "model_class": f"{type(model).__module__}.{type(model).__name__}",
        "files": sorted(os.listdir(req["dir"])),
        "config": json.loads(Path(req["dir"], "config.json").read_text()),
        "nan_parameters": nan_parameters(model),
    }
    if hasattr(model, "target_layer_ids"):  # the target layers the library's model reads (decoder layer ids)
        result["target_layer_ids"] = list(model.target_layer_ids)
    result.update(run_forward(req, model, library))
    return result


def main() -> int:
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # the libraries' prints must not mix with the answers
    for line in sys.stdin:
        try:
            result = {"ok": True, **handle(json.loads(line))}
        except Exception as exc:  # the parent reads every failure from the answer
            result = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        answers.write(json.dumps(result, default=str) + "\n")
        answers.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
