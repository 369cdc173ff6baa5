"""Start-up mistakes answered in one line naming the fix, before anything loads: an empty or
missing model for ``atropos-serve-model``, and a port already taken for ``run-api``,
``atropos-serve-model`` and ``atropos-grpo-run`` (which names a free port)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from typing import Iterator

import pytest

from atroposlib.utils.model_check import model_problem
from atroposlib.utils.ports import busy_port_message, next_free_port, port_in_use
from example_trainer.launch.launcher import busy_ports
from example_trainer.launch.run_config import RunConfig


@pytest.fixture
def taken() -> Iterator[int]:
    """A port something listens on (as another user's server would)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def _run(module: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )


def _one_line(r: subprocess.CompletedProcess, prog: str) -> str:
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), r.stderr
    return lines[0]


@pytest.mark.parametrize(
    "model, needle",
    [
        ("", 'MODEL is empty: give a local model directory or a Hugging Face hub name (an unset shell variable, such as "$MODEL"'),
        ("./no-such-model", "MODEL ./no-such-model: no such directory"),
    ],
)  # fmt: skip
def test_serve_model_refuses_an_empty_or_missing_model_in_one_line(model, needle):
    line = _one_line(_run("atroposlib.cli.serve_model", model), "atropos-serve-model")
    assert needle in line


def test_serve_model_refuses_a_busy_port_before_loading(taken, tiny_model_dir):
    r = _run("atroposlib.cli.serve_model", str(tiny_model_dir), "--port", str(taken))
    line = _one_line(r, "atropos-serve-model")
    assert f"port {taken} on 127.0.0.1 is in use" in line and "pass --port " in line
    assert "KV cache" not in r.stderr  # nothing was loaded


def test_run_api_refuses_a_busy_port(taken):
    line = _one_line(_run("atroposlib.cli.run_api", "--port", str(taken)), "run-api")
    assert f"port {taken} on 127.0.0.1 is in use" in line and "pass --port " in line


def test_grpo_run_names_the_flag_and_a_free_port(taken):
    problems = busy_ports(RunConfig(api_port=taken, inference_port=0))
    assert len(problems) == 1
    assert f"port {taken} on 127.0.0.1 is in use" in problems[0]
    suggested = int(problems[0].split("pass --api-port ")[1].split()[0])
    assert suggested > taken and not port_in_use("127.0.0.1", suggested)
    assert "or --api-port 0 (any free port)" in problems[0]
    assert busy_ports(RunConfig(api_port=0, inference_port=taken))[0].count("--inference-port") == 2
    # A node that only trains starts neither service.
    assert busy_ports(RunConfig(api_port=taken, nnodes=2, node_rank=1, rdzv_endpoint="n0:1")) == []


def test_port_helpers(taken):
    assert port_in_use("127.0.0.1", taken)
    assert not port_in_use("127.0.0.1", 0)
    assert next_free_port("127.0.0.1", taken) != taken
    assert busy_port_message("127.0.0.1", 0, "--port") is None


def test_model_problem_answers_without_loading(tiny_model_dir):
    assert model_problem(str(tiny_model_dir)) is None
    assert model_problem("  ", what="MODEL").startswith("MODEL is empty")
    assert model_problem("/no/such/dir") == "--model-name /no/such/dir: no such directory"
