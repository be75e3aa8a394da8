"""Shared fixtures. Session-scoped ones are built once per test run; add yours below in their own section."""

import math

import pytest
import torch

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


# ------------------------------------------------------------------------------ targets and data
# (issue 2: target loading, data preparation, hidden-state store)

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
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=True,
    )
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(path)
    smollm2[1].save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama(tiny_llama_dir):
    """(model, tokenizer) of the tiny random Llama, loaded through load_target like any target."""
    from eagle_train.target import load_target

    return load_target(str(tiny_llama_dir))


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
