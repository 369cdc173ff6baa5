"""``FakeTrainer.drain`` ends when the API has no full batch left, not after a fixed time.

The pulls are replaced by a scripted queue and the clock by a fake one, so "a loaded machine
where each pull takes a second" is simulated without waiting for it.
"""

from __future__ import annotations

import types

import httpx
import pytest

from atroposlib.testing import trainer as trainer_module
from atroposlib.testing.trainer import FakeTrainer


class FakeClock:
    """``time.monotonic``/``time.sleep`` stand-ins: sleeping advances the clock."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(
        trainer_module, "time", types.SimpleNamespace(monotonic=fake.monotonic, sleep=fake.sleep)
    )
    return fake


def scripted_trainer(clock: FakeClock, answers: list, seconds_per_pull: float) -> FakeTrainer:
    """A trainer whose pulls take ``seconds_per_pull`` and answer from ``answers`` in order
    (True: a batch, False: no full batch, an exception: raised); afterwards always False."""
    trainer = FakeTrainer(api_port=1, batch_size=4, num_steps=10)
    calls = []

    def pull_once() -> bool:
        clock.now += seconds_per_pull
        calls.append(clock.now)
        answer = answers.pop(0) if answers else False
        if isinstance(answer, Exception):
            raise answer
        return answer

    trainer.pull_once = pull_once
    trainer.calls = calls
    return trainer


def test_drain_pulls_every_batch_however_slow_each_pull_is(clock):
    trainer = scripted_trainer(clock, [True] * 30, seconds_per_pull=1.0)
    trainer.drain()
    # 30 batches and the pull that found none: 31 s of pulls, past the old fixed 10 s.
    assert len(trainer.calls) == 31


def test_drain_retries_failed_pulls_until_the_queue_ends(clock):
    error = httpx.ReadTimeout("slow")
    trainer = scripted_trainer(clock, [error, True, error, True], seconds_per_pull=1.0)
    trainer.drain()
    assert len(trainer.calls) == 5


def test_drain_raises_when_batches_never_end(clock):
    trainer = scripted_trainer(clock, [True] * 10_000, seconds_per_pull=1.0)
    with pytest.raises(TimeoutError, match="still had full batches after 120s"):
        trainer.drain()
    assert len(trainer.calls) == 120


def test_drain_timeout_is_the_callers(clock):
    trainer = scripted_trainer(clock, [True] * 10_000, seconds_per_pull=1.0)
    with pytest.raises(TimeoutError, match="after 5s"):
        trainer.drain(timeout=5)
