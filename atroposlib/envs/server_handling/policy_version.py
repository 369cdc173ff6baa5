"""Which weights produced a completion: the policy version of every rollout.

Async RL trains on samples generated with weights a few trainer steps old. To bound or
correct that staleness, every sequence carries the **policy version** of the weights that
generated it (an int; by convention the trainer step whose weights were served, 0 for the
starting weights). A backend learns it, in this order of preference, from:

1. the response header ``X-Atropos-Policy-Version`` (:data:`POLICY_VERSION_HEADER`): what an
   inference server, or a proxy in front of one, sends to name its weights;
2. a field of the JSON answer: ``version`` (``atropos-serve-model``'s ``/generate``,
   completions and chat answers), ``policy_version``, or SGLang's
   ``meta_info.weight_version``;
3. the last weight update the trainer reported to this backend object
   (:meth:`VersionTracking.note_weights_update`), for servers such as plain vLLM that
   report nothing themselves.

When none of those is known the version is ``None`` and the rollout is sent without one,
exactly as the original sent it.

``tokens_and_logprobs_completion`` keeps the original's 4-tuple shape; the version rides
on it as an attribute (:class:`TokensResult`). Every backend call also reports the version
it saw to the :func:`recording_versions` context of the running task, so ``BaseEnv`` can
stamp the groups of environments that never look at versions.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Mapping
from typing import Any

from atroposlib.http.headers import POLICY_VERSION_HEADER

_BODY_KEYS = ("policy_version", "version", "weight_version")
_HEADER_LOWER = POLICY_VERSION_HEADER.lower()


def _as_version(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value.strip())
    return None


def version_from_response(data: Any, headers: Mapping[str, str] | None = None) -> int | None:
    """The policy version an answer names: the header first, then the JSON body, else None.

    >>> version_from_response({"text": ["hi"], "version": 3})
    3
    >>> version_from_response({}, {"x-atropos-policy-version": "7"})
    7
    """
    if headers:
        for name, value in headers.items():
            if name.lower() == _HEADER_LOWER:
                found = _as_version(value)
                if found is not None:
                    return found
    items = data if isinstance(data, list) else [data]
    for item in items:
        if not isinstance(item, Mapping):
            extra = getattr(item, "model_extra", None)
            item = extra if isinstance(extra, Mapping) else {}
        for key in _BODY_KEYS:
            value = item.get(key)
            if value is not None:  # most answers name no version: skip the parse
                found = _as_version(value)
                if found is not None:
                    return found
        meta = item.get("meta_info")
        if isinstance(meta, Mapping):
            found = _as_version(meta.get("weight_version"))
            if found is not None:
                return found
    return None


class TokensResult(tuple):
    """``(prompt_tokens, output_tokens, output_logprobs, finish_reasons)`` plus the
    ``policy_version`` of the weights that produced it (None when unknown).

    It unpacks exactly like the original's plain 4-tuple. ``sequence_versions`` (one per
    output) is set when the outputs came from separate requests that may differ.
    """

    policy_version: int | None
    sequence_versions: list[int | None] | None

    def __new__(
        cls,
        items: Any,
        policy_version: int | None = None,
        sequence_versions: list[int | None] | None = None,
    ) -> TokensResult:
        obj = super().__new__(cls, items)
        obj.policy_version = policy_version
        obj.sequence_versions = sequence_versions
        return obj


def result_version(result: Any) -> int | None:
    """The ``policy_version`` a backend result carries (None for plain tuples and objects)."""
    return _as_version(getattr(result, "policy_version", None))


def output_versions(result: Any, count: int) -> list[int | None]:
    """The version of each of a result's ``count`` outputs (None where unknown)."""
    per = getattr(result, "sequence_versions", None)
    if isinstance(per, list) and len(per) == count:
        return [_as_version(v) for v in per]
    return [result_version(result)] * count


def join_results(parts: list[Any]) -> TokensResult:
    """One result from the results of a request split into several (same prompt)."""
    versions: list[int | None] = []
    for part in parts:
        versions.extend(output_versions(part, len(part[1])))
    known = [v for v in versions if v is not None]
    return TokensResult(
        (
            parts[0][0],
            [seq for p in parts for seq in p[1]],
            [seq for p in parts for seq in p[2]],
            [r for p in parts for r in p[3]],
        ),
        min(known) if known else None,
        versions,
    )


class VersionTracking:
    """Mixin for backends: the last version seen or reported, and resolution of a response's."""

    policy_version: int | None = None
    """The newest version this backend saw in an answer or was told about."""

    def note_weights_update(self, version: int) -> None:
        """Record that the server now serves ``version`` (for servers that report nothing).

        Call it after the trainer's ``/update_weights`` (or restart) completes.
        """
        self.policy_version = int(version)

    def resolve_version(self, data: Any, headers: Mapping[str, str] | None = None) -> int | None:
        """The version of one answer (header, body, else the last noted one), recorded on
        this backend and in the task's :func:`recording_versions` context."""
        found = version_from_response(data, headers)
        if found is None:
            found = self.policy_version
        elif self.policy_version is None or found > self.policy_version:
            self.policy_version = found
        note_version(found)
        return found


_RECORDER: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar(
    "atropos_policy_versions", default=None
)


class _Recording:
    """The context of :func:`recording_versions`: a class rather than a generator-based
    context manager, because one is entered per rollout and the generator machinery cost
    several times the work it wraps."""

    __slots__ = ("seen", "token")

    def __enter__(self) -> list[int]:
        self.seen: list[int] = []
        self.token = _RECORDER.set(self.seen)
        return self.seen

    def __exit__(self, *exc: object) -> None:
        _RECORDER.reset(self.token)


def recording_versions() -> contextlib.AbstractContextManager[list[int]]:
    """Collect the versions of every backend answer within this block (and tasks it starts).

    >>> with recording_versions() as seen:
    ...     note_version(4)
    >>> seen
    [4]
    """
    return _Recording()


def note_version(version: int | None) -> None:
    """Report a version to the enclosing :func:`recording_versions` block, if any."""
    seen = _RECORDER.get()
    if seen is not None and version is not None:
        seen.append(int(version))


def stamp_group(group: Any, seen: list[int]) -> None:
    """Give a group without ``policy_version`` the versions seen while it was generated.

    Each sequence gets the oldest version seen (staleness is judged by the oldest weights
    that contributed); ``policy_version_max`` gets the newest when they differ. A group
    that already has per-sequence versions (from ``ManagedServer`` nodes) is left alone.
    """
    if not seen or not isinstance(group, dict) or group.get("policy_version") is not None:
        return
    tokens = group.get("tokens")
    if not isinstance(tokens, list):
        return
    low, high = min(seen), max(seen)
    group["policy_version"] = [low] * len(tokens)
    if high != low:
        group["policy_version_max"] = [high] * len(tokens)


def merge_versions(
    low: int | None, high: int | None, new: int | None
) -> tuple[int | None, int | None]:
    """``(min, max)`` after a sequence grew by a generation with version ``new``."""
    if new is None:
        return low, high
    return (new if low is None else min(low, new)), (new if high is None else max(high, new))
