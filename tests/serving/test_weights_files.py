"""Every file a weight update reads must resolve inside ``--weights-root`` (403 otherwise).

Before, only the directory was resolved: a checkpoint directory inside the root whose
``model.safetensors`` is a symlink to a file elsewhere was loaded.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import httpx
import pytest

from atroposlib.http.openai_protocol import Forbidden
from atroposlib.serving.loader import confine_weights_path
from tests.serving.support import AUTH


def _checkpoint(root: Path, name: str = "step_1") -> Path:
    ckpt = root / name
    ckpt.mkdir(parents=True)
    (ckpt / "config.json").write_text("{}")
    return ckpt


def test_a_weights_file_linked_outside_the_root_is_403(tmp_path):
    root, outside = tmp_path / "ckpts", tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "model.safetensors").write_bytes(b"x")
    ckpt = _checkpoint(root)
    (ckpt / "model.safetensors").symlink_to(outside / "model.safetensors")
    with pytest.raises(Forbidden) as info:
        confine_weights_path(str(ckpt), [os.path.realpath(root)])
    assert info.value.status == 403 and info.value.param == "path"
    assert "model.safetensors" in info.value.message


def test_a_shard_named_outside_the_root_by_the_index_is_403(tmp_path):
    root = tmp_path / "ckpts"
    ckpt = _checkpoint(root)
    index = {"weight_map": {"w": "../../elsewhere/shard.safetensors"}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(Forbidden):
        confine_weights_path(str(ckpt), [os.path.realpath(root)])


def test_links_that_stay_inside_the_root_are_fine(tmp_path):
    root = tmp_path / "ckpts"
    first, second = _checkpoint(root, "step_1"), _checkpoint(root, "step_2")
    (first / "model.safetensors").write_bytes(b"x")
    (second / "model.safetensors").symlink_to(first / "model.safetensors")
    assert confine_weights_path(str(second), [os.path.realpath(root)]) == os.path.realpath(second)


def test_update_weights_refuses_a_symlinked_weights_file(keyed, tiny_model_dir, tmp_path_factory):
    # The keyed server's --weights-root is pytest's base temp directory; the file lies outside.
    outside = Path(tempfile.mkdtemp(prefix="weights-outside-"))
    try:
        shutil.copy(Path(tiny_model_dir) / "model.safetensors", outside / "model.safetensors")
        ckpt = tmp_path_factory.mktemp("roots") / "linked"
        shutil.copytree(tiny_model_dir, ckpt, ignore=shutil.ignore_patterns("model.safetensors"))
        (ckpt / "model.safetensors").symlink_to(outside / "model.safetensors")
        r = httpx.post(
            f"{keyed}/update_weights", json={"path": str(ckpt)}, headers=AUTH, timeout=120
        )
        assert r.status_code == 403, r.text
        assert r.json()["error"]["param"] == "path"
    finally:
        shutil.rmtree(outside)
