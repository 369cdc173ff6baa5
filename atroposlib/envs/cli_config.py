"""What an environment's command line resolves to: values layered into a :class:`ParsedCli`.

:func:`parsed_from_values` takes the values of one mode's flags (``{"env": {...},
"openai": {...}, "config": path, ...}``) and layers them, later wins: class defaults
< ``config_init()`` < mode defaults < YAML (``--config``) < the flags; then validates the
env config, resolves the inference servers (``openai`` and extra namespaces such as
``teacher``) and the manager options. Every bad value is a :class:`CliError` naming its
flag. Parsing ``argv`` and running the mode is :mod:`atroposlib.envs.cli`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Tuple, Type

import yaml
from pydantic import BaseModel, TypeAdapter, ValidationError

from atroposlib.envs.constants import ENV_NAMESPACE, NAMESPACE_SEP, OPENAI_NAMESPACE
from atroposlib.envs.server_handling.openai_server import resolve_openai_configs
from atroposlib.envs.server_handling.server_baseline import APIServerConfig, ServerBaseline
from atroposlib.utils.cli import merge_dicts

if TYPE_CHECKING:
    from atroposlib.envs.hooks import EnvHooks

# The command line's logger: its messages read as the CLI's, whichever module resolves.
logger = logging.getLogger("atroposlib.envs.cli")

__all__ = [
    "CliError",
    "ParsedCli",
    "env_config_class",
    "extra_namespaces",
    "namespace_default",
    "parsed_from_values",
]

PROCESS_MODE_DEFAULTS: Dict[str, Any] = {"use_wandb": True}
PROCESS_MODE_FORCED: Dict[str, Any] = {
    "ensure_scores_are_not_same": False,
    "include_messages": True,
}
EVALUATE_MODE_DEFAULTS: Dict[str, Any] = {"use_wandb": True}


class CliError(Exception):
    """A user error on the command line (reported with exit code 2)."""


@dataclass
class ParsedCli:
    """The outcome of parsing: what to run and with which configuration."""

    mode: str
    env_config: Any
    server_configs: Any
    slurm: bool
    testing: bool
    extra_servers: Dict[str, Any] = field(default_factory=dict)
    merged: Dict[str, Any] = field(default_factory=dict)
    manager_options: Dict[str, Any] = field(default_factory=dict)


def _declares_config_cls(env_cls: type) -> bool:
    """True when a subclass of ``BaseEnv`` sets ``env_config_cls`` itself.

    ``BaseEnv`` is the most basic class of the MRO that declares ``env_config_cls``
    (found that way so this module need not import ``base``, which imports it).
    """
    declaring = [k for k in env_cls.__mro__ if "env_config_cls" in vars(k)]
    if not declaring:
        return False
    root = declaring[-1]
    return any(klass is not root and issubclass(klass, root) for klass in declaring)


def env_config_class(env_cls: Type[EnvHooks], env_default: Any = None) -> Type[BaseModel]:
    """The config class behind ``--env.*``, YAML ``env:``, ``--help`` and validation.

    Many environment files subclass ``BaseEnvConfig``, return an instance of the
    subclass from ``config_init()`` and never set ``env_config_cls``; the class of
    that instance is then the env's config class. An explicit ``env_config_cls``
    is used unless ``config_init()`` returns an instance of a subclass of it (the
    more specific class knows every field).
    """
    if env_default is None:
        env_default = env_cls.config_init()[0]
    declared = env_cls.env_config_cls
    returned = type(env_default)
    if not isinstance(env_default, BaseModel):
        return declared
    if not _declares_config_cls(env_cls) or issubclass(returned, declared):
        return returned
    return declared


def namespace_default(env_cls: Type[EnvHooks], namespace: str) -> Any:
    """The default config(s) of an extra server namespace: ``<namespace>_config_init()``
    of the env (``teacher_config_init``), or None."""
    init = getattr(env_cls, f"{namespace}_config_init", None)
    return init() if callable(init) else None


def extra_namespaces(env_cls: Type[EnvHooks], mode: str) -> Tuple[str, ...]:
    """The env's extra server namespaces (``cli_server_namespaces``): ``serve`` only."""
    if mode != "serve":
        return ()
    return tuple(getattr(env_cls, "cli_server_namespaces", ()) or ())


def _load_yaml(path: str | None) -> Dict[str, Any]:
    if not path:
        return {}
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise CliError(f"--config {path}: cannot read the file ({err.strerror})") from err
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as err:
        raise CliError(f"--config {path}: invalid YAML: {err}") from err
    if not isinstance(data, dict):
        raise CliError(f"--config {path}: expected a mapping with env:/openai: keys")
    env_part = data.get(ENV_NAMESPACE, {})
    if env_part is not None and not isinstance(env_part, dict):
        raise CliError(f"--config {path}: 'env' must be a mapping")
    return data


def _explain(err: ValidationError, namespace: str, source: str = "") -> str:
    parts = []
    for e in err.errors():
        loc = NAMESPACE_SEP.join(str(x) for x in e["loc"])
        flag = f"--{namespace}{NAMESPACE_SEP}{loc}" if namespace else f"--{loc}"
        parts.append(f"{flag}: {e['msg']} (got {e.get('input')!r})")
    return "invalid value" + (f" in {source}" if source else "") + ": " + "; ".join(parts)


def _validate_env(env_cls: Type[EnvHooks], values: Dict[str, Any], env_default: Any) -> Any:
    try:
        return env_config_class(env_cls, env_default).model_validate(values)
    except ValidationError as err:
        raise CliError(_explain(err, ENV_NAMESPACE)) from err


def _flat(prefix: str, values: Dict[str, Any]) -> Dict[str, Any]:
    return {f"{prefix}{NAMESPACE_SEP}{k}": v for k, v in values.items()}


def _resolve_servers(
    server_default: Any, yaml_cfg: Dict[str, Any], cli_openai: Dict[str, Any]
) -> Any:
    yaml_openai = yaml_cfg.get(OPENAI_NAMESPACE)
    if (yaml_openai is not None and not isinstance(yaml_openai, (dict, list))) or (
        isinstance(yaml_openai, list) and not all(isinstance(s, dict) for s in yaml_openai)
    ):
        raise CliError("--config: 'openai' must be a mapping or a list of mappings")
    default = server_default
    if isinstance(default, list) and len(default) == 1:
        default = default[0]
    base = default.model_dump() if isinstance(default, ServerBaseline) else {}
    if isinstance(yaml_openai, list) and len(yaml_openai) == 1:
        yaml_openai = yaml_openai[0]  # one server: merged like the dict form
    yaml_single = yaml_openai if isinstance(yaml_openai, dict) else {}
    merged = merge_dicts(base, yaml_single, cli_openai)
    try:
        return resolve_openai_configs(
            default, merged, yaml_cfg, _flat(OPENAI_NAMESPACE, cli_openai), logger
        )
    except ValidationError as err:
        raise CliError(_explain(err, OPENAI_NAMESPACE)) from err
    except ValueError as err:
        raise CliError(str(err)) from err


def _validate_bool(name: str, *values: Any) -> bool:
    result = False
    for value in values:
        if value is None:
            continue
        try:
            result = TypeAdapter(bool).validate_python(value)
        except ValidationError as err:
            raise CliError(f"--{name}: expected true or false (got {value!r})") from err
    return result


def parsed_from_values(env_cls: Type[EnvHooks], mode: str, cli: Dict[str, Any]) -> ParsedCli:
    """A :class:`ParsedCli` for ``mode`` from command-line values (``{"env": {...},
    "openai": {...}, "config": path, ...}``), layered over ``config_init()`` and YAML."""
    yaml_cfg = _load_yaml(cli.get("config"))
    env_default, server_default = env_cls.config_init()

    env_values = merge_dicts(
        env_default.model_dump(),
        PROCESS_MODE_DEFAULTS if mode == "process" else {},
        EVALUATE_MODE_DEFAULTS if mode == "evaluate" else {},
        yaml_cfg.get(ENV_NAMESPACE) or {},
        cli.get(ENV_NAMESPACE) or {},
    )
    if mode == "process":
        env_values.update(PROCESS_MODE_FORCED)
        if not env_values.get("data_path_to_save_groups"):
            env_values["data_path_to_save_groups"] = f"data/{env_cls.name or 'groups'}.jsonl"
    env_config = _validate_env(env_cls, env_values, env_default)

    servers = _resolve_servers(server_default, yaml_cfg, cli.get(OPENAI_NAMESPACE) or {})
    extra: Dict[str, Any] = {}
    for namespace in extra_namespaces(env_cls, mode):
        resolver = getattr(env_cls, f"_resolve_{namespace}_server_configs", None)
        if resolver is None:
            extra[namespace] = _resolve_extra(namespace, yaml_cfg, cli.get(namespace) or {})
            continue
        try:
            extra[namespace] = resolver(
                namespace_default(env_cls, namespace),
                yaml_cfg,
                _flat(namespace, cli.get(namespace) or {}),
            )
        except ValidationError as err:
            raise CliError(_explain(err, namespace)) from err
        except ValueError as err:
            raise CliError(str(err)) from err
    manager = _manager_options(yaml_cfg, cli)
    slurm = _validate_bool("slurm", yaml_cfg.get("slurm"), cli.get("slurm"))
    testing = _validate_bool("testing", yaml_cfg.get("testing"), cli.get("testing"))
    merged = {
        ENV_NAMESPACE: env_config.model_dump(mode="json"),
        OPENAI_NAMESPACE: _dump_servers(servers),
        "slurm": slurm,
        "testing": testing,
    }
    merged.update({k: v for k, v in manager.items() if v is not None})
    return ParsedCli(mode, env_config, servers, slurm, testing, extra, merged, manager)


def _manager_options(yaml_cfg: Dict[str, Any], cli: Dict[str, Any]) -> Dict[str, Any]:
    out: Dict[str, Any] = {"max_n_completions": None, "proxy_url": None}
    for source in (yaml_cfg, cli):
        for key in out:
            if source.get(key) is not None:
                out[key] = source[key]
    if out["max_n_completions"] is not None:
        try:
            out["max_n_completions"] = TypeAdapter(int).validate_python(out["max_n_completions"])
        except ValidationError as err:
            raise CliError(
                f"--max_n_completions: expected an integer (got {out['max_n_completions']!r})"
            ) from err
        if out["max_n_completions"] < 1:
            raise CliError("--max_n_completions: must be at least 1")
    return out


def _resolve_extra(namespace: str, yaml_cfg: Dict[str, Any], cli_values: Dict[str, Any]) -> Any:
    yaml_part = yaml_cfg.get(namespace)
    if yaml_part is None and not cli_values:
        return None
    try:
        if isinstance(yaml_part, list):
            if cli_values and len(yaml_part) > 1:
                raise CliError(
                    f"--{namespace}.* overrides cannot be combined with a YAML list of servers"
                )
            return [APIServerConfig(**merge_dicts(p, cli_values)) for p in yaml_part]
        return [APIServerConfig(**merge_dicts(yaml_part or {}, cli_values))]
    except ValidationError as err:
        raise CliError(_explain(err, namespace)) from err


def _dump_servers(servers: Any) -> Any:
    if isinstance(servers, list):
        return [s.model_dump(mode="json") for s in servers]
    return servers.model_dump(mode="json")
