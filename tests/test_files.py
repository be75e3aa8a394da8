"""Files the toolkit writes are shareable (the umask's mode, not safetensors' owner-only 0600) and atomic."""

import json
import os
import stat

import pytest
from conftest import tiny_head, tiny_target

from eagle_train import files
from eagle_train.export import export_head
from eagle_train.files import FILE_MODE, share_directory, write_json
from eagle_train.store import write_vocab_map
from eagle_train.train_checkpoint import STATE_FILE


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_heads_exports_and_vocab_maps_get_the_mode_a_new_file_gets(tmp_path):
    umask = os.umask(0)
    os.umask(umask)
    assert FILE_MODE == 0o666 & ~umask
    head = tiny_head()
    head.save_pretrained(tmp_path / "head")
    export_head(head, tmp_path / "export", "eagle3")
    write_vocab_map(tmp_path, head.d2t, head.t2d, head.t2d.long())
    written = [*(tmp_path / "head").iterdir(), *(tmp_path / "export").iterdir(), tmp_path / "vocab_map.safetensors"]
    assert {p.name for p in written} >= {"model.safetensors", "config.json", "README.md", "vocab_map.safetensors"}
    assert {p.name: mode(p) for p in written} == {p.name: FILE_MODE for p in written}
    assert not list(tmp_path.rglob(".tmp-*"))


def test_a_directory_transformers_wrote_is_made_shareable(tmp_path):
    """What the target cache does after save_pretrained, whose safetensors file recent safetensors versions write
    owner-only (0.4.3, the floor, does not: the files are made owner-only here to stand for them)."""
    tiny_target().save_pretrained(tmp_path / "target")
    for path in (tmp_path / "target").iterdir():
        os.chmod(path, 0o600)
    share_directory(tmp_path / "target")
    assert {mode(p) for p in (tmp_path / "target").iterdir()} == {FILE_MODE}


def test_a_json_write_that_fails_leaves_the_previous_file_whole(tmp_path, monkeypatch):
    state = tmp_path / STATE_FILE
    write_json(state, {"step": 1})

    def killed(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(files.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        write_json(state, {"step": 2, "config": {"big": "x" * 100_000}})
    assert json.loads(state.read_text()) == {"step": 1}
