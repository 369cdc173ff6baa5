"""Client for the rollout API (``run-api``) as the trainer uses it.

- :func:`check_atropos_api` waits for ``GET /info`` to answer (30 s by default);
- :func:`register_trainer` posts ``/register`` with 5 attempts and exponential
  backoff (2–30 s), checks the HTTP status and requires ``uuid`` in the answer;
- :func:`get_batch` fetches one batch (``None`` when none is ready) and raises on
  ``status == "error"``; :func:`wait_for_batch` polls it.

Every request has a timeout and sends ``Authorization: Bearer $ATROPOS_API_KEY``
when that variable is set.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Dict, List

import httpx
from tenacity import retry, retry_if_exception_type, stop_after_attempt, wait_exponential

from atroposlib.utils.io import auth_headers

from .config import TrainingConfig

logger = logging.getLogger(__name__)

REQUEST_TIMEOUT = 60.0


class AtroposAPIError(RuntimeError):
    """The rollout API answered with an error, or could not be reached."""


def _check(resp: httpx.Response, what: str) -> Any:
    if resp.status_code == 401:
        raise AtroposAPIError(f"{what}: 401 unauthorized (set ATROPOS_API_KEY to the API's key)")
    if resp.status_code >= 400:
        raise AtroposAPIError(f"{what}: HTTP {resp.status_code}: {resp.text[:500]}")
    try:
        return resp.json()
    except ValueError as exc:
        raise AtroposAPIError(f"{what}: response is not JSON: {resp.text[:200]!r}") from exc


def check_atropos_api(url: str, timeout: float = 30.0, interval: float = 0.5) -> Dict[str, Any]:
    """Poll ``GET {url}/info`` until it answers; raise :class:`AtroposAPIError` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    last: str | None = None
    while True:
        try:
            resp = httpx.get(f"{url}/info", headers=auth_headers(), timeout=5.0)
            return _check(resp, "GET /info")
        except (httpx.HTTPError, AtroposAPIError) as exc:
            last = str(exc)
        if time.monotonic() >= deadline:
            raise AtroposAPIError(
                f"rollout API at {url} not reachable after {timeout:.0f}s ({last})"
            )
        time.sleep(interval)


def registration_payload(config: TrainingConfig, starting_step: int = 0) -> Dict[str, Any]:
    """The ``/register`` body for ``config`` (same fields as the original trainer)."""
    return {
        "wandb_group": config.wandb_group or "",
        "wandb_project": config.wandb_project or "",
        "batch_size": config.api_batch_size,
        "max_token_len": config.seq_len,
        "checkpoint_dir": config.save_path,
        "save_checkpoint_interval": config.checkpoint_interval
        if config.checkpoint_interval > 0
        else config.training_steps,
        "starting_step": starting_step,
        "num_steps": config.training_steps,
    }


@retry(
    stop=stop_after_attempt(5),
    wait=wait_exponential(multiplier=2, min=2, max=30),
    retry=retry_if_exception_type((httpx.HTTPError, AtroposAPIError)),
    reraise=True,
)
def register_trainer(config: TrainingConfig, starting_step: int = 0) -> Dict[str, Any]:
    """``POST /register``; returns the JSON answer (with ``uuid``)."""
    resp = httpx.post(
        f"{config.atropos_url}/register",
        json=registration_payload(config, starting_step),
        headers=auth_headers(),
        timeout=REQUEST_TIMEOUT,
    )
    data = _check(resp, "POST /register")
    if not isinstance(data, dict) or "uuid" not in data:
        raise AtroposAPIError(f"POST /register: no uuid in response {data!r}")
    logger.info("registered trainer with %s (uuid %s)", config.atropos_url, data["uuid"])
    return data


def get_batch(url: str, client: httpx.Client | None = None) -> List[Dict[str, Any]] | None:
    """One ``GET /batch``: the list of groups, or ``None`` when no batch is ready."""
    getter = client.get if client is not None else httpx.get
    resp = getter(f"{url}/batch", headers=auth_headers(), timeout=REQUEST_TIMEOUT)
    data = _check(resp, "GET /batch")
    if isinstance(data, dict) and data.get("status") == "error":
        raise AtroposAPIError(f"GET /batch: {data.get('message', data)}")
    batch = data.get("batch") if isinstance(data, dict) else None
    return batch or None


def wait_for_batch(
    url: str,
    poll_interval: float = 1.0,
    timeout: float = 0.0,
    should_stop: Callable[[], bool] | None = None,
) -> List[Dict[str, Any]]:
    """Poll ``/batch`` until a batch arrives. ``timeout`` 0 waits forever.

    Transient connection errors are logged and retried; an error payload raises.
    """
    start = time.monotonic()
    with httpx.Client() as client:
        while True:
            try:
                batch = get_batch(url, client)
                if batch:
                    return batch
            except httpx.HTTPError as exc:
                logger.warning("GET /batch failed (%s); retrying", exc)
            if should_stop is not None and should_stop():
                raise AtroposAPIError("stopped while waiting for a batch")
            if timeout and time.monotonic() - start > timeout:
                raise AtroposAPIError(f"no batch from {url} within {timeout:.0f}s")
            time.sleep(poll_interval)
