"""Builders shared by the in-process tests of the rollout store and its parts."""

from __future__ import annotations

import json

from atroposlib.api.models import RegisterEnv, Registration
from atroposlib.api.store import IncomingGroup, RolloutStore

REG = Registration(
    wandb_group="g",
    wandb_project="p",
    batch_size=8,
    max_token_len=64,
    checkpoint_dir="c",
    save_checkpoint_interval=3,
    starting_step=5,
    num_steps=50,
)


class FakeClock:
    """A monotonic clock that moves only when told (``RolloutStore(clock=...)``)."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Move the clock forward."""
        self.now += seconds


def incoming(size: int, env_id=None, tag: int = 0) -> IncomingGroup:
    """A group of ``size`` one-token sequences whose token is ``tag``."""
    return IncomingGroup(
        env_id, size, json.dumps({"tokens": [[tag]] * size, "env_id": env_id}).encode()
    )


def env_request(name: str, **kw) -> RegisterEnv:
    """A ``/register-env`` body with defaults for what the test does not set."""
    return RegisterEnv(
        max_token_length=kw.pop("max_token_length", 100),
        desired_name=name,
        weight=kw.pop("weight", 1.0),
        group_size=kw.pop("group_size", 4),
        **kw,
    )


def started(store: RolloutStore, **envs: dict) -> RolloutStore:
    """``store`` with the trainer registered, started, and ``envs`` registered in order."""
    store.register_trainer(REG)
    store.next_batch()
    for name, kw in envs.items():
        store.register_env(env_request(name, **dict(kw)))
    return store


def tags(batch) -> list[int]:
    """The first token of each group of a served batch (the tag it was posted with)."""
    return [json.loads(b)["tokens"][0][0] for b in batch]
