"""``atropos-tiny-model OUT_DIR``: the positional form the README shows, beside ``--out``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from atroposlib.tiny_model.__main__ import main as tiny_main


def test_positional_out_dir_builds_there(tmp_path, capsys):
    out = tmp_path / "positional"
    tiny_main([str(out), "--num-hidden-layers", "1"])
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(out)
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 1
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()


def test_positional_and_flag_must_agree(tmp_path, capsys):
    tiny_main([str(tmp_path / "same"), "--out", str(tmp_path / "same"), "--num-hidden-layers", "1"])
    assert (tmp_path / "same" / "config.json").exists()
    with pytest.raises(SystemExit) as exc:
        tiny_main([str(tmp_path / "a"), "--out", str(tmp_path / "b")])
    assert exc.value.code == 2
    assert "two output directories" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_console_script_prints_the_cached_default(tiny_model_dir):
    """``atropos-tiny-model``'s process smoke, in the form the serve-model example uses
    (``atropos-serve-model "$(atropos-tiny-model)"``): with no directory it prints the cached
    default model's path, found without building or importing torch. The positional
    ``OUT_DIR`` form runs in-process in test_positional_out_dir_builds_there."""
    proc = subprocess.run(
        [sys.executable, "-m", "atroposlib.tiny_model"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == str(tiny_model_dir)
    assert (tiny_model_dir / "model.safetensors").exists()
