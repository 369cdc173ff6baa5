"""What the serve loop needs to survive its background tasks: failed ``/status-env`` polls
are counted per kind, and a task that dies stops the env with its error.

A status poll fails when the API cannot be reached, answers an error status, or answers
2xx with a body that is not a status (not JSON, not an object, a field of the wrong type:
:class:`~atroposlib.envs.api_client.BadAnswer`,
:class:`~atroposlib.envs.scheduling.BadStatusAnswer`). Each is a failed poll, retried with
backoff; anything else raised by the poll is a bug and ends its task, and a background
task (status poll, sender pump, outbox flusher) that ends with an error must stop the env
rather than leave it waiting for a status or a delivery that never comes.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Callable, Dict

logger = logging.getLogger(__name__)


class BackgroundTaskDied(RuntimeError):
    """A task the serve loop depends on ended with an error (chained as the cause)."""


def watch_task(task: asyncio.Task, what: str, on_error: Callable[[BaseException], None]) -> None:
    """Call ``on_error`` with a :class:`BackgroundTaskDied` if ``task`` ends with an error.

    A cancelled task or one that returns is not an error (that is how they are stopped).
    The task's exception is retrieved here, so asyncio never reports it as unretrieved.
    """

    def done(finished: asyncio.Task) -> None:
        if finished.cancelled():
            return
        err = finished.exception()
        if err is None:
            return
        logger.error("the %s task died: %s: %s", what, type(err).__name__, err, exc_info=err)
        died = BackgroundTaskDied(f"the {what} task died: {type(err).__name__}: {err}")
        died.__cause__ = err
        on_error(died)

    task.add_done_callback(done)


class PollFailures:
    """Failed ``/status-env`` polls: how many in a row (for the backoff and the log's rate)
    and how many of each kind since start (``bad_answer``, ``http_<status>``, ``unreachable``)."""

    def __init__(self) -> None:
        self.in_a_row = 0
        self.by_kind: Counter[str] = Counter()

    def success(self) -> None:
        """A poll succeeded: the backoff starts over."""
        self.in_a_row = 0

    def failed(self, kind: str) -> bool:
        """Count a failed poll of ``kind``; True when this one should be logged (the 1st and
        10th in a row, then every 100th)."""
        self.in_a_row += 1
        self.by_kind[kind] += 1
        return self.in_a_row in (1, 10) or self.in_a_row % 100 == 0

    def delay(self, poll_s: float, cap_s: float = 2.0) -> float:
        """Seconds to the next poll: ``poll_s``, growing linearly with the failures to ``cap_s``."""
        return poll_s if self.in_a_row == 0 else min(cap_s, poll_s * self.in_a_row)

    def metrics(self) -> Dict[str, int]:
        """``train_perf/status_poll_failures`` (total) and one count per kind."""
        out = {"train_perf/status_poll_failures": int(sum(self.by_kind.values()))}
        for kind, count in sorted(self.by_kind.items()):
            out[f"train_perf/status_poll_failures/{kind}"] = int(count)
        return out
