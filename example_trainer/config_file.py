"""``atropos-grpo-run --config RUN.yaml``: reading the file and wording its mistakes.

A mistake in the file is reported as the file and the key path where it sits
(``demo.yaml: trainer.trainig_steps: unknown key; did you mean trainer.training_steps?``),
never as a command-line flag the user did not type. Unknown keys are found at every level
the file has a schema for: the top level (:class:`~example_trainer.launch.run_config.RunConfig`),
its sections (``warmup:``, ``eval:``, ``teacher:``) and ``trainer:`` (the fields of
:class:`~example_trainer.config.TrainingConfig`). The suggestions come from
:mod:`atroposlib.utils.suggest`, the helper the environment CLI's unknown flags use too.
"""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Sequence, Type

import yaml
from pydantic import BaseModel

from atroposlib.utils.suggest import did_you_mean

__all__ = ["ConfigFileError", "explain", "load", "unknown_keys"]


class ConfigFileError(ValueError):
    """A run configuration file that cannot be used; the message names the file and key."""


def load(path: str) -> Dict[str, Any]:
    """The mapping in the YAML file ``path`` (empty for an empty file)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigFileError(f"--config {path}: cannot read the file ({exc.strerror})") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigFileError(f"--config {path}: invalid YAML{_where(exc)}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigFileError(f"--config {path}: the file must hold a mapping of RunConfig keys")
    return data


def _where(exc: yaml.YAMLError) -> str:
    """`` at line 3, column 7: <problem>`` of a YAML error, on one line."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{at}: {problem}"


def _section_model(annotation: Any) -> Type[BaseModel] | None:
    """The model of a field typed ``Model`` or ``Model | None``, else None."""
    for arg in (annotation, *typing.get_args(annotation)):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def unknown_keys(
    data: Mapping[str, Any],
    model: Type[BaseModel],
    nested: Mapping[str, Type[BaseModel]] = {},
    prefix: str = "",
) -> List[str]:
    """``"key.path: unknown key; did you mean key.other?"`` for each key of ``data`` (and of
    its sections) that ``model`` has no field for; ``nested`` names the models of
    dict-typed fields whose keys are another model's fields (``trainer``)."""
    problems: List[str] = []
    fields = model.model_fields
    for key, value in data.items():
        where = f"{prefix}{key}"
        if key not in fields:
            hint = did_you_mean(str(key), fields, prefix=prefix)
            problems.append(f"{where}: unknown key{hint or ' (see --help)'}")
            continue
        sub = nested.get(key) or _section_model(fields[key].annotation)
        if sub is not None and isinstance(value, dict):
            problems += unknown_keys(value, sub, {}, f"{where}.")
    return problems


def explain(
    errors: Sequence[Mapping[str, Any]],
    path: str | None,
    from_flags: Iterable[str] = (),
    prefix: str = "",
) -> str:
    """One line for the pydantic ``errors`` (``ValidationError.errors()``): a value given as a
    flag (its first key in ``from_flags``, or no file) is named by its flag, one from the file
    by ``FILE: key.path`` (``prefix`` put before the path: ``trainer.``)."""
    flags = set(from_flags)
    parts = []
    for e in errors:
        loc: Sequence[Any] = e["loc"]
        msg = str(e["msg"]).removeprefix("Value error, ")
        if not loc:
            parts.append(msg)
        elif loc[0] in flags or path is None:
            parts.append(f"--{str(loc[0]).replace('_', '-')}: {msg}")
        else:
            parts.append(f"{path}: {prefix}{'.'.join(map(str, loc))}: {msg}")
    return "; ".join(parts)
