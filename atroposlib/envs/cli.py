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
exit code 2. Here: the settings models, ``argv`` parsing, the server probe and running
the mode; the layering of values into a :class:`ParsedCli` is
:mod:`atroposlib.envs.cli_config`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
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
from pydantic import BaseModel, Field, create_model
from pydantic_settings import BaseSettings, CliSettingsSource, CliSubCommand, SettingsConfigDict

from atroposlib.envs.cli_config import (
    EVALUATE_MODE_DEFAULTS,
    PROCESS_MODE_DEFAULTS,
    PROCESS_MODE_FORCED,
    CliError,
    ParsedCli,
    env_config_class,
    parsed_from_values,
)
from atroposlib.envs.cli_config import extra_namespaces as _extra_namespaces
from atroposlib.envs.cli_config import namespace_default as _namespace_default
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
from atroposlib.envs.server_handling.server_baseline import APIServerConfig, ServerBaseline
from atroposlib.utils.cli import adjust_model_defaults
from atroposlib.utils.suggest import closest

if TYPE_CHECKING:
    from atroposlib.envs.hooks import EnvHooks

logger = logging.getLogger(__name__)

MODES = ("serve", "process", "evaluate")
LOCAL_HOSTS = ("localhost", "127.0.0.1", "0.0.0.0")


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


def _check_flag_names(argv: Sequence[str], known: set) -> None:
    """Refuse an unknown ``--flag`` naming the closest known ones (a typo costs one run)."""
    for arg in argv:
        if not arg.startswith("--") or arg == "--":
            continue
        name = arg.split("=", 1)[0]
        if name in known or name.replace("-", "_") in known:
            continue
        close = closest(name, sorted(known), cutoff=0.6)
        if not close and NAMESPACE_SEP in name:
            # the field part alone, e.g. --env.gs_size -> --env.group_size
            prefix, _, field_name = name.partition(NAMESPACE_SEP)
            fields = [k.partition(NAMESPACE_SEP)[2] for k in known if k.startswith(prefix + ".")]
            close = [f"{prefix}{NAMESPACE_SEP}{f}" for f in closest(field_name, fields, 0.5)]
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


def parse_cli(env_cls: Type[EnvHooks], argv: Sequence[str], prog: str | None = None) -> ParsedCli:
    """Parse ``argv`` into a :class:`ParsedCli`; raises :class:`CliError` or exits 2 on bad flags."""
    prog = prog or Path(sys.argv[0]).name
    mode, cli = _parse_args(env_cls, argv, prog)
    return parsed_from_values(env_cls, mode, cli)


# ------------------------------------------------------------ server probe


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
