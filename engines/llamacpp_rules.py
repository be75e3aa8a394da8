"""What llama.cpp reads from a head GGUF: the findings on a file against the target's GGUF and, given the source
head, against what export_gguf writes for it (`static_findings`, what `eagle-export --check PATH --engine llamacpp`
reports before it runs llama.cpp), and the targets llama.cpp drafts on (`LAYER_INPUT_ARCHS`, `target_arch_finding`).
"""

import tempfile
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType

from eagle_train.export.gguf import (
    ARCHS,
    BLOCK_ARCH,
    MASK_KEY,
    export_gguf,
    field_value,
    gguf_arch,
    read_gguf,
    read_target,
)
from eagle_train.unreadable import HEAD_FIX, open_gguf
from engines.live import d2t_finding, layers_finding
from engines.llamacpp_build import VERSION
from engines.rules import Finding

# Largest |file - head| / max |head| a weight may show for its GGUF type: one rounding step of that
# type (f16 2^-11, bf16 2^-8, q8_0 a block's max / 254), doubled; coarser types are not compared.
TOLERANCE = {
    GGMLQuantizationType.F32: 1e-6,
    GGMLQuantizationType.F16: 1e-3,
    GGMLQuantizationType.BF16: 1e-2,
    GGMLQuantizationType.Q8_0: 1e-2,
}
REEXPORT = "re-export it: eagle-export HEAD --format gguf --out FILE.gguf --target {target}"
# The target architectures (general.architecture) whose llama.cpp graph exposes its layer inputs (res->t_layer_inp,
# src/models/*.cpp of llama-cpp-python VERSION's vendor/llama.cpp), which EAGLE-3 and DFlash / DSpark drafting read
# through llama_set_embeddings_layer_inp; on any other target llama.cpp aborts ("layer input tensor is null").
LAYER_INPUT_ARCHS = frozenset(
    {
        "bailingmoe3", "deepseek4", "gemma4", "gpt-oss", "hunyuan_vl", "lfm2", "llama", "mimo2", "minimax-01",
        "minimax-m2", "muse-glimmer", "nanbeige", "nemotron_h", "qwen3", "qwen35", "qwen35moe", "qwen3moe",
        "qwen3next", "qwen4exp",
    }
)  # fmt: skip


def target_arch_finding(target_arch: str, head_arch: str) -> list[Finding]:
    """llama.cpp drafts from a target's layer inputs only where its graph for the target exposes them."""
    if target_arch in LAYER_INPUT_ARCHS:
        return []
    kind = "DFlash / DSpark" if head_arch == BLOCK_ARCH else "EAGLE-3"
    return [
        Finding(
            "error",
            f"llama.cpp {VERSION} drafts no {kind} head on a {target_arch!r} target: its graph for that architecture "
            "exposes no layer inputs (it aborts with 'layer input tensor is null'); evaluate the head with the "
            "built-in runtime (eagle-eval --engine builtin) or serve it with another engine",
            f"a target llama.cpp drafts no {kind} head on ({target_arch})",
        )
    ]


# common/speculative.cpp's SPEC_VOCAB_MAX_SIZE_DIFFERENCE and SPEC_VOCAB_CHECK_START_TOKEN_ID
VOCAB_SIZE_SLACK, VOCAB_CHECK_FROM = 128, 5


def model_findings(file: Path, target: str) -> list[Finding]:
    """A draft model's GGUF (any architecture but the heads'): llama.cpp drafts with it only when its vocabulary is the
    target's, by its own rule (common_speculative_are_compatible): the tokenizer type, whether and which bos and eos are
    added, sizes within VOCAB_SIZE_SLACK and each token's text from id VOCAB_CHECK_FROM on."""
    draft, tgt = open_gguf(file, "draft model GGUF", HEAD_FIX), read_target(target)

    def field(reader, key, default=None):
        found = reader.fields.get(key)
        return field_value(found) if found is not None else default

    findings = []
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token"):
        if field(draft, key) != field(tgt, key):
            findings.append(Finding("error", f"{key} is {field(draft, key)!r}, the target's {field(tgt, key)!r}"))
    for end in ("bos", "eos"):
        key = f"tokenizer.ggml.{end}_token_id"
        if field(tgt, f"tokenizer.ggml.add_{end}_token") and field(draft, key) != field(tgt, key):
            findings.append(Finding("error", f"{key} is {field(draft, key)}, the target's {field(tgt, key)}"))
    ours, theirs = field(draft, "tokenizer.ggml.tokens", []), field(tgt, "tokenizer.ggml.tokens", [])
    if abs(len(ours) - len(theirs)) > VOCAB_SIZE_SLACK:
        findings.append(Finding("error", f"the file's tokenizer has {len(ours)} tokens, the target's {len(theirs)}"))
    differ = [i for i in range(VOCAB_CHECK_FROM, min(len(ours), len(theirs))) if ours[i] != theirs[i]]
    if differ:
        findings.append(Finding("error", f"{len(differ)} tokens differ from the target's (the first: id {differ[0]})"))
    for f in findings:
        f.message += ": llama.cpp refuses the pair; draft with a model of the target's tokenizer"
    return findings


def static_findings(file: Path, target: str, source_head) -> list[Finding]:
    """What llama.cpp would read from `file` against the target's GGUF and, given a source head,
    against what export_gguf writes for it; errors name the likely cause and the fix. A draft model's file (an
    architecture no head has) by `model_findings`."""
    if gguf_arch(file) not in ARCHS:
        return model_findings(file, target)
    head, tgt = read_gguf(file), read_target(target)
    arch = field_value(tgt.fields["general.architecture"]).decode()

    def target_key(name, default=None):
        found = tgt.fields.get(f"{arch}.{name}")
        return field_value(found) if found is not None else default

    findings = gguf_target_findings(
        head, target_key("rope.freq_base", 10000.0), target_key("block_count"), target_key("embedding_length")
    )
    findings += gguf_size_findings(head, tgt)
    if head.arch == BLOCK_ARCH:
        findings += block_findings(head)
    if source_head is not None:
        with tempfile.TemporaryDirectory() as tmp:
            expected = read_gguf(export_gguf(source_head, Path(tmp) / "expected.gguf", target))
        findings += gguf_source_findings(head, expected, {f.cause for f in findings})
    for f in findings:
        if f.severity == "error":
            f.message += f"; {REEXPORT.format(target=target)}"
    return target_arch_finding(arch, head.arch) + findings


def gguf_size_findings(head, tgt) -> list[Finding]:
    tokens = tgt.fields.get("tokenizer.ggml.tokens")
    n_vocab = len(tokens.data) if tokens is not None else 0
    findings = []
    if head.n_vocab != n_vocab:
        findings.append(
            Finding(
                "error",
                f"the file's tokenizer has {head.n_vocab} tokens, the target's {n_vocab}: made for another target",
            )
        )
    d2t, lm_head = head.tensors.get("d2t"), head.tensors.get("lm_head.weight")
    if d2t is None or lm_head is None:  # a full-vocabulary head: nothing to map
        return findings
    if head.types["d2t"] != GGMLQuantizationType.I64:
        findings.append(
            Finding("error", f"d2t is {head.types['d2t'].name}; llama.cpp asserts I64 (absolute target ids)")
        )
    if len(d2t) != len(lm_head):
        findings.append(
            Finding(
                "error", f"d2t has {len(d2t)} entries, output.weight {len(lm_head)} rows: llama.cpp refuses the file"
            )
        )
    if d2t.min() < 0 or d2t.max() >= head.n_vocab:
        findings.append(
            Finding(
                "error",
                f"d2t holds ids outside the target vocabulary [0, {head.n_vocab}): llama.cpp writes out of bounds",
            )
        )
    elif d2t.unique().numel() != d2t.numel():
        findings.append(
            Finding(
                "error",
                "d2t maps several draft ids to one target id: it looks like EAGLE's offsets (target id - draft id), "
                "llama.cpp wants absolute target ids",
                cause="d2t written as offsets",
            )
        )
    return findings


def gguf_target_findings(head, target_theta: float, n_layer: int, width: int) -> list[Finding]:
    keys, findings, arch = head.keys, [], head.arch
    theta = keys["rope.freq_base"]
    if not np.isclose(theta, target_theta, rtol=1e-6):
        findings.append(
            Finding(
                "error",
                f"{arch}.rope.freq_base is {theta:g}, the target's {target_theta:g}: llama.cpp rotates the draft's "
                "queries and keys at frequencies the head was not trained with (our heads use the target's "
                "RoPE; a converter that leaves the key out gets llama.cpp's default 10000)",
                cause=f"a wrong RoPE base ({theta:g} instead of {target_theta:g})",
            )
        )
    layers = list(keys.get("target_layers", []))
    fc = head.tensors.get("fc.weight")
    if arch != BLOCK_ARCH and len(layers) != 3:
        findings.append(Finding("error", f"eagle3.target_layers is {layers}: llama.cpp needs exactly three ids"))
    elif arch == BLOCK_ARCH and (fc is None or fc.shape[1] != len(layers) * keys.get("embedding_length", 0)):
        findings.append(
            Finding(
                "error",
                f"dflash.target_layers {layers} gives fc {len(layers)} x {keys.get('embedding_length')} inputs, "
                f"fc.weight takes {None if fc is None else fc.shape[1]}: llama.cpp refuses the file",
            )
        )
    elif any(not 0 <= i <= n_layer for i in layers):
        findings.append(
            Finding(
                "error",
                f"{arch}.target_layers {layers} reaches outside the target's layer inputs 0..{n_layer} "
                f"(a {n_layer}-layer target; llama.cpp aborts): the head was made for another target",
                cause="target_layers of another target",
            )
        )
    elif layers != sorted(layers):
        findings.append(
            Finding(
                "warning",
                f"{arch}.target_layers {layers} is not in increasing order: our heads read their layers from low "
                "to high, so it may be reversed",
            )
        )
    widths = ("embedding_length", "target_hidden_size") if arch != BLOCK_ARCH else ("embedding_length",)
    for key in widths:
        if keys.get(key) != width:
            findings.append(
                Finding(
                    "error",
                    f"{arch}.{key} is {keys.get(key)}, the target's embedding_length {width}: "
                    "made for another target (llama.cpp reads the target's layer inputs at the draft's width"
                    + (" and borrows the target's embeddings)" if arch != BLOCK_ARCH else ")"),
                )
            )
    return findings


def block_findings(head) -> list[Finding]:
    """What llama.cpp's dflash loader and drafting need of a block head's file beyond the target's sizes."""
    keys, tensors, findings = head.keys, head.tensors, []
    if keys.get("block_size", 0) < 2:
        findings.append(
            Finding(
                "error",
                f"dflash.block_size is {keys.get('block_size')}: llama.cpp drafts block_size - 1 tokens a block "
                "(DSpark's Markov head asserts the key)",
            )
        )
    mask = head.mask_token_id
    if mask is None or not 0 <= mask < head.n_vocab:
        findings.append(
            Finding(
                "error",
                f"{MASK_KEY} is {mask}: llama.cpp embeds the block's masks by this token's row of token_embd, "
                f"so it must be a token of the {head.n_vocab}-token vocabulary",
            )
        )
    elif "embed_tokens.weight" not in tensors:
        findings.append(
            Finding(
                "warning",
                "the file has no token_embd.weight: llama.cpp embeds the masks by the target's row "
                f"{mask}, not the head's learnt mask embedding",
                cause="no mask embedding",
            )
        )
    norms = [f"layers.{i}.self_attn.{n}_norm.weight" for i in range(keys.get("block_count", 0)) for n in "qk"]
    absent = [n for n in norms if n not in tensors]
    if absent:
        findings.append(Finding("error", f"the file lacks {absent}: llama.cpp's dflash loader requires them"))
    w1, w2 = tensors.get("markov_head.markov_w1"), tensors.get("markov_head.markov_w2")
    lm_head = tensors.get("lm_head.weight")
    if (w1 is None) != (w2 is None):
        findings.append(Finding("error", "the file holds one of markov_w1 and markov_w2: llama.cpp needs both"))
    elif w1 is not None:
        rank = w1.shape[1]
        want = {"markov_w1": [head.n_vocab, rank], "markov_w2": [len(lm_head) if lm_head is not None else 0, rank]}
        for name, got in (("markov_w1", w1), ("markov_w2", w2)):
            if list(got.shape) != want[name]:
                findings.append(Finding("error", f"{name} is {list(got.shape)}, llama.cpp's loader wants {want[name]}"))
        conf = tensors.get("confidence_head.proj.weight")
        if conf is not None and list(conf.shape) != [1, keys["embedding_length"] + rank]:
            findings.append(
                Finding(
                    "error",
                    f"conf_proj.weight is {list(conf.shape)}, llama.cpp reads [hidden state; markov_w1 row]: "
                    f"[1, {keys['embedding_length'] + rank}]",
                )
            )
    return findings


def gguf_source_findings(head, expected, covered: set[str]) -> list[Finding]:
    """Where the file differs from export_gguf's file for the source head; `covered` causes are not repeated."""
    if head.arch != expected.arch:
        return [
            Finding("error", f"the file is a {head.arch!r} draft, export_gguf writes the head as {expected.arch!r}")
        ]
    findings = []
    if head.mask_token_id != expected.mask_token_id:
        findings.append(
            Finding("error", f"{MASK_KEY} is {head.mask_token_id}, the head's mask token is {expected.mask_token_id}")
        )
    for key in sorted(set(head.keys) | set(expected.keys)):
        got, want = head.keys.get(key), expected.keys.get(key)
        if key == "target_layers" and list(got or []) != list(want):
            findings.append(layers_finding(list(got or []), list(want), "llama.cpp", f"{head.arch}.target_layers"))
        elif key == "rope.freq_base" and not np.isclose(got, want, rtol=1e-6):
            findings.append(
                Finding(
                    "error",
                    f"{head.arch}.rope.freq_base is {got:g}, the head was trained with {want:g}",
                    cause=f"a wrong RoPE base ({got:g} instead of {want:g})",
                )
            )
        elif key not in ("target_layers", "rope.freq_base") and got != want:
            findings.append(
                Finding(
                    "error",
                    f"{head.arch}.{key} is {got}, export_gguf writes {want} for the source head",
                    f"{head.arch}.{key}",
                )
            )
    missing = sorted(set(expected.tensors) - set(head.tensors))
    extra = sorted(set(head.foreign) - set(expected.foreign))
    if missing or extra:
        findings.append(Finding("error", f"the file lacks the tensors {missing} and holds {extra} besides"))
    for name in sorted(set(expected.tensors) & set(head.tensors)):
        got, want = head.tensors[name], expected.tensors[name]
        if got.shape != want.shape:
            findings.append(Finding("error", f"{name} is {list(got.shape)}, the source head's {list(want.shape)}"))
        elif name == "d2t":
            if not torch.equal(got, want):
                findings.append(d2t_finding(got, want, "llama.cpp"))
        elif head.types[name] in TOLERANCE:
            diff = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-12)
            if diff > TOLERANCE[head.types[name]]:
                findings.append(
                    Finding(
                        "error",
                        f"{name} differs from the source head's by {diff:.2g} of its largest value "
                        f"({head.types[name].name} allows {TOLERANCE[head.types[name]]:g}): the file holds another "
                        "head's weights, or Q/K rows not in llama.cpp's RoPE order",
                        cause="weights that are not the source head's",
                    )
                )
    return [f for f in findings if f.cause not in covered or not f.cause]
