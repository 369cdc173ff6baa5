"""One way from a pydantic model to a command line: ``run-api``, ``atropos-serve-model``
and ``atropos-grpo`` all build their flags here.

Every field of the model becomes a kebab-case flag (``max_queue_mb`` -> ``--max-queue-mb``)
whose help is the field's ``description``, followed by its default (unless it is None and the
description says what that means) and, for a ``pydantic_settings.BaseSettings`` model, the
environment variable that also sets it.
Flags that are not given stay out of the parsed values, so the model's own defaults (and a
settings model's environment variables) apply; a flag always wins. Values the model
rejects end the program with ``PROG: error: invalid value: --flag: reason`` and exit
status 2, argparse's convention for bad usage, never a traceback.

Where a flag differs from what the field's name and type give, the field says so with a
:class:`Cli` marker in its annotation::

    class Settings(BaseSettings):
        cors_origins: Annotated[List[str], Cli(flag="--cors-origin")] = Field(
            default_factory=list, description="Origins allowed by CORS (repeatable)."
        )
        max_queue_mb: Annotated[float, Cli(metavar="N")] = Field(1024, gt=0, description="...")

    parser = argparse.ArgumentParser(prog="my-server")
    add_fields(parser, Settings)
    settings = validate(Settings, parse_values(parser, argv), prog="my-server")

Bounds stay where they are, on the fields (``gt``, ``le``, ...): the command line checks
types and choices, the model checks everything else.
"""

from __future__ import annotations

import argparse
import sys
import types
import typing
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Literal, Mapping, NoReturn, Sequence, Type

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings

__all__ = [
    "Cli",
    "add_fields",
    "env_var",
    "flag_of",
    "parse_bool",
    "parse_values",
    "validate",
]

M = typing.TypeVar("M", bound=BaseModel)
BoolStyle = Literal["switch", "value"]
ListStyle = Literal["append", "nargs"]


@dataclass(frozen=True)
class Cli:
    """Command-line hints for one field, given as ``Annotated`` metadata.

    - ``flag``: the option string when it is not the kebab-case field name
      (``cors_origins`` spelled ``--cors-origin``, as one origin is given per flag);
    - ``metavar``: the placeholder in the help (``N``, ``PATH``);
    - ``choices``: accepted values of a ``str`` field that is not a ``Literal``;
    - ``nargs``: ``"+"`` for a list field that takes several values after one flag
      where the command's lists are otherwise repeated flags;
    - ``positional``: the field is a positional argument (``atropos-serve-model MODEL``);
    - ``default_text``: what the help shows as the default instead of the value, for a
      default computed at run time (``""`` shows none).
    """

    flag: str | None = None
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    nargs: str | None = None
    positional: bool = False
    default_text: str | None = None


def parse_bool(text: str) -> bool:
    """``true``/``false`` as typed on a command line (``1``/``0``, ``yes``/``no``, ``on``/``off``).

    >>> parse_bool("Yes"), parse_bool("off")
    (True, False)
    """
    low = text.strip().lower()
    if low in ("1", "true", "yes", "y", "on"):
        return True
    if low in ("0", "false", "no", "n", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def _marker(info: FieldInfo) -> Cli:
    return next((m for m in info.metadata if isinstance(m, Cli)), Cli())


def flag_of(model: Type[BaseModel], name: str) -> str:
    """The option string of field ``name`` of ``model`` (``--max-queue-mb``); a positional
    field is named by its upper-case name (``MODEL``)."""
    info = model.model_fields[name]
    marker = _marker(info)
    if marker.positional:
        return name.upper()
    return marker.flag or "--" + name.replace("_", "-")


def env_var(model: Type[BaseModel], name: str) -> str | None:
    """The environment variable that sets field ``name`` of a ``BaseSettings`` model
    (``ATROPOS_PORT``), or None for a plain model."""
    if not issubclass(model, BaseSettings):
        return None
    return f"{model.model_config.get('env_prefix', '')}{name}".upper()


def _without_none(annotation: Any) -> Any:
    """``int | None`` -> ``int``; anything else unchanged."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _default_text(info: FieldInfo, marker: Cli) -> str | None:
    if marker.default_text is not None:
        return marker.default_text or None
    if info.is_required():
        return None
    value = info.get_default(call_default_factory=True)
    if value is None and "default" in (info.description or ""):
        # The description says what an unset value means ("default: the model's
        # max_position_embeddings"); "(default: None)" after it would only confuse.
        return None
    if isinstance(value, str) and not value:
        return "''"
    return str(value)


def _help(model: Type[BaseModel], name: str, info: FieldInfo, marker: Cli) -> str:
    notes = []
    if info.is_required():
        if not marker.positional:
            notes.append("required")
    else:
        shown = _default_text(info, marker)
        if shown is not None:
            notes.append(f"default: {shown}")
    env = env_var(model, name)
    if env:
        notes.append(f"env {env}")
    text = info.description or name
    if notes:
        text += f" ({'; '.join(notes)})"
    # argparse %-formats help strings (for %(default)s); a literal % must not break --help.
    return text.replace("%", "%%")


def _list_metavar(flag: str) -> str:
    """The last word of the flag, upper-cased: ``--weights-root ROOT``."""
    return flag.lstrip("-").split("-")[-1].upper()


def add_fields(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    model: Type[BaseModel],
    names: Iterable[str] | None = None,
    *,
    bools: BoolStyle = "switch",
    lists: ListStyle = "append",
) -> None:
    """Add one argument per field of ``model`` (all fields, or ``names`` in that order) to
    ``parser`` or an argument group of it.

    ``bools="switch"``: ``--flag`` alone sets true (argparse's ``store_true``);
    ``bools="value"``: ``--flag`` alone or ``--flag true|false``. ``lists="append"``: one
    value per flag, the flag repeated (``--cors-origin A --cors-origin B``);
    ``lists="nargs"``: several values after one flag (``--lora-target-modules q_proj v_proj``).
    Options are absent from the parsed values unless given (``argparse.SUPPRESS``).
    """
    for name in model.model_fields if names is None else names:
        info = model.model_fields[name]
        marker = _marker(info)
        flag = flag_of(model, name)
        kwargs: Dict[str, Any] = {"help": _help(model, name, info, marker)}
        annotation = _without_none(info.annotation)
        origin = typing.get_origin(annotation)
        if annotation is bool:
            if bools == "value":
                kwargs.update(nargs="?", const=True, type=parse_bool, metavar="BOOL")
            else:
                kwargs["action"] = "store_true"
        elif origin in (list, typing.List):
            (item,) = typing.get_args(annotation) or (str,)
            kwargs["metavar"] = _list_metavar(flag)
            if item in (int, float):
                kwargs["type"] = item
            if marker.nargs or lists == "nargs":
                kwargs["nargs"] = marker.nargs or "+"
            else:
                kwargs["action"] = "append"
        elif origin is Literal:
            kwargs["choices"] = list(typing.get_args(annotation))
        elif annotation in (int, float):
            kwargs["type"] = annotation
        if marker.choices:
            kwargs["choices"] = list(marker.choices)
        if marker.metavar:
            kwargs["metavar"] = marker.metavar
        if marker.positional:
            kwargs["metavar"] = kwargs.get("metavar", name.upper())
            parser.add_argument(name, **kwargs)
        else:
            parser.add_argument(flag, dest=name, default=argparse.SUPPRESS, **kwargs)


def parse_values(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None = None
) -> Dict[str, Any]:
    """Parse ``argv`` (default ``sys.argv[1:]``): the values of the flags given, by field
    name. argparse's own errors (unknown flag, bad number, bad choice) exit 2."""
    return vars(parser.parse_args(None if argv is None else list(argv)))


def _where(model: Type[BaseModel], loc: Sequence[Any]) -> str:
    if not loc or loc[0] not in model.model_fields:
        return "config"
    name = str(loc[0])
    env = env_var(model, name)
    return f"{flag_of(model, name)} (or {env})" if env else flag_of(model, name)


def _fail(prog: str, message: str) -> NoReturn:
    print(f"{prog}: error: {message}", file=sys.stderr)
    sys.exit(2)


def validate(model: Type[M], values: Mapping[str, Any], *, prog: str) -> M:
    """``model(**values)``, or exit 2 with one line naming each rejected flag.

    The values of a settings model's environment variables are checked here too, and an
    error names both the flag and the variable (``--port (or ATROPOS_PORT)``). The rejected
    value itself is not echoed: it may be a secret.
    """
    try:
        return model(**values)
    except ValidationError as exc:
        errors = exc.errors()
    missing = [_where(model, e["loc"]) for e in errors if e["type"] == "missing"]
    if missing and len(missing) == len(errors):
        _fail(prog, "the following arguments are required: " + ", ".join(missing))
    # One line, no usage block: the flags parsed, a value is wrong.
    reasons = [
        f"{_where(model, e['loc'])}: {e['msg'].removeprefix('Value error, ')}" for e in errors
    ]
    _fail(prog, "invalid value: " + "; ".join(reasons))
