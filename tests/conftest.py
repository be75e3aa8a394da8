"""Shared fixtures. Session-scoped ones are built once per test run; add yours below in their own section."""

import math
import os
import socket
from collections import defaultdict
from pathlib import Path

import pytest
import torch

# Under pytest-xdist (`pytest -n 2`) each worker takes its share of the cores: torch's default of every core in
# each worker oversubscribes the machine and its matmuls crawl. OMP_NUM_THREADS passes the share to subprocesses.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    _share = max(1, _cores // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ["OMP_NUM_THREADS"] = str(_share)
    torch.set_num_threads(_share)
    # vLLM's CPU engine ignores OMP_NUM_THREADS and binds its threads to cores itself: each worker's engines get
    # the worker's own cores, so two engines never share one
    _worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    _mine = sorted(os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(_cores))
    _first = _worker * _share % len(_mine)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, _mine[_first : _first + _share]))

# No machine that runs the tests reaches the Hub: a name left to it fails at once instead of after the Hub
# client's retries. Set before transformers and huggingface_hub are imported, which read it once.
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(autouse=True)
def fresh_accelerator_state():
    """Each test's training builds its own Accelerator: accelerate keeps one state per process and refuses a
    second Accelerator of another precision (`mixed_precision: auto` is bf16 on CPUs with bf16 instructions)."""
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()


# ------------------------------------------------------------------------------ the architecture matrix
# tests/test_every_architecture.py records a figure per model_type and stage; the run ends with the table.

MATRIX: dict[str, dict[str, str]] = defaultdict(dict)


def matrix_table() -> list[str]:
    """MATRIX as a Markdown table: one row per model_type, one column per stage any test recorded."""
    stages = list(dict.fromkeys(stage for row in MATRIX.values() for stage in row))
    lines = ["| model_type | " + " | ".join(stages) + " |", "|---" * (len(stages) + 1) + "|"]
    for model_type in sorted(MATRIX):
        lines.append(f"| {model_type} | " + " | ".join(MATRIX[model_type].get(s, "-") for s in stages) + " |")
    return lines


def pytest_sessionfinish(session):
    """An xdist worker hands its rows of the matrix to the controller, which prints the table."""
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["matrix"] = dict(MATRIX)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """The xdist controller: a finished worker's rows of the matrix."""
    for model_type, row in getattr(node, "workeroutput", {}).get("matrix", {}).items():
        MATRIX[model_type].update(row)


def pytest_terminal_summary(terminalreporter):
    """Print the matrix; with EAGLE_MATRIX_MARKDOWN=FILE also write it there (scripts/supported_models.py)."""
    if MATRIX:
        terminalreporter.section("architectures: every stage, as the tests measured it")
        for line in matrix_table():
            terminalreporter.write_line(line)
        if os.environ.get("EAGLE_MATRIX_MARKDOWN"):
            Path(os.environ["EAGLE_MATRIX_MARKDOWN"]).write_text("\n".join(matrix_table()) + "\n")


def load_script(path: str):
    """A module of scripts/ (not a package), imported from its file: `path` under scripts/, e.g. "bench/quality.py"."""
    import importlib.util

    file = Path(__file__).resolve().parents[1] / "scripts" / path
    spec = importlib.util.spec_from_file_location(file.stem, file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    """A TCP port nothing listens on now: each `accelerate launch` of the tests gets its own, so launches in
    parallel workers (pytest -n) never meet on accelerate's default port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------ comparing forwards


def forward_rounding_atol(config, reference: torch.Tensor) -> torch.Tensor:
    """Per-row absolute tolerance between two fp32 forwards of one target that differ only in the order of their
    reductions (thread count, batch shape, kernel choice: machines differ).

    Each of the L layers sums at most `inner` products per output; their rounding errors grow like
    eps * sqrt(inner) of the row's scale and add up over the layers like a random walk, hence
    eps * sqrt(L * inner) * max|row|, with a margin of 4. A wrong mask or position shifts a row by a
    fraction of its scale, thousands of times more."""
    inner = max(config.hidden_size, getattr(config, "intermediate_size", None) or 0)
    scale = reference.detach().abs().amax(-1, keepdim=True).float()
    return 4 * torch.finfo(torch.float32).eps * math.sqrt(config.num_hidden_layers * inner) * scale


def assert_same_forward(got: torch.Tensor, want: torch.Tensor, config, stored_dtype=torch.float32):
    """`got` equals `want` up to the rounding of the forward (forward_rounding_atol) and, when the values were
    stored in a narrower float type, one unit in the last place of that type (rounding may land either side)."""
    got, want = got.float(), want.float()
    ulp = torch.finfo(stored_dtype).eps if stored_dtype != torch.float32 else 0.0
    err = (got - want).abs()
    bound = forward_rounding_atol(config, want) + ulp * torch.maximum(got.abs(), want.abs())
    worst = (err - bound).flatten().argmax()
    assert (err <= bound).all(), (
        f"greatest difference {err.flatten()[worst]:.3g} against a bound of {bound.flatten()[worst]:.3g} "
        f"(value {want.flatten()[worst]:.6g})"
    )


# ------------------------------------------------------------------------------ tiny models
# The one factory for the random heads and targets the tests build. Sizes are the smallest that still
# have grouped-query attention (4 query heads of 8, 2 KV heads) and a draft vocabulary smaller than the
# target's (40 of 50 tokens), so CPU tests run in milliseconds; the builders seed torch first, so a test
# sees the same weights on every run (tests that pin numbers pass their own sizes and seeds).

H, NH, NKV, D, I, V, VD, N = 32, 4, 2, 8, 64, 50, 40, 8  # noqa: E741 (I: intermediate size; N: target layers)
K = 4  # a tiny P-EAGLE head's drafts per forward

TINY_DRAFT = dict(
    hidden_size=H,
    num_attention_heads=NH,
    num_key_value_heads=NKV,
    head_dim=D,
    intermediate_size=I,
    vocab_size=V,
    draft_vocab_size=VD,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    rope_scaling=None,
    max_position_embeddings=1024,
    target_hidden_size=H,
    target_num_layers=N,
    aux_layer_ids=(2, 4, 5),
    target="tiny-target",
    target_architectures=["LlamaForCausalLM"],
)
TINY_PEAGLE = dict(num_hidden_layers=2, mask_token_id=V - 1, num_depths=K)  # the mask token: the last id
TINY_BLOCK = {  # the block drafters: DFlash, and DSpark with its options
    "dflash": dict(num_hidden_layers=2, mask_token_id=V - 1, block_size=4),
    "dspark": dict(
        num_hidden_layers=2,
        mask_token_id=V - 1,
        block_size=4,
        sample_from_anchor=True,
        markov_rank=4,
        confidence_head=True,
    ),
}
TINY_TARGET = dict(  # the target tiny_draft_config's head drafts for
    vocab_size=V,
    hidden_size=H,
    intermediate_size=I,
    num_hidden_layers=N,
    num_attention_heads=NH,
    num_key_value_heads=NKV,
    max_position_embeddings=1024,
    rope_theta=100000.0,
)
TARGET_FAMILIES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}  # transformers classes


def tiny_draft_config(**changes):
    """The tiny head's DraftConfig (TINY_DRAFT, plus TINY_PEAGLE or TINY_BLOCK for its method) with `changes`."""
    from eagle_train.draft_config import DraftConfig

    method = changes.get("method")
    extra = TINY_PEAGLE if method == "peagle" else TINY_BLOCK.get(method, {})
    return DraftConfig(**{**TINY_DRAFT, **extra, **changes})


def set_random_vocab_map(head, among=None):
    """A random sorted subset of the first `among` target ids (all by default) as the draft vocabulary."""
    cfg = head.config
    ids = torch.randperm(among or cfg.vocab_size)[: cfg.draft_vocab_size].sort().values
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    head.set_vocab_map(ids - torch.arange(cfg.draft_vocab_size), t2d)


def tiny_head(method="eagle3", seed=0, init_std=0.3, draft_ids="random", target_model=None, **config_changes):
    """A random fp32 head of `method` (eagle3, peagle, dflash, dspark) of tiny_draft_config(**config_changes), or, given
    a `target_model`, sized like it (DraftConfig.from_target_config(**config_changes)) and on its
    embedding (and lm_head, for a block head with block_lm_head target): borrowed by EAGLE-3 and the block heads, an
    own copy for P-EAGLE, as their from_target give them.

    seed: torch's seed first (None: go on from the caller's); init_std: every weight drawn from
    N(0, init_std) (None: the constructor's initialisation), large enough that tests see the head's
    layers at work; draft_ids: the target ids of the draft vocabulary, "random" (a random sorted subset
    when smaller than the target's) or None (the constructor's map)."""
    from eagle_train.draft_config import DraftConfig
    from eagle_train.methods import row

    if seed is not None:
        torch.manual_seed(seed)
    if target_model is None:
        config = tiny_draft_config(method=method, **config_changes)
    else:
        config = DraftConfig.from_target_config(target_model.config, method=method, **config_changes)
    head = row(method).head_class(config)
    if init_std is not None:
        for p in head.parameters():
            torch.nn.init.normal_(p, std=init_std)
    if isinstance(draft_ids, str):
        if config.draft_vocab_size < config.vocab_size:
            set_random_vocab_map(head)
    elif draft_ids is not None:
        draft_ids = torch.as_tensor(draft_ids)
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[draft_ids] = True
        head.set_vocab_map(draft_ids - torch.arange(len(draft_ids)), t2d)
    if method == "peagle" and target_model is not None:
        head.attach_embedding(target_model.get_input_embeddings().weight, own=True)
    elif target_model is not None:
        head.use_target_weights(target_model)
    return head


def as_target_logits(lm_head_weight):
    """The TargetLogits of a plain lm_head (no scale, no cap) of these weights, in fp32 as the trainer runs it."""
    from eagle_train.hidden_states import TargetLogits

    lm_head = torch.nn.Linear(lm_head_weight.shape[1], lm_head_weight.shape[0], bias=False)
    lm_head.weight.data = lm_head_weight.float()
    return TargetLogits(lm_head)


def tiny_target_config(family="llama", **changes):
    """A Llama-family (TARGET_FAMILIES) config: TINY_TARGET with `changes`."""
    import transformers

    return getattr(transformers, f"{TARGET_FAMILIES[family]}Config")(**{**TINY_TARGET, **changes})


def tiny_target(family="llama", seed=0, noise=0.0, **config_changes):
    """A random target of tiny_target_config(family, **config_changes) in eval mode; `noise`: the std of
    Gaussian noise added to every weight, so that norms (all 1) and biases (all 0) matter too."""
    import transformers

    torch.manual_seed(seed)
    model_class = getattr(transformers, f"{TARGET_FAMILIES[family]}ForCausalLM")
    model = model_class(tiny_target_config(family, **config_changes)).eval()
    if noise:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * noise)
    return model


def tiny_pair(seed=0, *, draft_vocab_size, lm_head_scale=1.0, init_std=0.3, draft_ids="random", **target_changes):
    """(tiny_target(**target_changes), a random EAGLE-3 head over `draft_vocab_size` of its tokens on its
    embedding), both in eval mode, from one seed. lm_head_scale > 1 makes the target confident, so random
    drafts are accepted well above chance."""
    model = tiny_target(seed=seed, **target_changes)
    with torch.no_grad():
        model.lm_head.weight.mul_(lm_head_scale)
    head = tiny_head(
        seed=None, init_std=init_std, draft_ids=draft_ids, target_model=model, draft_vocab_size=draft_vocab_size
    )
    return model, head.eval()


# ------------------------------------------------------------------------------ targets and data
# (target loading, data preparation, hidden-state store)

# Short conversations of different lengths, so batched captures really pad.
CONVERSATIONS = [
    {
        "id": "c0",
        "messages": [
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "The capital of France is Paris."},
        ],
    },
    {
        "id": "c1",
        "messages": [
            {"role": "user", "content": "Count to five."},
            {"role": "assistant", "content": "1, 2, 3, 4, 5."},
            {"role": "user", "content": "Now backwards, please."},
            {"role": "assistant", "content": "5, 4, 3, 2, 1."},
        ],
    },
    {
        "id": "c2",
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
        ],
    },
    {
        "id": "c3",
        "messages": [
            {"role": "user", "content": "Write a haiku about rain."},
            {
                "role": "assistant",
                "content": "Soft rain on the roof,\nwhispers through the sleeping town,\nmorning comes washed clean.",
            },
        ],
    },
    {
        "id": "c4",
        "messages": [
            {"role": "user", "content": "Give me one tip for learning Python."},
            {"role": "assistant", "content": "Write a small program every day and read the error messages carefully."},
        ],
    },
    {"id": "c5", "messages": [{"role": "user", "content": "Is 7 prime?"}, {"role": "assistant", "content": "Yes."}]},
]


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the embedded SmolLM2-135M-Instruct, fp32 on CPU, frozen."""
    from eagle_train.target import SMOLLM2, load_target

    return load_target(SMOLLM2)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm2):
    """A saved random 4-layer Llama (hidden 32) with SmolLM2's tokenizer and vocabulary."""
    model = tiny_target(
        vocab_size=49152,
        num_hidden_layers=4,
        rope_theta=10000.0,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=True,
    )
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    smollm2[1].save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama(tiny_llama_dir):
    """(model, tokenizer) of the tiny random Llama, loaded through load_target like any target."""
    from eagle_train.target import load_target

    return load_target(str(tiny_llama_dir))


@pytest.fixture(scope="session")
def tiny_head_dir(tiny_llama, tmp_path_factory):
    """An untrained EAGLE-3 head for the tiny Llama (2000 draft tokens), saved."""
    path = tmp_path_factory.mktemp("tiny-head")
    tiny_head(init_std=None, draft_ids=None, target_model=tiny_llama[0], draft_vocab_size=2000).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def conversations_jsonl(tmp_path_factory):
    """CONVERSATIONS as an OpenAI-style `messages` JSONL file."""
    import json

    path = tmp_path_factory.mktemp("data") / "conversations.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in CONVERSATIONS))
    return path


@pytest.fixture(scope="session")
def small_tokenized(tmp_path_factory, conversations_jsonl, smollm2):
    """Tokenized dataset dir (ids + loss masks + vocab map) of CONVERSATIONS for SmolLM2."""
    from data_prep.dataset import tokenize_dataset
    from eagle_train.target import SMOLLM2

    path = tmp_path_factory.mktemp("tokenized")
    tokenize_dataset(str(conversations_jsonl), path, SMOLLM2, max_length=128, tokenizer=smollm2[1])
    return path


@pytest.fixture(scope="session")
def small_store(tmp_path_factory, small_tokenized, smollm2):
    """bf16 hidden-state store of `small_tokenized` captured from SmolLM2 (aux layers 2, 15, 27)."""
    from data_prep.capture import capture
    from eagle_train.target import SMOLLM2

    path = tmp_path_factory.mktemp("store")
    model, tokenizer = smollm2
    capture(
        model,
        small_tokenized,
        path,
        target_name=SMOLLM2,
        token_budget=160,
        shard_tokens=100,
        pad_id=tokenizer.pad_token_id,
        progress=False,
    )
    return path


TRAIN_DRAFT_VOCAB = 256  # keeps the draft lm_head (the head's largest matmul) small on the CPU


def with_train_vocab_map(path):
    from data_prep.vocab import make_vocab_map

    make_vocab_map(path, 49152, TRAIN_DRAFT_VOCAB)
    return path


@pytest.fixture(scope="session")
def train_tokenized(tmp_path_factory, small_tokenized):
    """A private copy of the tokenized conversations with a 256-token draft vocabulary."""
    import shutil

    path = tmp_path_factory.mktemp("trainer") / "tokenized"
    shutil.copytree(small_tokenized, path)
    return with_train_vocab_map(path)


@pytest.fixture(scope="session")
def train_store(tmp_path_factory, train_tokenized, smollm2):
    """fp32 hidden-state store of the same conversations, captured by data_prep (same vocab map)."""
    from data_prep.capture import capture

    path = tmp_path_factory.mktemp("trainer") / "store"
    capture(
        smollm2[0],
        train_tokenized,
        path,
        target_name="smollm2-135m",
        dtype="float32",
        token_budget=512,
        pad_id=smollm2[1].pad_token_id,
        progress=False,
    )
    return with_train_vocab_map(path)


class EagerStep:
    """Stands in for the runtime's GraphedStep: same calls, no capture."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args):
        return self.fn(*args)

    def reset(self):
        pass


def vllm_turns_are_hf_greedy(smollm2, method: str, export, k: int, questions, new_tokens: int) -> list:
    """vLLM's turns on `questions` with `export` drafting K=`k` a round (its `method`'s speculative_config), each
    checked equal to HF's greedy continuation and non-empty, from the tested vLLM in fp32 (a CPU's default, HF's
    exactness); the turns, for the caller's counts."""
    from eagle_train.target import SMOLLM2, end_of_turn_ids
    from engines import vllm_child, vllm_decode
    from inference.evaluate import chat_ids

    model, tokenizer = smollm2
    prompts = [chat_ids(tokenizer, [{"role": "user", "content": q}]) for q in questions]
    with vllm_decode.Decoder(SMOLLM2, vllm_decode.speculative(method, export, k)) as engine:
        assert engine.version == vllm_child.TESTED and engine.dtype == "float32"
        turns = engine.decode(prompts, new_tokens)
    eos = list(end_of_turn_ids(model, tokenizer))
    for ids, turn in zip(prompts, turns):
        with torch.no_grad():
            hf = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=eos)
        assert turn.output_ids == hf[0, len(ids) :].tolist() and turn.output_ids
    return turns
