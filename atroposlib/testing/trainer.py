"""A fake trainer: registers with a running ``run-api`` and pulls batches with the real
trainer's client (:class:`~atroposlib.http.trainer_client.TrainerAPIClient`: acknowledging
each batch, skipping one served again after a restart).

Example::

    trainer = FakeTrainer(api_port, batch_size=4, num_steps=2)
    trainer.register()
    trainer.start()
    ...
    trainer.stop()
    assert trainer.batches
"""

from __future__ import annotations

import threading
import time
from typing import Any, List

import httpx

from atroposlib.http.trainer_client import RolloutAPIError, TrainerAPIClient, registration_body

__all__ = ["FakeTrainer", "register_trainer", "trainer_registration"]


def trainer_registration(
    batch_size: int,
    max_token_len: int = 4096,
    num_steps: int = 10**9,
    checkpoint_dir: str = "",
    **extra: Any,
) -> dict:
    """The ``/register`` body of a trainer that never checkpoints (``extra`` overrides fields)."""
    fields: dict = {"wandb_group": "g", "wandb_project": "p", "save_checkpoint_interval": -1}
    return registration_body(
        batch_size, max_token_len, num_steps, checkpoint_dir=checkpoint_dir, **{**fields, **extra}
    )


def register_trainer(
    api_url: str, batch_size: int, *, first_batch: bool = True, timeout: float = 10.0, **fields: Any
) -> None:
    """Register a trainer with the API at ``api_url`` (fields as :func:`trainer_registration`).

    With ``first_batch`` it also makes the first ``GET /batch``, which starts the run: the API
    lets environments register only after a trainer has polled once.
    """
    client = TrainerAPIClient(api_url, timeout=timeout)
    client.register(trainer_registration(batch_size, **fields))
    if first_batch:
        client.send("GET", "/batch")


class FakeTrainer:
    """Registers with the API and pulls batches in a thread, recording every group.

    ``paused`` stops pulling (to let the queue fill up); connection errors (an API
    restart) are retried.
    """

    def __init__(
        self, api_port: int, batch_size: int, num_steps: int, max_token_len: int = 4096
    ) -> None:
        self.url = f"http://127.0.0.1:{api_port}"
        self.batch_size = batch_size
        self.num_steps = num_steps
        self.max_token_len = max_token_len
        self.batches: List[List[dict]] = []
        self.errors = 0
        self.client = TrainerAPIClient(self.url, timeout=10)
        self._pull_lock = threading.Lock()
        self.paused = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def register(self) -> None:
        """Register with the API and make the first ``/batch`` call (environments wait for it)."""
        register_trainer(
            self.url,
            batch_size=self.batch_size,
            max_token_len=self.max_token_len,
            num_steps=self.num_steps,
            first_batch=False,
        )
        self.pull_once()  # recorded like any other pull, should a batch already be queued

    def pull_once(self) -> bool:
        """One ``/batch`` call that acknowledges the last batch received
        (docs/design.md, "Delivery guarantee").

        After an API restart the unacknowledged batch is served again; it carries the
        ``batch_id`` already seen and is skipped, as the trainer's client does. One call at
        a time (``drain`` may run beside the pulling thread): two calls sending the same
        ``ack`` would both receive the next batch.
        """
        with self._pull_lock:
            return self._pull_locked()

    def _pull_locked(self) -> bool:
        batch, again = self.client.pull()
        if batch is None:
            return again
        assert sum(len(g["tokens"]) for g in batch) == self.batch_size
        self.batches.append(batch)
        return True

    @property
    def last_batch_id(self) -> str | None:
        """The ``batch_id`` of the last batch received (what the next pull acknowledges)."""
        return self.client.last_batch_id

    @property
    def redelivered(self) -> int:
        """Batches served again after their first delivery, and skipped."""
        return self.client.redelivered

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.paused.is_set():
                time.sleep(0.05)
                continue
            try:
                if not self.pull_once():
                    time.sleep(0.02)
            except (RolloutAPIError, httpx.HTTPError):
                self.errors += 1
                time.sleep(0.1)

    def start(self) -> FakeTrainer:
        """Pull in a background thread until :meth:`stop`."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the pulling thread and wait for it."""
        self._stop.set()
        self._thread.join(timeout=10)

    def drain(self, timeout: float = 120.0) -> None:
        """Pull until the API has no full batch left to serve.

        It ends on the first pull that finds no full batch, however long the pulls before it
        took (a loaded machine makes each one slower, not fewer); connection errors and
        timeouts are retried. ``timeout`` only guards against a hang: past it,
        :class:`TimeoutError` is raised instead of returning with batches still queued.
        """
        deadline = time.monotonic() + timeout
        pulled = failed = 0
        while True:
            try:
                if not self.pull_once():
                    return
                pulled += 1
            except (RolloutAPIError, httpx.HTTPError):
                failed += 1
                time.sleep(0.1)
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"drain: the API still had full batches after {timeout:g}s "
                    f"({pulled} pulled, {failed} pulls failed)"
                )

    def group_ids(self) -> List[int]:
        """The first token of every group received, in order (the test envs put an id there)."""
        return [g["tokens"][0][0] for batch in self.batches for g in batch]

    def queue_size(self) -> int:
        """The API's ``queue_size`` from ``/status``."""
        return int(self.client.status()["queue_size"])
