"""Background tasks of the serve loop: a dying sender stops the env with its error, failed
status polls are counted, and unusable status answers are refused naming the field."""

from __future__ import annotations

import asyncio
import math

import httpx
import pytest

from atroposlib.envs.api_client import BadAnswer, RolloutAPIClient
from atroposlib.envs.background import BackgroundTaskDied, PollFailures, watch_task
from atroposlib.envs.scheduling import BadStatusAnswer, EnvStatus

from .test_base_hooks import make_env


async def test_a_sender_task_that_dies_stops_the_serve_loop_with_its_error(tmp_path, monkeypatch):
    monkeypatch.setenv("ATROPOS_OUTBOX_DIR", str(tmp_path / "outbox"))
    env = make_env(group_size=2)
    runner = env.runner

    async def pump() -> None:
        raise OSError("disk gone")

    task = asyncio.create_task(pump())
    watch_task(task, "sender", runner.stop_with_error)
    await asyncio.wait({task})
    await asyncio.sleep(0)  # the done callback runs on the next turn
    assert runner.wake.is_set()
    with pytest.raises(BackgroundTaskDied, match="the sender task died: OSError: disk gone") as err:
        runner.raise_if_fatal()
    assert isinstance(err.value.__cause__, OSError)


async def test_a_cancelled_or_finished_task_is_no_error():
    errors: list[BaseException] = []

    async def forever() -> None:
        await asyncio.Event().wait()

    async def ends() -> None:
        return None

    cancelled, finished = asyncio.create_task(forever()), asyncio.create_task(ends())
    watch_task(cancelled, "poll", errors.append)
    watch_task(finished, "sender", errors.append)
    cancelled.cancel()
    await asyncio.wait({cancelled, finished})
    await asyncio.sleep(0)
    assert errors == []


def test_poll_failures_are_counted_per_kind_and_back_off():
    failures = PollFailures()
    logged = [failures.failed("bad_answer") for _ in range(10)]
    assert logged == [True] + [False] * 8 + [True]
    assert failures.delay(0.1) == 1.0 and failures.delay(0.5) == 2.0
    failures.failed("http_503")
    failures.success()
    assert failures.delay(0.1) == 0.1
    assert failures.metrics() == {
        "train_perf/status_poll_failures": 11,
        "train_perf/status_poll_failures/bad_answer": 10,
        "train_perf/status_poll_failures/http_503": 1,
    }


def test_env_metrics_include_the_failed_polls(tmp_path, monkeypatch):
    monkeypatch.setenv("ATROPOS_OUTBOX_DIR", str(tmp_path / "outbox"))
    env = make_env(group_size=2)
    env.runner.poll_failures.failed("unreachable")
    assert env.perf_metrics()["train_perf/status_poll_failures/unreachable"] == 1


@pytest.mark.parametrize(
    ("payload", "names"),
    [
        ([1, 2], "a JSON list, expected an object"),
        ("status", "a JSON str"),
        ({"current_step": "soon"}, "current_step is 'soon', expected an integer"),
        ({"queue_size": True}, "queue_size is True"),
        ({"self_queue_size": [1]}, "self_queue_size is [1]"),
        ({"max_group_size": {"a": 1}}, "max_group_size is {'a': 1}"),
        ({"unallocated_fraction": math.nan}, "unallocated_fraction is nan, expected a finite"),
        ({"env_weight": math.inf}, "env_weight is inf"),
        ({"current_step": math.inf}, "current_step is inf, expected an integer"),
        ({"current_step": "9" * 5000}, "current_step is '99999"),
    ],
)
def test_a_status_answer_with_a_bad_field_is_refused_naming_it(payload, names):
    with pytest.raises(BadStatusAnswer, match=names.replace("[", r"\[").replace("{", r"\{")):
        EnvStatus.from_payload(payload)


def test_a_sane_status_answer_still_reads_as_before():
    status = EnvStatus.from_payload({"current_step": "3", "queue_size": None, "env_weight": 2})
    assert status == EnvStatus(current_step=3, env_weight=2.0)


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b"<html>oops</html>", "a body that is not JSON"),
        (b"\xff\xfe\x00", "a body that is not JSON"),
        (b"[]", "a JSON list where an object was expected"),
        (b"x" * 5000, "a body that is not JSON (5000 bytes)"),
    ],
)
async def test_a_2xx_answer_that_is_not_an_object_is_a_bad_answer_quoting_it(body, why):
    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body)

    client = RolloutAPIClient("http://127.0.0.1:9", transport=httpx.MockTransport(answer))
    try:
        with pytest.raises(BadAnswer) as err:
            await client.status_env(0)
    finally:
        await client.aclose()
    assert why in str(err.value) and "/status-env answered 200" in str(err.value)
    assert err.value.preview == body[:200]
    assert repr(body[:20])[2:-1] in str(err.value)
