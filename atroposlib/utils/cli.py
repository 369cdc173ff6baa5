"""Helpers for namespaced CLI flags and layered configuration dictionaries.

Environment configuration comes from four layers, merged with :func:`merge_dicts`
(later layers win): class defaults, ``config_init()``, a YAML file, and CLI flags.
Flags are namespaced with a dot (``--env.group_size 8``, ``--openai.base_url URL``).
"""

from __future__ import annotations

import copy
import sys
from typing import Any, Dict, Mapping, Sequence, Type

from pydantic import BaseModel, create_model
from pydantic.fields import FieldInfo

# The separator of namespaced flags (``--env.group_size``); atroposlib.envs.constants
# re-exports it under its original path.
NAMESPACE_SEP = "."


def merge_dicts(*dicts: Mapping[str, Any]) -> Dict[str, Any]:
    """Recursively merge dictionaries; values of later ``overrides`` win.

    Nested dicts are merged key by key; any other value (lists included) replaces
    the earlier one. The inputs are not modified.

    >>> merge_dicts({"env": {"a": 1, "b": 2}}, {"env": {"b": 3}})
    {'env': {'a': 1, 'b': 3}}
    """
    if not dicts:
        return {}
    result: Dict[str, Any] = copy.deepcopy(dict(dicts[0] or {}))
    for override in dicts[1:]:
        for key, value in (override or {}).items():
            if isinstance(value, Mapping) and isinstance(result.get(key), Mapping):
                result[key] = merge_dicts(result[key], value)
            else:
                result[key] = copy.deepcopy(value)
    return result


def _coerce_flag_value(raw: str) -> Any:
    return None if raw == "None" else raw


def get_double_dash_flags(argv: Sequence[str] | None = None) -> Dict[str, Any]:
    """Read ``--key value``, ``--key=value`` and bare ``--key`` (True) pairs from ``argv``.

    The literal ``None`` becomes ``None``; other values stay strings for pydantic to
    coerce. Positional words (the subcommand) are ignored.

    >>> get_double_dash_flags(["serve", "--env.group_size", "8", "--slurm", "--x=None"])
    {'env.group_size': '8', 'slurm': True, 'x': None}
    """
    args = list(sys.argv[1:] if argv is None else argv)
    flags: Dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("--") and len(arg) > 2:
            key = arg[2:]
            if "=" in key:
                key, value = key.split("=", 1)
                flags[key] = _coerce_flag_value(value)
            elif i + 1 < len(args) and not args[i + 1].startswith("-"):
                flags[key] = _coerce_flag_value(args[i + 1])
                i += 1
            else:
                flags[key] = True
        i += 1
    return flags


def extract_namespace(model: Any, prefix: str) -> Dict[str, Any]:
    """Return the entries of ``model`` (a dict or a pydantic model) under ``prefix.``, prefix
    removed.

    >>> extract_namespace({"env.group_size": 8, "openai.base_url": "u"}, "env")
    {'group_size': 8}
    """
    data = model.model_dump() if isinstance(model, BaseModel) else dict(model)
    start = prefix + NAMESPACE_SEP
    return {k[len(start) :]: v for k, v in data.items() if k.startswith(start)}


def get_prefixed_pydantic_model(base_model: Type[BaseModel], prefix: str) -> Type[BaseModel]:
    """Build a flat model whose field names are ``prefix.<field>`` (descriptions kept)."""
    fields: Dict[str, Any] = {}
    for name, info in base_model.model_fields.items():
        new_info = copy.copy(info)
        new_info.alias = f"{prefix}{NAMESPACE_SEP}{name}"
        fields[f"{prefix}_{name}"] = (info.annotation, new_info)
    return create_model(f"{prefix.capitalize()}{base_model.__name__}", **fields)


def adjust_model_defaults(
    model_class: Type[BaseModel], defaults: BaseModel | Mapping[str, Any]
) -> Type[BaseModel]:
    """Return a subclass of ``model_class`` whose field defaults come from ``defaults``.

    Used so that ``--help`` shows the values an environment's ``config_init()`` sets.
    Fields missing from ``defaults`` keep their own default.
    """
    values = defaults.model_dump() if isinstance(defaults, BaseModel) else dict(defaults)
    fields: Dict[str, Any] = {}
    for name, info in model_class.model_fields.items():
        if name not in values:
            continue
        new_info: FieldInfo = copy.copy(info)
        new_info.default = values[name]
        new_info.default_factory = None
        fields[name] = (info.annotation, new_info)
    return create_model(model_class.__name__, __base__=model_class, **fields)
