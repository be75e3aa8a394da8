"""A file cut short (an interrupted copy, a full disk) is reported in one line naming it and the fix, wherever the
toolkit reads it: target weights, head weights (ours and exports), GGUF heads and targets, data files."""

import json
import shutil

import numpy as np
import pytest
from gguf import GGUFWriter

from data_prep.readers import read_conversations
from eagle_train import target as target_mod
from eagle_train.checkpoint import load_draft_head
from eagle_train.export import export_head
from eagle_train.export.gguf import read_gguf_head
from eagle_train.target import load_target


def cut(path):
    """Keep the first half of the file at `path`, as an interrupted copy does."""
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


def assert_names(error, path, what):
    message = str(error.value)
    assert message.startswith(f"{path} ({what}) is unreadable (truncated or damaged: ") and "\n" not in message


def test_truncated_target_weights(tiny_llama_dir, tmp_path):
    shutil.copytree(tiny_llama_dir, tmp_path / "target")
    weights = cut(tmp_path / "target" / "model.safetensors")
    with pytest.raises(ValueError) as e:
        load_target(str(tmp_path / "target"))
    assert_names(e, weights, "target weights")
    assert str(e.value).endswith("re-download or re-convert it")


def test_truncated_head_weights_in_a_head_or_an_export(tiny_head_dir, tiny_llama, tmp_path):
    shutil.copytree(tiny_head_dir, tmp_path / "head")
    export = export_head(load_draft_head(tiny_head_dir), tmp_path / "export", "eagle3")
    for directory in (tmp_path / "head", export):
        weights = cut(directory / "model.safetensors")
        with pytest.raises(ValueError) as e:
            load_draft_head(directory, target_model=tiny_llama[0])
        assert_names(e, weights, "head weights")


def test_a_damaged_head_config_in_a_head_or_an_export(tiny_head_dir, tmp_path):
    from engines import check_directory

    shutil.copytree(tiny_head_dir, tmp_path / "head")
    export = export_head(load_draft_head(tiny_head_dir), tmp_path / "export", "eagle3")
    for directory in (tmp_path / "head", export):
        cut(directory / "config.json")
        with pytest.raises(ValueError) as e:
            load_draft_head(directory)
        assert_names(e, directory / "config.json", "head config")
    with pytest.raises(ValueError) as e:
        check_directory(export)
    assert_names(e, export / "config.json", "head config")


def write_gguf(path, arch):
    w = GGUFWriter(path, arch=arch)
    w.add_block_count(4)
    w.add_tensor("token_embd.weight", np.ones((256, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_truncated_gguf_head_and_gguf_target(tiny_llama, tmp_path, monkeypatch):
    head = cut(write_gguf(tmp_path / "head.gguf", "eagle3"))
    with pytest.raises(ValueError) as e:
        read_gguf_head(head, tiny_llama[0].config)
    assert_names(e, head, "draft head GGUF")
    monkeypatch.setenv("EAGLE_TRAIN_CACHE", str(tmp_path / "cache"))
    target = cut(write_gguf(tmp_path / "target.gguf", "llama"))
    with pytest.raises(ValueError) as e:
        target_mod.resolve_target(str(target))
    assert_names(e, target, "target GGUF")


def test_truncated_parquet_data(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"messages": json.dumps([{"role": "user", "content": "hi"}])}] * 100
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    data = cut(tmp_path / "d.parquet")
    with pytest.raises(ValueError) as e:
        list(read_conversations(str(data)))
    assert_names(e, data, "data")
