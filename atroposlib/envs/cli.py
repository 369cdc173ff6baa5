"""``MyEnv.cli()``: the ``serve|process|evaluate`` command line of an environment (docs/design.md, "Environment command line").

Flags are parsed by pydantic-settings (``CliSettingsSource``) from models built
from the environment's own config classes, so ``--help`` lists every field with
its description and the value ``config_init()`` gives it. Values are layered,
later wins: class defaults < ``config_init()`` < mode defaults < YAML
(``--config``) < CLI flags.

Examples::

    python my_env.py serve --env.group_size 8 --openai.base_url http://127.0.0.1:9001/v1
    python my_env.py process --config cfg.yaml --env.total_steps 10
    python my_env.py evaluate --env.data_dir_to_save_evals evals/

Bad flags and bad values end the program with a message naming the flag and
exit code 2.
"""

from __future__ import annotations

import asyncio
import difflib
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    Dict,
    List,
    NoReturn,
    Sequence,
    Tuple,
    Type,
    get_args,
)

import yaml
from pydantic import BaseModel, Field, TypeAdapter, ValidationError, create_model
from pydantic_settings import BaseSettings, CliSettingsSource, CliSubCommand, SettingsConfigDict

from atroposlib.envs.constants import ENV_NAMESPACE, NAMESPACE_SEP, OPENAI_NAMESPACE
from atroposlib.envs.health import (
    NoServerReachableError,
    ServersDownError,
    TooManyFailuresError,
    probe_servers,
    server_urls,
    unreachable_message,
)
from atroposlib.envs.offline import ProcessFailedError
from atroposlib.envs.server_handling.openai_server import resolve_openai_configs
from atroposlib.envs.server_handling.server_baseline import APIServerConfig, ServerBaseline
from atroposlib.utils.cli import adjust_model_defaults, merge_dicts

if TYPE_CHECKING:
    from atroposlib.envs.hooks import EnvHooks

logger = logging.getLogger(__name__)

MODES = ("serve", "process", "evaluate")
LOCAL_HOSTS = ("localhost", "127.0.0.1", "0.0.0.0")

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


# ------------------------------------------------------------------ models


def _server_defaults(default: Any) -> Dict[str, Any]:
    """Values to show as ``--openai.*`` defaults for the env's default server config(s)."""
    if isinstance(default, list) and len(default) == 1:
        default = default[0]
    if isinstance(default, ServerBaseline):
        return default.model_dump()
    return {}


def _mode_env_defaults(mode: str) -> Dict[str, Any]:
    if mode == "process":
        return {**PROCESS_MODE_DEFAULTS, **PROCESS_MODE_FORCED}
    if mode == "evaluate":
        return dict(EVALUATE_MODE_DEFAULTS)
    return {}


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


def _mode_model(
    env_cls: Type[EnvHooks], mode: str, env_default: BaseModel, server_default: Any
) -> Type[BaseModel]:
    env_values = {**env_default.model_dump(), **_mode_env_defaults(mode)}
    env_model = adjust_model_defaults(env_config_class(env_cls, env_default), env_values)
    server_model = adjust_model_defaults(APIServerConfig, _server_defaults(server_default))
    fields: Dict[str, Any] = {
        ENV_NAMESPACE: (
            env_model,
            Field(default_factory=env_model, description="Environment settings."),
        ),
        OPENAI_NAMESPACE: (
            server_model,
            Field(
                default_factory=server_model, description="Inference server settings (one server)."
            ),
        ),
    }
    for namespace in _extra_namespaces(env_cls, mode):
        ns_model = adjust_model_defaults(
            APIServerConfig, _server_defaults(_namespace_default(env_cls, namespace))
        )
        fields[namespace] = (
            ns_model,
            Field(default_factory=ns_model, description=f"{namespace} server settings."),
        )
    fields["slurm"] = (bool, Field(False, description="Discover inference servers from SLURM."))
    fields["testing"] = (
        bool,
        Field(False, description="Use the mock server harness instead of real servers."),
    )
    fields["max_n_completions"] = (
        int | None,
        Field(
            None, description="Split requests with a larger n into chunks of this size (default 8)."
        ),
    )
    fields["proxy_url"] = (
        str | None,
        Field(None, description="Managed-server proxy URL (also ATROPOS_PROXY_URL)."),
    )
    fields["config"] = (
        str | None,
        Field(None, description="YAML file with env:, openai:, slurm:, testing: keys."),
    )
    return create_model(f"{mode.capitalize()}Cli", **fields)


def mode_config_cls(env_cls: Type[EnvHooks], mode: str) -> Type[BaseModel]:
    """The settings class of one mode of ``env_cls``'s command line (``BaseEnv.get_cli_<mode>
    _config_cls`` returns it): one field per namespace (``env``, ``openai``, extra server
    namespaces such as ``teacher``) and the manager flags. An instance's ``cli_cmd()`` (also
    ``run()``) runs that mode with the values set on it, layered over ``config_init()`` and
    the YAML ``--config`` exactly as the command line is.
    """
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")
    env_default, server_default = env_cls.config_init()

    def cli_cmd(self: BaseModel) -> None:
        """Run this mode with the values set on this instance."""
        values = _none_literals(self.model_dump(exclude_unset=True))
        _parse_and_run(
            env_cls, Path(sys.argv[0]).name, lambda: parsed_from_values(env_cls, mode, values)
        )

    base = type(
        f"{mode.capitalize()}CliBase",
        (BaseModel,),
        {"cli_cmd": cli_cmd, "run": cli_cmd, "__doc__": _MODE_HELP[mode]},
    )
    model = _mode_model(env_cls, mode, env_default, server_default)
    return create_model(f"{mode.capitalize()}Cli", __base__=(model, base))


def _mode_cls(env_cls: Type[EnvHooks], mode: str) -> Type[BaseModel]:
    """The class the env's ``get_cli_<mode>_config_cls`` returns (a subclass may override it)."""
    getter = getattr(env_cls, f"get_cli_{mode}_config_cls", None)
    return getter() if callable(getter) else mode_config_cls(env_cls, mode)


def _namespace_default(env_cls: Type[EnvHooks], namespace: str) -> Any:
    """The default config(s) of an extra server namespace: ``<namespace>_config_init()``
    of the env (``teacher_config_init``), or None."""
    init = getattr(env_cls, f"{namespace}_config_init", None)
    return init() if callable(init) else None


def _extra_namespaces(env_cls: Type[EnvHooks], mode: str) -> Tuple[str, ...]:
    if mode != "serve":
        return ()
    return tuple(getattr(env_cls, "cli_server_namespaces", ()) or ())


def _root_model(env_cls: Type[EnvHooks], prog: str) -> Type[BaseSettings]:
    subcommands = {
        mode: (
            CliSubCommand[_mode_cls(env_cls, mode)],  # type: ignore[misc]
            Field(description=_MODE_HELP[mode]),
        )
        for mode in MODES
    }
    return _settings_with(prog, subcommands)


_MODE_HELP = {
    "serve": "Generate rollouts for a trainer through the rollout API.",
    "process": "Generate groups offline into a jsonl file (and an html view); no API.",
    "evaluate": "Run setup() and evaluate() once.",
}


def _settings_with(prog: str, subcommands: Dict[str, Any]) -> Type[BaseSettings]:
    class _Root(BaseSettings):
        model_config = SettingsConfigDict(
            cli_prog_name=prog, nested_model_default_partial_update=False
        )

    return create_model("EnvCli", __base__=_Root, **subcommands)


# ------------------------------------------------------------- argv parsing


def _is_bool(annotation: Any) -> bool:
    return annotation is bool or (
        bool in get_args(annotation) and all(a in (bool, type(None)) for a in get_args(annotation))
    )


def _bool_flags(mode_model: Type[BaseModel]) -> set:
    flags = set()
    for name, info in mode_model.model_fields.items():
        if _is_bool(info.annotation):
            flags.add(f"--{name}")
        elif isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
            for sub, sub_info in info.annotation.model_fields.items():
                if _is_bool(sub_info.annotation):
                    flags.add(f"--{name}{NAMESPACE_SEP}{sub}")
    return flags


def _known_flags(mode_model: Type[BaseModel]) -> set:
    flags = {"--help", "-h"}
    for name, info in mode_model.model_fields.items():
        flags.add(f"--{name}")
        if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
            flags.update(f"--{name}{NAMESPACE_SEP}{sub}" for sub in info.annotation.model_fields)
    return flags


def _closest(name: str, candidates: Sequence[str], cutoff: float) -> List[str]:
    """The candidates nearly as similar to ``name`` as the best one (at most three)."""
    scored = sorted(
        ((difflib.SequenceMatcher(None, name, c).ratio(), c) for c in candidates), reverse=True
    )
    if not scored or scored[0][0] < cutoff:
        return []
    best = scored[0][0]
    return [c for ratio, c in scored[:3] if ratio >= best - 0.04]


def _check_flag_names(argv: Sequence[str], known: set) -> None:
    """Refuse an unknown ``--flag`` naming the closest known ones (a typo costs one run)."""
    for arg in argv:
        if not arg.startswith("--") or arg == "--":
            continue
        name = arg.split("=", 1)[0]
        if name in known or name.replace("-", "_") in known:
            continue
        close = _closest(name, sorted(known), cutoff=0.6)
        if not close and NAMESPACE_SEP in name:
            # the field part alone, e.g. --env.gs_size -> --env.group_size
            prefix, _, field_name = name.partition(NAMESPACE_SEP)
            fields = [k.partition(NAMESPACE_SEP)[2] for k in known if k.startswith(prefix + ".")]
            close = [f"{prefix}{NAMESPACE_SEP}{f}" for f in _closest(field_name, fields, 0.5)]
        hint = f"; did you mean {' or '.join(close)}?" if close else " (see --help)"
        raise CliError(f"unrecognized arguments: {name}{hint}")


def _expand_bare_bools(argv: Sequence[str], bool_flags: set) -> List[str]:
    """``--slurm`` alone means ``--slurm true`` (the original's bare-flag rule)."""
    out: List[str] = []
    for i, arg in enumerate(argv):
        out.append(arg)
        if arg in bool_flags:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if nxt is None or nxt.startswith("-"):
                out.append("true")
    return out


def _none_literals(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _none_literals(v) for k, v in value.items()}
    if value in ("None", "null"):
        return None
    return value


def _parse_args(
    env_cls: Type[EnvHooks], argv: Sequence[str], prog: str
) -> Tuple[str, Dict[str, Any]]:
    root = _root_model(env_cls, prog)
    mode = next((a for a in argv if not a.startswith("-")), None)
    if mode in MODES:
        sub_model = root.model_fields[mode].annotation
        sub_model = get_args(sub_model)[0] if get_args(sub_model) else sub_model
        _check_flag_names(argv, _known_flags(sub_model))
        argv = _expand_bare_bools(argv, _bool_flags(sub_model))
    source = CliSettingsSource(
        root,
        cli_parse_args=list(argv),
        cli_prog_name=prog,
        cli_implicit_flags=False,
        cli_exit_on_error=True,
        cli_avoid_json=False,
    )
    parsed = source()
    chosen = [m for m in MODES if parsed.get(m) is not None]
    if not chosen:
        raise CliError(f"choose a subcommand: {', '.join(MODES)} (see {prog} --help)")
    return chosen[0], _none_literals(parsed[chosen[0]] or {})


# ------------------------------------------------------------ config merge


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


def parse_cli(env_cls: Type[EnvHooks], argv: Sequence[str], prog: str | None = None) -> ParsedCli:
    """Parse ``argv`` into a :class:`ParsedCli`; raises :class:`CliError` or exits 2 on bad flags."""
    prog = prog or Path(sys.argv[0]).name
    mode, cli = _parse_args(env_cls, argv, prog)
    return parsed_from_values(env_cls, mode, cli)


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
    for namespace in _extra_namespaces(env_cls, mode):
        resolver = getattr(env_cls, f"_resolve_{namespace}_server_configs", None)
        if resolver is None:
            extra[namespace] = _resolve_extra(namespace, yaml_cfg, cli.get(namespace) or {})
            continue
        try:
            extra[namespace] = resolver(
                _namespace_default(env_cls, namespace),
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


def _warn_local_servers(results: Sequence[Any]) -> None:
    """Warn about local servers that did not answer the start-up probe (and only those)."""
    for result in results:
        if not result.ok and any(host in result.url for host in LOCAL_HOSTS):
            logger.warning(
                "inference server %s is local and did not answer (%s); make sure it is running",
                result.url,
                result.reason,
            )


def check_servers(env: EnvHooks, parsed: ParsedCli) -> None:
    """Probe every inference server (at most 5 s each) before ``process``/``evaluate``.

    Raises :class:`NoServerReachableError` when none answers. ``serve`` is not
    probed here: its inference servers are often started by the trainer (the
    example trainer launches vLLM itself) after the environment, so ``serve``
    waits for them instead, with a status line a minute, for up to
    ``--env.max_server_downtime`` seconds (see ``EnvRunner.start_server_watch``).
    Mock servers (``--testing``) and SLURM discovery are not probed.
    """
    if parsed.testing or parsed.slurm or parsed.mode == "serve":
        return
    urls = server_urls(env.server)
    if not urls:
        return
    results = asyncio.run(probe_servers(urls))
    if not any(r.ok for r in results):
        raise NoServerReachableError(unreachable_message(results))
    _warn_local_servers(results)


# ------------------------------------------------------------------ running


def build_env(env_cls: Type[EnvHooks], parsed: ParsedCli) -> EnvHooks:
    """Instantiate the environment for a parsed command line."""
    kwargs: Dict[str, Any] = {}
    for namespace, configs in parsed.extra_servers.items():
        if configs is not None:
            kwargs[f"{namespace}_server_configs"] = configs
    if parsed.manager_options.get("proxy_url"):
        os.environ["ATROPOS_PROXY_URL"] = parsed.manager_options["proxy_url"]
    env = env_cls(
        config=parsed.env_config,
        server_configs=parsed.server_configs,
        slurm=parsed.slurm,
        testing=parsed.testing,
        **kwargs,
    )
    if parsed.manager_options.get("max_n_completions") is not None and hasattr(
        env.server, "max_n_completions"
    ):
        env.server.max_n_completions = parsed.manager_options["max_n_completions"]
    if parsed.mode == "process":
        env.n_groups_to_process = parsed.env_config.total_steps
        env.group_size_to_process = parsed.env_config.group_size
    return env


def write_evaluate_config(parsed: ParsedCli) -> Path | None:
    """Save the merged configuration to ``{data_dir_to_save_evals}/evaluate_config.yaml``."""
    directory = parsed.env_config.data_dir_to_save_evals
    if not directory:
        return None
    path = Path(directory) / "evaluate_config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(parsed.merged, sort_keys=False))
    return path


def run_cli(env_cls: Type[EnvHooks], argv: Sequence[str] | None = None) -> None:
    """Entry point behind ``BaseEnv.cli()``."""
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
        for noisy in ("httpx", "httpx2", "httpcore", "openai", "urllib3"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
    argv = list(sys.argv[1:] if argv is None else argv)
    prog = Path(sys.argv[0]).name
    _parse_and_run(env_cls, prog, lambda: parse_cli(env_cls, argv, prog))


def _parse_and_run(env_cls: Type[EnvHooks], prog: str, parse: Callable[[], ParsedCli]) -> None:
    """Run what ``parse()`` gives; a :class:`CliError` from it is a usage error (exit 2)."""
    try:
        parsed = parse()
    except CliError as err:
        _exit_with_error(prog, err, 2)
    run_parsed(env_cls, parsed, prog)


def _exit_with_error(prog: str, err: BaseException, code: int) -> NoReturn:
    """Report ``err`` as ``prog: error: ...`` on stderr and exit with ``code``."""
    sys.stderr.write(f"{prog}: error: {err}\n")
    raise SystemExit(code) from None


def run_parsed(env_cls: Type[EnvHooks], parsed: ParsedCli, prog: str) -> None:
    """Build the environment for ``parsed``, check its servers and run its mode (errors
    reported as ``prog: error: ...`` with exit 2 for bad setups, 1 for failed runs)."""
    env = build_env(env_cls, parsed)
    try:
        check_servers(env, parsed)
    except NoServerReachableError as err:
        _exit_with_error(prog, err, 2)
    try:
        _run_mode(env, parsed)
    except (TooManyFailuresError, ServersDownError, ProcessFailedError) as err:
        last_tb = getattr(err, "last_traceback", "")
        if last_tb:
            sys.stderr.write(f"last failure:\n{last_tb}")
        _exit_with_error(prog, err, 1)


def _run_mode(env: EnvHooks, parsed: ParsedCli) -> None:
    if parsed.mode == "serve":
        asyncio.run(env.env_manager())
    elif parsed.mode == "process":
        asyncio.run(env.process_manager())
    else:
        path = write_evaluate_config(parsed)
        if path is not None:
            logger.info("configuration written to %s", path)
        asyncio.run(env.run_evaluate())


__all__ = [
    "CliError",
    "ParsedCli",
    "build_env",
    "check_servers",
    "env_config_class",
    "mode_config_cls",
    "parse_cli",
    "parsed_from_values",
    "run_cli",
    "run_parsed",
    "write_evaluate_config",
]
