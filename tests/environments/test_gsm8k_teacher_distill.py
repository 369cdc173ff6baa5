"""``environments/gsm8k_server_teacher_distill.py`` in ``process`` mode against two real
``atropos-serve-model`` servers (student and teacher, the tiny model with different seeds):
every written group carries ``distill_token_ids``/``distill_logprobs`` of shape
``[seq][len(tokens)][top_k]``, and the trainer turns them into aligned tensors."""

from __future__ import annotations

import asyncio
import json

import pytest

import environments.gsm8k_server_teacher_distill as distill_env
from atroposlib.envs.cli import build_env, parse_cli
from atroposlib.testing.launch import serve_model_cmd
from atroposlib.testing.ports import free_port
from atroposlib.testing.processes import running_process
from example_trainer.data import IGNORE_INDEX, collate, group_to_samples
from tests.environments.env_helpers import process_argv, write_jsonl
from tests.environments.test_process_mode import GSM8K_ROWS

TOP_K = 3


@pytest.fixture(scope="module")
def teacher_server(tiny_model_dir, tmp_path_factory):
    """A second ``atropos-serve-model`` (the teacher) on the tiny model."""
    port = free_port()
    log = tmp_path_factory.mktemp("teacher") / "serve.log"
    cmd = serve_model_cmd(tiny_model_dir, port, "--seed", "1")
    with running_process(
        cmd, health_url=f"http://127.0.0.1:{port}/health", timeout=180, log_path=log
    ):
        yield f"http://127.0.0.1:{port}/v1"


def test_process_mode_writes_groups_with_teacher_top_k(
    serve_model, teacher_server, tmp_path, monkeypatch
):
    # The env's own teacher default, pointed at the test's teacher server.
    monkeypatch.setattr(distill_env, "TEACHER_BASE_URL", teacher_server)
    monkeypatch.setattr(distill_env, "DEFAULT_MODEL", serve_model["model"])
    out = tmp_path / "distill.jsonl"
    data = write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K_ROWS)
    argv = process_argv(
        serve_model,
        out,
        "--env.data_path",
        str(data),
        "--env.max_token_length",
        "16",
        "--env.teacher_top_k",
        str(TOP_K),
    )
    cls = distill_env.GSM8kTeacherDistillEnv
    env = build_env(cls, parse_cli(cls, argv))
    assert env.teacher_server is not None
    asyncio.run(env.process_manager())

    groups = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    assert len(groups) == 2
    for group in groups:
        ids, lps = group["distill_token_ids"], group["distill_logprobs"]
        assert len(ids) == len(lps) == len(group["tokens"]) == 2
        for tokens, id_rows, lp_rows in zip(group["tokens"], ids, lps, strict=True):
            assert len(id_rows) == len(lp_rows) == len(tokens)
            assert all(len(r) == TOP_K for r in id_rows)
            assert all(len(r) == TOP_K for r in lp_rows)
            # Best first, log-probs; the rows past position 0 are real teacher distributions.
            for row in lp_rows[1:]:
                assert all(v <= 0.0 for v in row) and row == sorted(row, reverse=True)
            assert all(len(set(r)) == TOP_K for r in id_rows[1:]), "not a real top-k"
        # The trainer takes the group as is: its rows aligned with the next-token labels.
        mb = collate(group_to_samples(group), pad_to_multiple=8)
        trained = mb.labels != IGNORE_INDEX
        assert torch_equal(mb.distill_mask, trained)
        assert mb.distill_token_ids.shape[-1] == TOP_K


def torch_equal(a, b) -> bool:
    return bool((a == b).all())


def test_the_file_runs_as_a_script_from_another_folder(tmp_path):
    # ``python environments/gsm8k_server_teacher_distill.py ...`` (as the launcher and the
    # README start environments): the ``environments`` package is not importable there, the
    # file's own folder is.
    import subprocess
    import sys
    from pathlib import Path

    script = Path(distill_env.__file__).resolve()
    done = subprocess.run(
        [sys.executable, str(script), "process", "--help"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--env.teacher_top_k" in done.stdout
