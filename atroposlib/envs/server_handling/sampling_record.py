"""What a group was sampled with, recorded while it is collected and stamped on it.

``BaseEnv`` runs each item's ``collect_trajectories`` inside :func:`recording_sampling`;
the server layer reports into it (the same context-variable pattern as the policy
versions): every training request notes its sampling temperature, and every
``ManagedServer`` node notes its finish reason under its token ids. :func:`stamp_sampling`
then gives the group what the trainer reads:

- ``generation_params["temperature"]``: the temperature of the group's requests when
  they all used one (the trainer scores tokens at it); a request that names none is
  sampled at the backends' default, 1.0. An environment's own value is kept, and mixed
  temperatures stamp nothing.
- ``overrides[i]["finish_reason"]``: the finish reason of the node whose tokens are
  sequence ``i``'s (``"length"`` marks a sequence cut at its generation limit, which the
  trainer's ``--mask-truncated`` leaves out). An environment's own value is kept.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

DEFAULT_TEMPERATURE = 1.0
"""What OpenAI-compatible servers (vLLM, SGLang, OpenAI, ``atropos-serve-model``) sample
at when a request names no temperature."""


@dataclass
class SamplingRecord:
    """Temperatures of the training requests and finish reasons of the nodes seen."""

    temperatures: list[float] = field(default_factory=list)
    finish_reasons: dict[tuple[int, ...], str] = field(default_factory=dict)


_RECORDER: contextvars.ContextVar[SamplingRecord | None] = contextvars.ContextVar(
    "atropos_sampling_record", default=None
)


class _Recording:
    """The context of :func:`recording_sampling` (a class: entered once per rollout, where a
    generator-based context manager cost several times the work it wraps)."""

    __slots__ = ("record", "token")

    def __enter__(self) -> SamplingRecord:
        self.record = SamplingRecord()
        self.token = _RECORDER.set(self.record)
        return self.record

    def __exit__(self, *exc: object) -> None:
        _RECORDER.reset(self.token)


def recording_sampling() -> contextlib.AbstractContextManager[SamplingRecord]:
    """Collect what the requests made in this block (and the tasks it starts) sampled with."""
    return _Recording()


def request_temperature(kwargs: Mapping[str, Any]) -> float:
    """The temperature a request samples at: ``temperature`` (or in ``extra_body``), else
    the servers' default."""
    value = kwargs.get("temperature")
    extra = kwargs.get("extra_body")
    if value is None and isinstance(extra, Mapping):
        value = extra.get("temperature")
    return DEFAULT_TEMPERATURE if value is None else value


def note_request(kwargs: Mapping[str, Any]) -> None:
    """Report a training request's temperature to the enclosing record, if any."""
    record = _RECORDER.get()
    if record is None:
        return
    try:
        value = float(request_temperature(kwargs))
    except (TypeError, ValueError):
        return  # the backend rejects it; nothing was sampled
    if math.isfinite(value):
        record.temperatures.append(value)


def note_sequence(tokens: Sequence[int], finish_reason: str | None) -> None:
    """Report the finish reason of a tracked sequence (by its token ids), if recording."""
    record = _RECORDER.get()
    if record is not None and finish_reason:
        record.finish_reasons[tuple(tokens)] = str(finish_reason)


def stamp_sampling(group: Any, record: SamplingRecord) -> None:
    """Give ``group`` the temperature and finish reasons recorded (see the module doc)."""
    if not isinstance(group, dict):
        return
    temps = set(record.temperatures)
    params = group.get("generation_params")
    if len(temps) == 1 and (params is None or isinstance(params, dict)):
        if params is None or params.get("temperature") is None:
            group["generation_params"] = {**(params or {}), "temperature": temps.pop()}
    tokens = group.get("tokens")
    if not record.finish_reasons or not isinstance(tokens, list):
        return
    found = {}
    for i, seq in enumerate(tokens):
        try:
            reason = record.finish_reasons.get(tuple(int(t) for t in seq))
        except (TypeError, ValueError):
            continue
        if reason is not None:
            found[i] = reason
    if not found:
        return
    overrides = group.get("overrides")
    if overrides is None:
        overrides = [{} for _ in tokens]
    elif not isinstance(overrides, list) or len(overrides) != len(tokens):
        return  # the environment's own (malformed) overrides: validation names them
    else:
        overrides = [dict(o) if isinstance(o, Mapping) else o for o in overrides]
    for i, reason in found.items():
        if isinstance(overrides[i], dict) and overrides[i].get("finish_reason") is None:
            overrides[i]["finish_reason"] = reason
    group["overrides"] = overrides
