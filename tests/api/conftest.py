"""Fixtures of the API tests: real ``run-api`` processes on free ports, and payload builders."""

from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path
from typing import Any, ContextManager, Iterator

import httpx
import pytest

from atroposlib.testing.api import running_api
from atroposlib.testing.ports import free_port

TRAINER = {
    "wandb_group": "grp",
    "wandb_project": "proj",
    "batch_size": 8,
    "max_token_len": 512,
    "checkpoint_dir": "ckpts",
    "save_checkpoint_interval": 5,
    "starting_step": 0,
    "num_steps": 100,
}


def group(
    size: int = 4,
    seq_len: int = 3,
    env_id: int | None = None,
    score: float = 1.0,
    base: int = 1,
    **extra: Any,
) -> dict:
    """A consistent ScoredData payload with ``size`` sequences; ``base`` makes token ids distinct."""
    tokens = [[base * 1000 + i * seq_len + j for j in range(seq_len)] for i in range(size)]
    payload = {
        "tokens": tokens,
        "masks": [[-100] + t[1:] for t in tokens],
        "scores": [score] * size,
    }
    if env_id is not None:
        payload["env_id"] = env_id
    payload.update(extra)
    return payload


class Api:
    """A started run-api process and an httpx client bound to it."""

    def __init__(self, base_url: str, headers: dict | None = None, proc: Any = None) -> None:
        self.base_url = base_url
        self.proc = proc
        self.client = httpx.Client(base_url=base_url, timeout=10.0, headers=headers or {})

    def reset(self) -> None:
        assert self.client.get("/reset_data").status_code == 200

    def start_trainer(self, **overrides: Any) -> None:
        """Register a trainer and poll /batch once, so environments may register."""
        r = self.client.post("/register", json={**TRAINER, **overrides})
        assert r.status_code == 200, r.text
        assert self.client.get("/batch").status_code == 200

    def register_env(
        self,
        name: str = "env",
        group_size: int = 4,
        weight: float = 1.0,
        max_token_length: int = 512,
        min_batch_allocation: float | None = None,
    ) -> int:
        r = self.client.post(
            "/register-env",
            json={
                "max_token_length": max_token_length,
                "desired_name": name,
                "weight": weight,
                "group_size": group_size,
                "min_batch_allocation": min_batch_allocation,
            },
        )
        assert r.status_code == 200 and r.json()["status"] == "success", r.text
        return r.json()["env_id"]


def start_api(
    tmp_path: Path, *flags: str, env: dict | None = None, port: int | None = None
) -> tuple[ContextManager[subprocess.Popen], str]:
    """``(context manager running run-api with flags, base URL)``: the port is chosen first,
    so the URL is known before the server starts (see :func:`running_api`)."""
    port = port or free_port()

    @contextlib.contextmanager
    def running() -> Iterator[subprocess.Popen]:
        with running_api(tmp_path / f"api-{port}.log", *flags, env=env, port=port) as api:
            yield api.proc

    return running(), f"http://127.0.0.1:{port}"


@pytest.fixture(scope="session")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    """One in-memory server with small bounds (1 MiB bodies, a 2 MiB queue) per test session,
    shared by the API tests; each resets it first (``fresh``)."""
    log = tmp_path_factory.mktemp("api") / "api.log"
    with running_api(log, "--max-request-mb", "1", "--max-queue-mb", "2") as running:
        a = Api(running.url, proc=running.proc)
        yield a
        a.client.close()


@pytest.fixture
def fresh(api: Api) -> Api:
    """The session's server, reset."""
    api.reset()
    return api
