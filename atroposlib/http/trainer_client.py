"""The trainer's side of the rollout API (``run-api``): register, read its state, pull batches.

One client for everything that acts as the trainer: the example trainer
(``example_trainer/api.py``), the inspection and export tools
(``atroposlib/frontend/api_client.py``) and the fake trainer of tests and
benchmarks (``atroposlib/testing/trainer.py``). Each keeps its own functions
and names on top of this.

- :func:`registration_body` is the one ``POST /register`` body;
- :class:`TrainerAPIClient` sends every request with a timeout and
  ``Authorization: Bearer $ATROPOS_API_KEY`` when that variable is set, and
  turns failures into :class:`RolloutAPIError` (:class:`RolloutAPIUnreachable`
  when no answer came) with a message a person can act on;
- :meth:`TrainerAPIClient.pull` and :meth:`TrainerAPIClient.get_batch` pull
  batches with the API's delivery guarantee (docs/design.md, "Delivery
  guarantee"): each ``GET /batch`` acknowledges the batch received before it,
  and a batch served again (the acknowledgement was lost) is skipped by its
  ``batch_id``.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Tuple

import httpx

from atroposlib.utils.io import auth_headers

logger = logging.getLogger(__name__)

__all__ = [
    "RolloutAPIError",
    "RolloutAPIUnreachable",
    "TrainerAPIClient",
    "check_answer",
    "check_status",
    "registration_body",
]

Batch = List[Dict[str, Any]]


class RolloutAPIError(RuntimeError):
    """The rollout API answered with an error, or could not be reached."""


class RolloutAPIUnreachable(RolloutAPIError, httpx.TransportError):
    """No answer came from the rollout API (connection refused or lost, or a timeout).

    Also an ``httpx.TransportError``: callers that retry on httpx's errors keep doing so.
    """

    def __init__(self, message: str) -> None:
        httpx.TransportError.__init__(self, message)


def registration_body(
    batch_size: int,
    max_token_len: int,
    num_steps: int,
    *,
    wandb_group: str = "",
    wandb_project: str = "",
    checkpoint_dir: str = "",
    save_checkpoint_interval: int = -1,
    starting_step: int = 0,
    **extra: Any,
) -> Dict[str, Any]:
    """The ``POST /register`` body of a trainer (``extra`` adds or overrides fields)."""
    return {
        "wandb_group": wandb_group,
        "wandb_project": wandb_project,
        "batch_size": batch_size,
        "max_token_len": max_token_len,
        "checkpoint_dir": checkpoint_dir,
        "save_checkpoint_interval": save_checkpoint_interval,
        "starting_step": starting_step,
        "num_steps": num_steps,
        **extra,
    }


def check_status(resp: httpx.Response, what: str) -> httpx.Response:
    """``resp``, unless its status is an error: then :class:`RolloutAPIError` naming ``what``
    (``"GET /batch"``), the status and the start of the answer."""
    if resp.status_code == 401:
        raise RolloutAPIError(
            f"{what}: 401 unauthorized: set ATROPOS_API_KEY to the key run-api was started with"
        )
    if resp.status_code >= 400:
        raise RolloutAPIError(f"{what}: HTTP {resp.status_code}: {resp.text[:500]}")
    return resp


def check_answer(resp: httpx.Response, what: str) -> Any:
    """The JSON of an answer to ``what``; :class:`RolloutAPIError` for an HTTP error status
    (:func:`check_status`) or an answer that is not JSON."""
    check_status(resp, what)
    try:
        return resp.json()
    except ValueError:
        raise RolloutAPIError(f"{what}: the answer is not JSON: {resp.text[:200]!r}") from None


class TrainerAPIClient:
    """Talks to ``run-api`` at ``url`` as the trainer does.

    ``client``: an ``httpx.Client`` to send through (kept alive, closed by its
    owner); without one each request opens its own connection. ``hint`` is
    added to the message of :class:`RolloutAPIUnreachable` (what to check).
    ``last_batch_id`` resumes the acknowledgements (from a checkpoint).
    ``ack_pending``: the first pull leaves acknowledging to the API, which then takes a
    batch served before this client existed as received (the original's clients, which
    send no ``ack``); by default it acknowledges nothing, so a trainer restarted before
    training on that batch gets it again.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 60.0,
        client: httpx.Client | None = None,
        hint: str = "",
        last_batch_id: str | None = None,
        ack_pending: bool = False,
    ) -> None:
        self.url = url.rstrip("/")
        self.ack_pending = ack_pending
        self.timeout = timeout
        self._client = client
        self.hint = hint
        self.last_batch_id = last_batch_id
        self.last_step: int | None = None
        self.redelivered = 0
        """Batches served again and skipped (their acknowledgement was lost)."""

    # ------------------------------------------------------------------ requests
    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """One request; :class:`RolloutAPIUnreachable` when no answer came."""
        send = self._client.request if self._client is not None else httpx.request
        kwargs.setdefault("timeout", self.timeout)
        kwargs["headers"] = {**auth_headers(), **kwargs.get("headers", {})}
        try:
            return send(method, f"{self.url}{path}", **kwargs)
        except httpx.TimeoutException as e:
            raise RolloutAPIUnreachable(
                f"{method} {path}: the rollout API at {self.url} did not answer in time ({e})"
                + self._hint()
            ) from e
        except httpx.HTTPError as e:
            raise RolloutAPIUnreachable(
                f"{method} {path}: cannot reach the rollout API at {self.url} "
                f"({type(e).__name__}: {e})" + self._hint()
            ) from e

    def _hint(self) -> str:
        return f". {self.hint}" if self.hint else ""

    def send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """One request whose answer must not be an HTTP error (:func:`check_status`)."""
        return check_status(self.request(method, path, **kwargs), f"{method} {path}")

    def call(self, method: str, path: str, **kwargs: Any) -> Any:
        """One request; its JSON answer (:func:`check_answer`)."""
        return check_answer(self.request(method, path, **kwargs), f"{method} {path}")

    # --------------------------------------------------------------- the routes
    def register(self, body: Dict[str, Any]) -> Dict[str, Any]:
        """``POST /register`` with ``body`` (:func:`registration_body`); the answer, which
        names the trainer's ``uuid``."""
        data = self.call("POST", "/register", json=body)
        if not isinstance(data, dict) or "uuid" not in data:
            raise RolloutAPIError(f"POST /register: no uuid in the answer {data!r}")
        return data

    def info(self) -> Dict[str, Any]:
        """``GET /info``: the registered batch size and max token length."""
        return self.call("GET", "/info")

    def status(self) -> Dict[str, Any]:
        """``GET /status``: current step and queue size."""
        return self.call("GET", "/status")

    def wandb_info(self) -> Dict[str, Any]:
        """``GET /wandb_info``: the trainer's W&B group and project."""
        return self.call("GET", "/wandb_info")

    def reset(self) -> None:
        """``GET /reset_data``: wipes the API's queue, registry and step. Destructive."""
        self.send("GET", "/reset_data")

    # ------------------------------------------------------------------ batches
    def pull(self) -> Tuple[Batch | None, bool]:
        """One ``GET /batch`` that acknowledges the last batch received.

        Returns ``(batch, again)``: the batch when a new one came (None when none is
        ready, or when ``again``: the answer was the batch received last, served again).
        An ``{"status": "error"}`` answer raises :class:`RolloutAPIError`.
        """
        if self.last_batch_id is None and self.ack_pending:
            data = self.call("GET", "/batch")
        else:
            data = self.call("GET", "/batch", params={"ack": self.last_batch_id or ""})
        if not isinstance(data, dict):
            raise RolloutAPIError(f"GET /batch: expected an object, got {type(data).__name__}")
        if data.get("status") == "error":
            raise RolloutAPIError(f"GET /batch: {data.get('message', data)}")
        batch = data.get("batch")
        if not batch:
            return None, False
        if not isinstance(batch, list):
            raise RolloutAPIError("GET /batch: 'batch' is not a list")
        batch_id = data.get("batch_id")
        if batch_id is not None and batch_id == self.last_batch_id:
            # Received already (our acknowledgement was lost): asking again acknowledges it.
            logger.warning("GET /batch: batch %s received twice; skipping it", batch_id)
            self.redelivered += 1
            return None, True
        if batch_id is not None:  # an API that numbers its batches (the original does not)
            self.last_batch_id, self.last_step = batch_id, data.get("step")
        return batch, False

    def get_batch(self) -> Batch | None:
        """The next batch not received before, or None when none is ready.

        Asking again after a batch served twice acknowledges it, so the next answer
        is the batch after it (at most three tries).
        """
        for _ in range(3):
            batch, again = self.pull()
            if not again:
                return batch
        return None

    def acknowledge(self) -> None:
        """Acknowledge the last batch now (``POST /batch/ack``), e.g. right after its step."""
        if self.last_batch_id is not None:
            self.call("POST", "/batch/ack", json={"batch_id": self.last_batch_id})
