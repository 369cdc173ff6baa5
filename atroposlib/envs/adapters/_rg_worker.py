"""What runs inside the reasoning-gym generator process: make items, score answers.

Kept apart from the environment so the child imports only reasoning-gym. The
child is started with a fixed ``PYTHONHASHSEED`` (see
:class:`~atroposlib.envs.adapters.reasoning_gym.GeneratorPool`) because some
generators iterate over sets of strings, whose order follows the hash seed.
Functions here are also called in-process by tests and tools.
"""

from __future__ import annotations

import json
import logging
import traceback
from typing import Any, Dict, List, Tuple

logger = logging.getLogger(__name__)

# composite has no usable default (it needs at least one dataset): a small mix.
COMPOSITE_DEFAULT = [
    {"name": "chain_sum", "weight": 1.0, "config": {}},
    {"name": "leg_counting", "weight": 1.0, "config": {}},
]

_DATASETS: Dict[Tuple[str, str, int, int], Any] = {}


def task_names() -> List[str]:
    """Every task registered in the installed reasoning-gym, sorted."""
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def make_dataset(task: str, config: Dict[str, Any], seed: int, size: int) -> Any:
    """The (cached) dataset of ``task`` with generator ``config``, ``seed`` and ``size``.

    ``composite`` takes ``datasets`` as a list of ``{"name", "weight", "config"}`` dicts
    (reasoning-gym wants ``DatasetSpec`` objects there), :data:`COMPOSITE_DEFAULT` if unset.
    """
    key = (task, json.dumps(config, sort_keys=True, default=str), seed, size)
    dataset = _DATASETS.get(key)
    if dataset is None:
        import reasoning_gym

        kwargs = dict(config)
        if task == "composite":
            kwargs.setdefault("datasets", COMPOSITE_DEFAULT)
            from reasoning_gym.composite import DatasetSpec

            kwargs["datasets"] = [
                spec
                if isinstance(spec, DatasetSpec)
                else DatasetSpec(
                    name=spec["name"],
                    weight=float(spec.get("weight", 1.0)),
                    config=dict(spec.get("config", {})),
                )
                for spec in kwargs.get("datasets") or []
            ]
        _enum_values(task, kwargs)
        dataset = reasoning_gym.create_dataset(task, seed=seed, size=size, **kwargs)
        _DATASETS[key] = dataset
    return dataset


def _enum_values(task: str, kwargs: Dict[str, Any]) -> None:
    """Turn names into the enum members a task's config wants, in place.

    Configs arrive as JSON (``--env.task_configs``), so an enum-typed field such as
    ``aiw``'s ``task_types`` comes as ``["siblings"]``; the generator would fail on
    the plain strings deep inside item generation. The field's default says which
    enum it takes; an unknown name raises here with the allowed ones.
    """
    import dataclasses
    import enum

    from reasoning_gym.factory import DATASETS

    if task not in DATASETS:
        return
    config_cls = DATASETS[task][1]
    if not dataclasses.is_dataclass(config_cls):
        return
    for f in dataclasses.fields(config_cls):
        if f.name not in kwargs:
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            continue
        members = default if isinstance(default, (list, tuple)) else [default]
        kind = next((type(m) for m in members if isinstance(m, enum.Enum)), None)
        if kind is None:
            continue

        def member(value: Any, kind: type = kind, name: str = f.name) -> Any:
            if isinstance(value, kind):
                return value
            try:
                return kind(value)
            except ValueError:
                allowed = ", ".join(str(m.value) for m in kind)
                raise ValueError(f"{task}.{name}: {value!r} is not one of {allowed}") from None

        value = kwargs[f.name]
        if isinstance(value, (list, tuple)):
            kwargs[f.name] = [member(v) for v in value]
        else:
            kwargs[f.name] = member(value)


def generate_item(
    task: str, config: Dict[str, Any], seed: int, size: int, index: int
) -> Dict[str, Any]:
    """Item ``index`` (mod ``size``) of the dataset: ``{"question", "answer", "metadata"}``."""
    entry = make_dataset(task, config, seed, size)[index % size]
    return {
        "question": str(entry["question"]),
        "answer": entry.get("answer"),
        "metadata": entry.get("metadata", {}),
    }


def score_answers(
    task: str,
    config: Dict[str, Any],
    seed: int,
    size: int,
    answers: List[str | None],
    entry: Dict[str, Any],
) -> List[Tuple[float, str | None]]:
    """``(score, error)`` for each answer, scored by the task's own ``score_answer``.

    A scorer that raises (some do on malformed answers) gives 0.0 and the error's
    text, so one bad answer never stops the caller.
    """
    dataset = make_dataset(task, config, seed, size)
    results: List[Tuple[float, str | None]] = []
    for answer in answers:
        try:
            score = float(dataset.score_answer(answer, entry))
        except Exception as err:  # the library's scorer failed: 0 and counted by the caller
            results.append((0.0, f"{type(err).__name__}: {err}"[:300]))
            logger.debug("score_answer of %s raised\n%s", task, traceback.format_exc())
            continue
        if score != score:  # NaN from a scorer counts as wrong, not as an error
            score = 0.0
        results.append((score, None))
    return results


def ping() -> int:
    """Imports reasoning-gym in the child; returns ``hash("x")`` so callers can check the seed."""
    import reasoning_gym  # noqa: F401

    return hash("atropos")


def serve(stdin: Any = None, stdout: Any = None) -> None:
    """The child's loop: read ``(function name, args)`` pickles, answer ``(ok, value)``.

    Frames are a 4-byte big-endian length then a pickle. The protocol keeps its own copy
    of the stdout pipe and points file descriptor 1 at stderr, so a task that prints
    cannot corrupt the answers.
    """
    import os
    import pickle
    import struct
    import sys

    if stdout is None:
        stdout = os.fdopen(os.dup(1), "wb")
        os.dup2(2, 1)
    stdin = stdin or sys.stdin.buffer
    while True:
        header = stdin.read(4)
        if len(header) < 4:
            return
        name, args = pickle.loads(stdin.read(struct.unpack(">I", header)[0]))
        try:
            reply = (True, _FUNCTIONS[name](*args))
        except Exception as err:  # sent back to the caller, which decides what it means
            reply = (False, f"{type(err).__name__}: {err}")
        try:
            data = pickle.dumps(reply)
        except Exception as err:  # an unpicklable item: say so instead of dying
            data = pickle.dumps((False, f"unpicklable result: {err}"))
        stdout.write(struct.pack(">I", len(data)) + data)
        stdout.flush()


_FUNCTIONS = {f.__name__: f for f in (task_names, generate_item, score_answers, ping)}

if __name__ == "__main__":
    # A scorer in a loop never reads the closed stdin: without this, a parent killed (even
    # with -9) would leave the child spinning; its own children go with it.
    from atroposlib.utils.parent_death import descendants_die_with_parent

    descendants_die_with_parent()
    serve()
