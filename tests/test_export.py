"""eagle-export: engine layouts round-trip to the same logits through each engine's loading rules,
--check flags what would break or silently degrade, imports of the documented layout are exact."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import NH, NKV, VD, D, H, I, V, set_random_vocab_map, tiny_head, tiny_target, tiny_target_config
from safetensors.torch import load_file, save_file

from eagle_cli.export import main as cli_main
from eagle_train.checkpoint import load_draft_head
from eagle_train.export import LAYOUTS, export_head
from eagle_train.export.draft_files import DraftFiles
from eagle_train.methods.eagle3.head import Eagle3Head
from eagle_train.target import resolve_target
from eagle_train.train_checkpoint import STATE_FILE
from engines import ENGINES, check_directory
from engines.rules import engine_state, head_from_engine_state, head_shapes


def draft_logits(head, aux, ids, positions):
    """Logits of a 2-step draft (second step reads the first's output) over a causal cache."""
    t = ids.shape[1]
    mask = torch.ones(t, t, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        h, first = head.step(head.fc(aux), ids, positions, mask=mask)
        _, second = head.step(h, ids.roll(-1, 1), positions + 1, mask=mask)
    return torch.cat([first, second], dim=1)


def inputs(seed=1, hidden=H, vocab=V, t=9):
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(1, t, 3 * hidden, generator=g)
    ids = torch.randint(0, vocab, (1, t), generator=g)
    return aux, ids, torch.arange(t)[None] + 500  # far positions: a wrong RoPE base shows


def engine_head(directory, engine, target_embedding, target_config=None):
    files = DraftFiles(directory)
    report = ENGINES[engine].inspect(files, target_config)
    assert report.ok, report.render()
    return head_from_engine_state(report, engine_state(report, files), target_embedding), report


def errors(report):
    return [f.message for f in report.findings if f.severity == "error"]


def rewrite(directory, config_update=None, tensors_update=None, drop=()):
    """Edit an exported directory in place (config keys, tensors) to make a broken one."""
    if config_update:
        path = directory / "config.json"
        config = json.loads(path.read_text())
        config.update(config_update)
        path.write_text(json.dumps(config))
    tensors = load_file(directory / "model.safetensors")
    tensors.update(tensors_update or {})
    save_file({k: v for k, v in tensors.items() if k not in drop}, directory / "model.safetensors")
    return directory


# ---- round trips ----------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["eagle3", "speculators"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_export_reloads_to_the_same_logits_in_every_engine(tmp_path, fmt, dtype):
    head = tiny_head()  # its embedding stands for the target's, which a speculators export ships
    out = export_head(head, tmp_path / fmt, fmt, dtype=dtype, target_embedding=head.embed_tokens.weight)
    stored = load_file(out / "model.safetensors")
    assert stored["d2t"].dtype == torch.int64 and stored["t2d"].dtype == torch.bool
    assert stored["fc.weight"].dtype == (torch.float32 if dtype == "fp32" else torch.bfloat16)
    # The reference: the head with its weights rounded as the file stores them (not the target's embedding).
    reference = tiny_head()
    if dtype == "bf16":
        with torch.no_grad():
            for name, p in reference.named_parameters():
                if not name.startswith("embed_tokens."):
                    p.copy_(p.to(torch.bfloat16).float())
    aux, ids, pos = inputs()
    want = draft_logits(reference, aux, ids, pos)
    for engine in LAYOUTS[fmt].engines:
        loaded, report = engine_head(out, engine, head.embed_tokens.weight, tiny_target_config())
        got = draft_logits(loaded, aux, ids, pos)
        assert torch.equal(got, want), f"{engine}: {(got - want).abs().max()}"
        assert torch.equal(loaded.draft_to_target_ids(torch.arange(VD)), head.draft_to_target_ids(torch.arange(VD)))
        if dtype == "bf16":  # and bf16 rounding is all that separates it from the trained head
            assert (got - draft_logits(head, aux, ids, pos)).abs().max() < 0.05 * want.abs().max()
    assert len(LAYOUTS[fmt].engines) == (3 if fmt == "eagle3" else 1)


def test_engine_state_uses_each_engines_names_fusions_and_vocab_map(tmp_path):
    head = tiny_head()
    out = export_head(head, tmp_path / "e3", "eagle3", dtype="fp32")
    files = DraftFiles(out)
    qkv = ((NH + 2 * NKV) * D, 2 * H)
    vllm = engine_state(ENGINES["vllm"].inspect(files), files)
    assert vllm["model.layers.0.self_attn.qkv_proj.weight"].shape == qkv
    assert vllm["model.layers.0.mlp.gate_up_proj.weight"].shape == (2 * I, H)
    assert torch.equal(vllm["draft_id_to_target_id"], head.d2t)
    sglang = engine_state(ENGINES["sglang"].inspect(files), files)
    assert torch.equal(sglang["hot_token_id"], head.draft_to_target_ids(torch.arange(VD)))
    trt = engine_state(ENGINES["trtllm"].inspect(files), files)
    assert trt["model.d2t"].dtype == torch.int32 and "model.midlayer.self_attn.qkv_proj.weight" in trt
    q, k = head.midlayer.self_attn.q_proj.weight, head.midlayer.self_attn.k_proj.weight
    assert torch.equal(trt["model.midlayer.self_attn.qkv_proj.weight"][NH * D : NH * D + NKV * D], k)
    assert torch.equal(sglang["model.midlayer.self_attn.qkv_proj.weight"][: NH * D], q)


def test_smollm2_head_round_trips_through_every_engine(tmp_path, smollm2):
    from eagle_train.hidden_states import target_hidden_states

    model, tokenizer = smollm2
    torch.manual_seed(0)
    head = Eagle3Head.from_target(model, draft_vocab_size=2048, target="smollm2-135m")
    set_random_vocab_map(head)
    ids = tokenizer("The quick brown fox jumps over the lazy dog", return_tensors="pt").input_ids
    aux, _ = target_hidden_states(model, ids)
    pos = torch.arange(ids.shape[1])[None] + 300
    want = draft_logits(head, aux, ids, pos)
    for fmt in ("eagle3", "speculators"):
        out = export_head(head, tmp_path / fmt, fmt, dtype="fp32", data="sharegpt", steps=10)
        config = json.loads((out / "config.json").read_text())
        llama = config.get("transformer_layer_config", config)
        assert llama["rope_theta"] == 100000.0 and llama["max_position_embeddings"] == 8192
        assert llama["tie_word_embeddings"] is False and config["draft_vocab_size"] == 2048
        assert "target_hidden_size" not in config and "eagle_config" not in config
        if fmt == "speculators":  # speculators and vLLM load the target by this name: here, the alias's directory
            local = str(Path(resolve_target("smollm2-135m")).resolve())
            assert config["speculators_config"]["verifier"]["name_or_path"] == local
            assert config["eagle_train"]["verifier_hub_id"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
            assert torch.equal(
                load_file(out / "model.safetensors")["embed_tokens.weight"], model.model.embed_tokens.weight
            )
        reports = check_directory(out, None, model.config)
        assert all(r.ok for r in reports.values()), "\n".join(r.render() for r in reports.values())
        for engine in reports:
            loaded, _ = engine_head(out, engine, model.get_input_embeddings().weight, model.config)
            assert torch.equal(draft_logits(loaded, aux, ids, pos), want), engine
        imported = load_draft_head(out, model)
        assert torch.equal(draft_logits(imported, aux, ids, pos), want)


# ---- --check: each problem on its own -------------------------------------------------------------


@pytest.fixture
def exported(tmp_path):
    return export_head(tiny_head(), tmp_path / "good", "eagle3", dtype="bf16")


def test_check_passes_a_fresh_export_and_names_what_each_engine_loads(exported):
    reports = check_directory(exported, ["vllm", "sglang", "trtllm"], tiny_target_config())
    assert all(r.ok for r in reports.values())
    assert reports["vllm"].loads["model.layers.0.self_attn.qkv_proj.weight"] == [
        "midlayer.self_attn.q_proj.weight",
        "midlayer.self_attn.k_proj.weight",
        "midlayer.self_attn.v_proj.weight",
    ]
    assert reports["sglang"].loads["hot_token_id"] == ["d2t"]
    assert all("the target's embedding" in " ".join(r.filled) for r in reports.values())
    assert all(r.context_length == 1024 and r.aux_layers == (2, 4, 5) for r in reports.values())


def test_check_flags_missing_d2t(exported):
    rewrite(exported, drop=("d2t",))
    reports = check_directory(exported, ["vllm", "sglang", "trtllm"], tiny_target_config())
    for r in reports.values():
        assert any("no d2t with a reduced draft vocabulary" in m for m in errors(r)), r.render()
    assert cli_exit(["--check", str(exported), "--engine", "vllm"]) == 1


def test_check_refuses_an_export_with_non_finite_weights(exported):
    """An export written before heads were checked, or edited since: it loads in every engine and drafts garbage."""
    weight = load_file(exported / "model.safetensors")["fc.weight"].clone()
    weight[0, 0] = float("nan")
    rewrite(exported, tensors_update={"fc.weight": weight})
    for r in check_directory(exported, ["vllm", "sglang", "trtllm"], tiny_target_config()).values():
        assert any("non-finite values (nan in fc.weight)" in m for m in errors(r)), r.render()
    assert cli_exit(["--check", str(exported), "--engine", "vllm"]) == 1


def test_check_flags_float_d2t_and_only_warns_on_int32(exported):
    d2t = load_file(exported / "model.safetensors")["d2t"]
    rewrite(exported, tensors_update={"d2t": d2t.to(torch.bfloat16)})
    for r in check_directory(exported, ["vllm", "sglang", "trtllm"]).values():
        assert any("d2t is torch.bfloat16, not int64" in m for m in errors(r))
    rewrite(exported, tensors_update={"d2t": d2t.to(torch.int32)})
    for r in check_directory(exported, ["vllm", "sglang", "trtllm"]).values():
        assert r.ok and any("d2t is torch.int32" in f.message for f in r.findings if f.severity == "warning")


def test_check_flags_a_too_short_max_position_embeddings(exported):
    rewrite(exported, config_update={"max_position_embeddings": 128})
    reports = check_directory(exported, ["vllm", "sglang", "trtllm"], tiny_target_config(max_position_embeddings=4096))
    for r in reports.values():
        assert any("max_position_embeddings 128 < the target's 4096" in m for m in errors(r)), r.render()
        assert r.context_length == 128


def test_check_reports_explicit_aux_ids_as_each_engine_reads_them(tmp_path):
    out = export_head(tiny_head(aux_layer_ids=(1, 3, 6)), tmp_path / "aux", "eagle3", dtype="bf16")
    config = json.loads((out / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 3, 6]  # vLLM: HF indices
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 5]  # SGLang adds one
    reports = check_directory(out, None, tiny_target_config())
    assert reports["vllm"].ok and reports["vllm"].aux_layers == (1, 3, 6)
    assert reports["sglang"].ok and reports["sglang"].aux_layers == (1, 3, 6)
    assert reports["trtllm"].aux_layers == (2, 4, 5)  # TensorRT-LLM never reads them from config.json
    assert any("eagle3_layers_to_capture: [0, 2, 5]" in m for m in errors(reports["trtllm"]))
    # A config stating the ids only in vLLM's key (as a naive exporter writes): SGLang captures defaults.
    config.pop("eagle_config")
    config.pop("eagle_train")
    (out / "config.json").write_text(json.dumps(config))
    sglang = check_directory(out, ["sglang"], tiny_target_config())["sglang"]
    assert sglang.aux_layers == (2, 4, 5) and any("trained on [1, 3, 6]" in m for m in errors(sglang))


def test_default_aux_ids_are_left_out_of_the_eagle3_config(exported):
    config = json.loads((exported / "config.json").read_text())
    assert "eagle_aux_hidden_state_layer_ids" not in config and "eagle_config" not in config


def test_a_head_for_a_shallow_target_states_its_distinct_aux_ids_and_engines_capture_them(tmp_path):
    """Below 7 layers the engines' unasked (2, N//2, N-3) repeats a layer; our default does not, so the
    export names it and vLLM and SGLang capture what the head was trained on."""
    head = tiny_head(target_model=tiny_target(num_hidden_layers=4), draft_vocab_size=VD)
    assert head.config.aux_layer_ids == (1, 2, 3)
    out = export_head(head, tmp_path / "shallow", "eagle3", dtype="bf16")
    config = json.loads((out / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    reports = check_directory(out, None, tiny_target_config(num_hidden_layers=4))
    for engine in ("vllm", "sglang"):
        assert reports[engine].ok and reports[engine].aux_layers == (1, 2, 3), reports[engine].render()
    assert any("eagle3_layers_to_capture: [0, 1, 2]" in m for m in errors(reports["trtllm"]))


def test_check_flags_a_peagle_export_without_mask_hidden(tmp_path):
    """A P-EAGLE directory laid out by hand as docs/design.md section 7 describes it (eagle3 config + the
    mask token ids, midlayer.* then layers.1.*, own embed_tokens, mask_hidden), from a PEagleHead."""
    head = tiny_head("peagle", mask_token_id=7, num_depths=3)
    cfg = head.config
    tensors = {k: v.contiguous() for k, v in head.saved_state_dict().items()}
    assert {k: tuple(v.shape) for k, v in tensors.items()} == head_shapes(cfg, parallel=True)
    config = LAYOUTS["eagle3"].write_config(cfg, torch.float32, {})
    config.update(ptd_token_id=7, pard_token=7, mask_token_id=7)
    directory = tmp_path / "peagle"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    save_file(tensors, directory / "model.safetensors")

    good = check_directory(directory, None, tiny_target_config())["vllm"]  # P-EAGLE: vLLM only
    assert good.ok and good.parallel, good.render()
    assert good.loads["model.layers.1.self_attn.qkv_proj.weight"][0] == "layers.1.self_attn.q_proj.weight"
    assert good.loads["model.embed_tokens.weight"] == ["embed_tokens.weight"]
    files = DraftFiles(directory)
    loaded = head_from_engine_state(good, engine_state(good, files))
    aux, ids, pos = inputs()
    is_mask = torch.tensor([[False] * 6 + [True] * 3])
    mask = torch.ones(9, 9, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        assert torch.equal(loaded(aux, is_mask, ids, pos, mask), head(aux, is_mask, ids, pos, mask))

    rewrite(directory, drop=("mask_hidden",))
    bad = check_directory(directory, ["vllm"], tiny_target_config())["vllm"]
    assert any("without mask_hidden" in m for m in errors(bad)), bad.render()
    sglang = check_directory(directory, ["sglang"], tiny_target_config())["sglang"]
    assert any("P-EAGLE" in m for m in errors(sglang))


def test_check_flags_a_speculators_peagle_config_without_mask_token_id(tmp_path):
    out = export_head(
        tiny_head("peagle", mask_token_id=7, num_depths=3), tmp_path / "spec", "speculators", dtype="bf16"
    )
    assert check_directory(out, None, tiny_target_config())["vllm"].ok
    config = json.loads((out / "config.json").read_text())
    config.pop("mask_token_id")
    (out / "config.json").write_text(json.dumps(config))
    vllm = check_directory(out, None, tiny_target_config())["vllm"]
    assert any("needs it (it becomes pard_token)" in m for m in errors(vllm)), vllm.render()


def test_check_flags_a_config_whose_hidden_size_disagrees_with_the_weights(exported):
    rewrite(exported, config_update={"hidden_size": 48})
    for r in check_directory(exported, ["vllm", "sglang", "trtllm"]).values():
        assert any("fc.weight has shape [32, 96] but config.json implies [48, 144]" in m for m in errors(r)), r.render()


def test_check_flags_what_engines_assume_for_absent_keys(exported):
    config = json.loads((exported / "config.json").read_text())
    for key in ("rope_theta", "draft_vocab_size"):
        config.pop(key)
    (exported / "config.json").write_text(json.dumps(config))
    reports = check_directory(exported, ["vllm", "sglang"], tiny_target_config())
    assert any("no rope_theta" in m for m in errors(reports["vllm"]))
    assert any("RoPE as vLLM reads it (rope_theta 10000.0" in m for m in errors(reports["vllm"]))
    assert any("load_lm_head_from_target" in m for m in errors(reports["sglang"]))


def test_sglang_silently_skips_speculators_style_names(exported):
    tensors = load_file(exported / "model.safetensors")
    renamed = {k.replace("midlayer.", "layers.0."): v for k, v in tensors.items()}
    save_file(renamed, exported / "model.safetensors")
    reports = check_directory(exported, ["vllm", "sglang", "trtllm"])
    assert reports["vllm"].ok and reports["trtllm"].ok  # both rename layers.0. themselves
    assert any("random initialisation" in m for m in errors(reports["sglang"]))


def test_speculators_config_states_norm_before_residual(tmp_path):
    head = tiny_head()
    out = export_head(
        head, tmp_path / "spec", "speculators", dtype="bf16", speculative_tokens=5, target_embedding=torch.ones(V, H)
    )
    config = json.loads((out / "config.json").read_text())
    assert config["norm_before_residual"] is False
    assert config["speculators_config"]["proposal_methods"] == [{"proposal_type": "greedy", "speculative_tokens": 5}]
    assert config["speculators_config"]["verifier"] == {
        "name_or_path": "tiny-target",
        "architectures": ["LlamaForCausalLM"],
    }
    config.pop("norm_before_residual")
    config["speculators_config"]["verifier"]["name_or_path"] = "smollm2-135m"
    (out / "config.json").write_text(json.dumps(config))
    vllm = check_directory(out)["vllm"]
    assert any("norm_before_residual unset" in m for m in errors(vllm))
    assert any("cannot load the target" in m for m in errors(vllm))
    assert any("does not read the speculators layout" in m for m in errors(check_directory(out, ["sglang"])["sglang"]))


# ---- import ---------------------------------------------------------------------------------------


def reference_layout_dir(directory):
    """An EAGLE-3 directory written from docs/design.md sections 4 and 6 by hand, not by our exporter."""
    torch.manual_seed(3)
    names = {
        "fc.weight": (H, 3 * H),
        "midlayer.input_layernorm.weight": (H,),
        "midlayer.hidden_norm.weight": (H,),
        "midlayer.self_attn.q_proj.weight": (NH * D, 2 * H),
        "midlayer.self_attn.k_proj.weight": (NKV * D, 2 * H),
        "midlayer.self_attn.v_proj.weight": (NKV * D, 2 * H),
        "midlayer.self_attn.o_proj.weight": (H, NH * D),
        "midlayer.post_attention_layernorm.weight": (H,),
        "midlayer.mlp.gate_proj.weight": (I, H),
        "midlayer.mlp.up_proj.weight": (I, H),
        "midlayer.mlp.down_proj.weight": (H, I),
        "norm.weight": (H,),
        "lm_head.weight": (VD, H),
    }
    tensors = {k: torch.randn(shape) for k, shape in names.items()}
    ids = torch.tensor(sorted(set(range(V)) - {3, 7, 11, 19, 23, 29, 31, 37, 41, 47}))  # VD target ids
    tensors["d2t"] = ids - torch.arange(VD)
    tensors["t2d"] = torch.zeros(V, dtype=torch.bool)
    tensors["t2d"][ids] = True
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": H,
        "num_attention_heads": NH,
        "num_key_value_heads": NKV,
        "head_dim": D,
        "intermediate_size": I,
        "vocab_size": V,
        "draft_vocab_size": VD,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "rope_scaling": None,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    save_file(tensors, directory / "model.safetensors")
    return tensors, config


def test_import_of_the_reference_layout_then_export_gives_identical_tensors(tmp_path):

    tensors, config = reference_layout_dir(tmp_path / "ref")
    with pytest.raises(ValueError, match="pass the target"):
        load_draft_head(tmp_path / "ref")  # no aux ids and no target: the defaults are unknown
    head = load_draft_head(tmp_path / "ref", target_config=tiny_target_config())
    assert head.config.aux_layer_ids == (2, 4, 5) and head.config.rope_theta == 100000.0
    again = export_head(head, tmp_path / "again", "eagle3", dtype="fp32")
    out = load_file(again / "model.safetensors")
    assert set(out) == set(tensors)
    assert all(torch.equal(out[k], tensors[k]) and out[k].dtype == tensors[k].dtype for k in tensors)
    written = json.loads((again / "config.json").read_text())
    assert all(written[k] == v for k, v in config.items())
    ckpt = tmp_path / "ckpt"
    load_draft_head(tmp_path / "ref", target_config=tiny_target_config()).save_pretrained(ckpt / "head")
    reloaded = load_draft_head(ckpt)
    assert all(torch.equal(reloaded.state_dict()[k], v) for k, v in head.saved_state_dict().items())
    assert isinstance(load_draft_head(tmp_path / "again"), Eagle3Head)  # engine dirs load directly too


def test_the_reference_layout_as_pytorch_model_bin_imports_as_the_same_head(tmp_path):
    """The EAGLE repo publishes its heads' weights as pytorch_model.bin: read as its safetensors twin is."""
    tensors, _ = reference_layout_dir(tmp_path / "ref")
    twin = load_draft_head(tmp_path / "ref", target_config=tiny_target_config())
    (tmp_path / "ref" / "model.safetensors").unlink()
    torch.save(tensors, tmp_path / "ref" / "pytorch_model.bin")
    head = load_draft_head(tmp_path / "ref", target_config=tiny_target_config())
    assert head.saved_state_dict().keys() == twin.saved_state_dict().keys()
    assert all(torch.equal(t, twin.saved_state_dict()[k]) for k, t in head.saved_state_dict().items())


def test_a_head_with_its_own_embedding_keeps_it_through_import_checkpoint_and_export(tmp_path):
    """Another trainer's EAGLE-3 head may carry an embedding of its own: it must never be swapped
    for the target's on the way through."""

    tensors, config = reference_layout_dir(tmp_path / "ref")
    own = torch.randn(V, H)
    save_file({**tensors, "embed_tokens.weight": own}, tmp_path / "ref" / "model.safetensors")
    target_embedding = torch.nn.Embedding(V, H)
    target_model = SimpleNamespace(config=tiny_target_config(), get_input_embeddings=lambda: target_embedding)
    head = load_draft_head(tmp_path / "ref", target_model)
    assert torch.equal(head.embed_tokens.weight, own)
    ckpt = tmp_path / "ckpt"
    load_draft_head(tmp_path / "ref", target_config=tiny_target_config()).save_pretrained(ckpt / "head")
    for loaded in (load_draft_head(ckpt, target_model), head):
        assert torch.equal(loaded.embed_tokens.weight, own)
        out = load_file(export_head(loaded, tmp_path / "again", "eagle3", dtype="fp32") / "model.safetensors")
        assert torch.equal(out["embed_tokens.weight"], own)
    shared = load_draft_head(export_head(tiny_head(), tmp_path / "shared", "eagle3", dtype="fp32"), target_model)
    assert torch.equal(shared.embed_tokens.weight, target_embedding.weight)
    assert "embed_tokens.weight" not in shared.saved_state_dict()


def test_import_without_d2t_is_identity_for_a_full_vocabulary_and_refused_for_a_reduced_one(tmp_path):
    tensors, config = reference_layout_dir(tmp_path / "ref")
    save_file({k: v for k, v in tensors.items() if k not in ("d2t", "t2d")}, tmp_path / "ref" / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing tensors \['d2t'\]"):
        load_draft_head(tmp_path / "ref", target_config=tiny_target_config())
    (tmp_path / "ref" / "config.json").write_text(json.dumps({**config, "vocab_size": VD}))
    head = load_draft_head(tmp_path / "ref", target_config=tiny_target_config())
    assert torch.equal(head.draft_to_target_ids(torch.arange(VD)), torch.arange(VD)) and bool(head.t2d.all())


def test_import_refuses_a_config_that_disagrees_with_the_weights(tmp_path):
    reference_layout_dir(tmp_path / "ref")
    path = tmp_path / "ref" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "intermediate_size": 96}))
    with pytest.raises(ValueError, match="config.json and the weights disagree"):
        load_draft_head(tmp_path / "ref", target_config=tiny_target_config())


# ---- export refusals and the command line -------------------------------------------------------


def test_export_refuses_bad_requests_before_writing(tmp_path):
    head = tiny_head()
    with pytest.raises(ValueError, match="unknown export format"):
        export_head(head, tmp_path / "x", "onnx")
    with pytest.raises(ValueError, match="unknown export dtype"):
        export_head(head, tmp_path / "x", "eagle3", dtype="int8")
    head.t2d[0] = not head.t2d[0]
    with pytest.raises(ValueError, match="t2d does not mark exactly"):
        export_head(head, tmp_path / "x", "eagle3")
    assert not (tmp_path / "x").exists()


def cli_exit(argv) -> int:
    with pytest.raises(SystemExit) as e:
        cli_main(argv)
    return e.value.code


def test_cli_exports_a_training_checkpoint_with_a_model_card(tmp_path, capsys):
    checkpoint = tmp_path / "run" / "checkpoint-1200"
    tiny_head().save_pretrained(checkpoint / "head")
    (checkpoint / STATE_FILE).write_text(json.dumps({"step": 1200, "config": {"data_path": "sharegpt"}}))
    results = tmp_path / "eval.json"
    results.write_text(
        json.dumps(
            {  # the shape eagle-eval writes
                "bench": "mt_bench",
                "drafting": {"depth": 3, "topk": 1, "total": 3, "chain": True},
                "sampling": {"temperature": 0.0},
                "device": "cuda",
                "dtype": "bfloat16",
                "summary": {"acceptance_length": 3.21, "acceptance_per_position": [0.8, 0.6, 0.4], "speedup": 1.9},
            }
        )
    )
    out = tmp_path / "exported"
    tiny_target().save_pretrained(tmp_path / "target")  # the target whose embedding a speculators export ships
    code = cli_exit(
        [
            str(tmp_path / "run" / "checkpoint-1200"),
            "--target",
            str(tmp_path / "target"),
            "--format",
            "speculators",
            "--out",
            str(out),
            "--dtype",
            "bf16",
            "--eval-results",
            str(results),
        ]
    )
    assert code == 0, capsys.readouterr().out
    card = (out / "README.md").read_text()
    assert "acceptance length **3.21** (mt_bench, chain K=3, temperature 0.0, cuda bfloat16)" in card
    assert "0.80, 0.60, 0.40" in card and "1.90x" in card
    assert "training steps: 1200" in card and "training data: sharegpt" in card
    assert "vllm serve" in card
    assert cli_exit(["--import", str(out), "--out", str(tmp_path / "ckpt")]) == 0
    assert (tmp_path / "ckpt" / "head" / "config.json").exists()
    assert cli_exit(["--check", str(out)]) == 0
    assert "all engines OK" in capsys.readouterr().out
    assert cli_exit(["--check", str(tmp_path / "nowhere")]) == 2


def test_runtime_drafts_the_same_from_the_export_as_from_the_training_checkpoint(tmp_path):
    """load_draft_head on an fp32 export gives the runtime the checkpoint's head: same tokens and the
    same accepted drafts at every step. The draft vocabulary is the target's 4 likeliest tokens on this
    prompt, so drafts from the head's random weights are often accepted."""
    from collections import Counter

    from inference.drafting import TreeShape
    from inference.generate import Runtime

    model = tiny_target(vocab_size=16, num_hidden_layers=5, max_position_embeddings=256, rope_theta=10000.0)
    prompt = [1, 5, 9, 3]
    plain = Runtime(model, cuda_graphs=False).generate_plain(prompt, 16).output_ids
    vocab = sorted(t for t, _ in Counter(plain + list(range(16))).most_common(4))
    torch.manual_seed(20)  # a head whose drafts are accepted 0, 1 or 3 at a time on this prompt
    head = Eagle3Head.from_target(model, draft_vocab_size=4)
    for name, p in head.named_parameters():
        if not name.startswith("embed_tokens."):
            torch.nn.init.normal_(p, std=0.2)
    t2d = torch.zeros(16, dtype=torch.bool)
    t2d[vocab] = True
    head.set_vocab_map(torch.tensor(vocab) - torch.arange(4), t2d)
    head.save_pretrained(tmp_path / "checkpoint-7" / "head")
    for fmt in ("eagle3", "speculators"):
        export_head(head, tmp_path / fmt, fmt, dtype="fp32")
    runs = {
        name: Runtime(model, load_draft_head(tmp_path / name, model), TreeShape.chain(3), cuda_graphs=False).generate(
            prompt, 16
        )
        for name in ("checkpoint-7", "eagle3", "speculators")
    }
    reference = runs.pop("checkpoint-7")
    assert reference.output_ids == plain and sum(reference.accepted) >= 5 and 0 in reference.accepted
    for name, run in runs.items():
        assert run.output_ids == reference.output_ids and run.accepted == reference.accepted, name


def test_an_export_for_vllm_is_judged_by_vllm_alone(tmp_path, capsys):
    """Custom aux layers: vLLM reads them from config.json, TensorRT-LLM cannot. With no engine named the
    export checks (and fails on) every engine its layout is for; with --engine vllm, vLLM decides."""
    tiny_head(aux_layer_ids=(1, 3, 6)).save_pretrained(tmp_path / "head")
    export = [str(tmp_path / "head"), "--format", "eagle3", "--dtype", "fp32"]
    assert cli_exit([*export, "--out", str(tmp_path / "all")]) == 1
    out = capsys.readouterr().out
    assert "eagle3_layers_to_capture: [0, 2, 5]" in out
    assert "problems for: trtllm; OK for vllm, sglang (--engine NAME judges only that one)" in out
    assert cli_exit([*export, "--out", str(tmp_path / "vllm"), "--engine", "vllm"]) == 0
    out = capsys.readouterr().out
    assert "all engines OK" in out and "TensorRT-LLM" not in out
    assert cli_exit([*export, "--out", str(tmp_path / "trt"), "--engine", "trtllm"]) == 1
    assert cli_exit([*export, "--out", str(tmp_path / "x"), "--engine", "llamacpp"]) == 2  # not a directory engine
    assert not (tmp_path / "x").exists()


def test_a_head_with_non_finite_values_is_refused_by_export_in_one_line(tmp_path, capsys):
    """A diverged head (nan or inf anywhere) loads nowhere: export exits 2 naming the file and the tensors."""
    head = tiny_head()
    with torch.no_grad():
        head.midlayer.self_attn.q_proj.weight[0, 0] = float("nan")
        head.fc.weight[1, 1] = float("inf")
    head.save_pretrained(tmp_path / "head")
    assert cli_exit([str(tmp_path / "head"), "--format", "eagle3", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert f"{tmp_path / 'head'} holds non-finite values (" in err and "do not deploy it" in err
    assert "nan in midlayer.self_attn.q_proj.weight" in err and "inf in fc.weight" in err
    assert not (tmp_path / "out").exists()


def test_a_speculators_export_names_a_verifier_this_machine_loads(tmp_path, capsys):
    """speculators' loader and `vllm serve DIR` load the target by the verifier entry: --target's local directory as
    an absolute path, a hub id as it is (with a line saying how to load it offline), --verifier as given; the
    export's output says what the entry holds, and vLLM's rules warn of a directory this machine lacks."""
    from eagle_train.export.layouts import verifier_notice

    tiny_target().save_pretrained(tmp_path / "target")
    tiny_head().save_pretrained(tmp_path / "head")
    out = tmp_path / "spec"
    args = [str(tmp_path / "head"), "--format", "speculators", "--out", str(out), "--target", str(tmp_path / "target")]
    assert cli_exit(args) == 0
    said = capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == str((tmp_path / "target").resolve())
    assert "verifier_hub_id" not in config["eagle_train"]
    assert f"verifier: {(tmp_path / 'target').resolve()} (a local directory" in said
    assert "re-export with --verifier with the target's path there" in said
    assert cli_exit([*args, "--verifier", "org/served-target"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == "org/served-target"
    assert "offline, re-export with --verifier DIR" in capsys.readouterr().out

    hub = export_head(
        tiny_head(target="org/target"), tmp_path / "hub", "speculators", target_embedding=torch.ones(V, H)
    )
    config = json.loads((hub / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == "org/target"
    assert "offline, re-export with --verifier DIR" in verifier_notice(config)

    rewrite(out, {"speculators_config": {**config["speculators_config"], "verifier": {"name_or_path": "/nowhere"}}})
    report = check_directory(out, ["vllm"])["vllm"]
    assert any("/nowhere, which holds no model on this machine" in f.message for f in report.findings)
