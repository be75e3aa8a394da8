"""The README.md model card written next to an exported head: what it is for, how it was made,
how well it drafts (when eagle-eval's results are given) and how to serve it."""

import json
from pathlib import Path

from eagle_train.export.layouts import PROVENANCE_KEY, servable_target, verifier
from eagle_train.files import write_text
from eagle_train.methods import METHODS

SERVE = {
    "eagle3": """```bash
# vLLM
vllm serve {target} --speculative-config '{{"method": "eagle3", "model": "{out}", "num_speculative_tokens": 3}}'
# SGLang
python -m sglang.launch_server --model-path {target} --speculative-algorithm EAGLE3 \\
    --speculative-draft-model-path {out} --speculative-num-steps 3 --speculative-eagle-topk 1 \\
    --speculative-num-draft-tokens 4
```""",
    "speculators": """```bash
vllm serve {out}    # the config names the verifier ({target}) and the number of draft tokens
```""",
    "draft_model": """```bash
# vLLM
vllm serve {target} --speculative-config '{{"method": "draft_model", "model": "{out}", "num_speculative_tokens": 3}}'
# SGLang
python -m sglang.launch_server --model-path {target} --speculative-algorithm STANDALONE \\
    --speculative-draft-model-path {out} --speculative-num-steps 3 --speculative-eagle-topk 1 \\
    --speculative-num-draft-tokens 4
# TensorRT-LLM: speculative_config: {{decoding_type: DraftTarget, max_draft_len: 3, speculative_model: {out}}}
# llama.cpp: eagle-export CHECKPOINT --format gguf --out draft.gguf --target TARGET.gguf, then
llama-server -m TARGET.gguf -md draft.gguf --spec-type draft-simple --spec-draft-n-max 3
```""",
}


def eval_summary(record: dict) -> list[str]:
    """Lines for the card from eagle-eval's results JSON (its "summary", bench, drafting, sampling)."""
    summary = record.get("summary", record)
    if "acceptance_length" not in summary:
        return []
    drafting, sampling = record.get("drafting") or {}, record.get("sampling") or {}
    shape = ""
    if drafting:
        shape = (
            f"chain K={drafting['depth']}"
            if drafting.get("chain")
            else f"tree depth {drafting['depth']}, top-k {drafting['topk']}, {drafting['total']} tokens"
        )
    where = [
        record.get("bench"),
        shape,
        f"temperature {sampling['temperature']}" if "temperature" in sampling else None,
        " ".join(str(record[k]) for k in ("device", "dtype") if k in record),
    ]
    where = ", ".join(w for w in where if w)
    lines = [f"- acceptance length **{float(summary['acceptance_length']):.2f}**" + (f" ({where})" if where else "")]
    if summary.get("acceptance_per_position"):
        rates = ", ".join(f"{float(r):.2f}" for r in summary["acceptance_per_position"])
        lines.append(f"- acceptance rate by draft position: {rates}")
    if summary.get("speedup"):
        lines.append(f"- speedup over plain decoding on the same runtime: {float(summary['speedup']):.2f}x")
    return lines


def write_model_card(out: Path, config: dict, layout_name: str, dtype, eval_results=None) -> Path:
    ours = config.get(PROVENANCE_KEY, {})
    target = ours.get("target") or "TARGET"
    layer = config.get("transformer_layer_config") or config
    lines = [
        f"# {METHODS[ours.get('method', 'eagle3')].title} draft for {target}",
        "",
        f"Speculative-decoding draft head exported by eagle-train in the `{layout_name}` layout "
        f"({str(dtype).replace('torch.', '')}).",
        "",
        f"- target: `{target}` ({ours.get('target_num_layers', '?')} layers; the head reads hidden states "
        f"{ours.get('aux_layer_ids')})",
        f"- draft vocabulary: {config.get('draft_vocab_size')} of {layer.get('vocab_size')} tokens",
        f"- context: {layer.get('max_position_embeddings')} positions, RoPE base {layer.get('rope_theta')}",
    ]
    for key, label in (("data", "training data"), ("steps", "training steps")):
        if ours.get(key) is not None:
            lines.append(f"- {label}: {ours[key]}")
    if eval_results is not None:
        if isinstance(eval_results, (str, Path)):
            eval_results = json.loads(Path(eval_results).read_text())
        lines += ["", "## Measured with eagle-eval", ""] + (
            eval_summary(eval_results) or ["- (the results file reports no acceptance length)"]
        )
    lines += [
        "",
        "## Serving",
        "",
        SERVE[layout_name].format(target=verifier(config) or servable_target(target), out=out)
        if layout_name in SERVE
        else "See docs/deploying.md.",
        "",
    ]
    path = out / "README.md"
    write_text(path, "\n".join(lines))
    return path
