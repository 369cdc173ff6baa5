"""atroposlib.utils.settings_cli: a pydantic model's fields as a command line."""

from __future__ import annotations

import argparse
from typing import Annotated, List, Literal

import pytest
from pydantic import BaseModel, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from atroposlib.utils.settings_cli import (
    Cli,
    add_fields,
    env_var,
    flag_of,
    parse_bool,
    parse_values,
    validate,
)


class Server(BaseSettings):
    """A settings model: flags, then DEMO_* environment variables, then defaults."""

    model_config = SettingsConfigDict(env_prefix="DEMO_", extra="ignore")

    host: str = Field("127.0.0.1", description="Address to bind.")
    port: int = Field(8000, ge=0, le=65535, description="TCP port.")
    max_queue_mb: Annotated[float, Cli(metavar="N")] = Field(
        1024, gt=0, description="Queue budget in MiB."
    )
    cors_origins: Annotated[List[str], Cli(flag="--cors-origin")] = Field(
        default_factory=list, description="Allowed origins (repeatable)."
    )
    log_level: Annotated[str, Cli(choices=("debug", "info"))] = Field(
        "info", description="Log level."
    )
    token: str | None = Field(None, description="Secret token.")
    reload: bool = Field(False, description="Reload on change.")
    share: float = Field(0.5, description="Share of 100% of the memory.")


class Job(BaseModel):
    """A plain model with a required positional, lists and switches."""

    model: Annotated[str, Cli(positional=True)] = Field(..., description="Model directory.")
    names: Annotated[List[str] | None, Cli(nargs="+")] = Field(
        None, description="Served names; default: MODEL."
    )
    roots: List[str] | None = Field(None, description="Allowed roots.")
    layers: List[int] | None = Field(None, description="Layers to train.")
    dtype: Literal["auto", "float32"] = Field("auto", description="Weight dtype.")
    steps: int = Field(10, ge=1, description="Training steps.")
    resume: bool = Field(False, description="Resume from the newest checkpoint.")
    device: Annotated[str, Cli(default_text="cuda when available")] = Field(
        "cpu", description="Torch device."
    )

    @field_validator("model")
    @classmethod
    def _exists(cls, value: str) -> str:
        if value.startswith("./missing"):
            raise ValueError(f"{value} does not exist")
        return value


def _parser(model, **kwargs) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="demo")
    add_fields(parser, model, **kwargs)
    return parser


def _help(model, **kwargs) -> str:
    return " ".join(_parser(model, **kwargs).format_help().split())


# ------------------------------------------------------------------ flags and help


def test_flags_are_kebab_case_field_names_unless_the_field_names_its_own():
    assert flag_of(Server, "max_queue_mb") == "--max-queue-mb"
    assert flag_of(Server, "cors_origins") == "--cors-origin"
    assert flag_of(Job, "model") == "MODEL"
    options = {o for a in _parser(Server)._actions for o in a.option_strings}
    assert {"--host", "--port", "--max-queue-mb", "--cors-origin", "--reload"} <= options
    assert "--cors-origins" not in options


def test_help_is_the_description_with_default_and_environment_variable():
    text = _help(Server)
    assert "--port PORT TCP port. (default: 8000; env DEMO_PORT)" in text
    assert "--max-queue-mb N Queue budget in MiB. (default: 1024; env DEMO_MAX_QUEUE_MB)" in text
    assert "--cors-origin ORIGIN" in text and "(default: []; env DEMO_CORS_ORIGINS)" in text
    assert "--log-level {debug,info}" in text
    assert env_var(Server, "token") == "DEMO_TOKEN" and env_var(Job, "steps") is None


def test_a_percent_sign_in_a_description_does_not_break_help():
    assert "Share of 100% of the memory." in _help(Server)


def test_help_shows_computed_and_explained_defaults_in_words():
    text = _help(Job)
    assert "Torch device. (default: cuda when available)" in text
    # a None default the description explains is not followed by "(default: None)"
    assert "Served names; default: MODEL. --roots" in text
    assert "Allowed roots. (default: None)" in text
    assert "MODEL Model directory. options:" in text  # a positional: no "(required)"


def test_a_required_option_says_so():
    class Needs(BaseModel):
        model_name: str = Field(..., description="Policy to train.")

    assert "--model-name MODEL_NAME Policy to train. (required)" in _help(Needs)


# ------------------------------------------------------------------ parsing


def test_flags_not_given_stay_out_so_environment_and_defaults_apply(monkeypatch):
    monkeypatch.setenv("DEMO_PORT", "9100")
    monkeypatch.setenv("DEMO_CORS_ORIGINS", '["http://a"]')
    parser = _parser(Server)
    assert parse_values(parser, []) == {}
    settings = validate(Server, parse_values(parser, []), prog="demo")
    assert (settings.port, settings.cors_origins, settings.host) == (
        9100,
        ["http://a"],
        "127.0.0.1",
    )
    flagged = validate(Server, parse_values(parser, ["--port", "9200"]), prog="demo")
    assert flagged.port == 9200


def test_switches_and_repeated_list_flags():
    values = parse_values(
        _parser(Server), ["--reload", "--cors-origin", "http://a", "--cors-origin", "http://b"]
    )
    assert values == {"reload": True, "cors_origins": ["http://a", "http://b"]}
    with pytest.raises(SystemExit) as info:
        parse_values(_parser(Server), ["--reload", "true"])  # a switch takes no value
    assert info.value.code == 2


def test_bools_with_values_and_lists_after_one_flag(capsys):
    parser = _parser(Job, bools="value", lists="nargs")
    values = parse_values(
        parser, ["/m", "--resume", "false", "--layers", "0", "1", "--roots", "/a"]
    )
    assert values == {"model": "/m", "resume": False, "layers": [0, 1], "roots": ["/a"]}
    assert parse_values(parser, ["/m", "--resume"])["resume"] is True
    with pytest.raises(SystemExit) as info:
        parse_values(parser, ["/m", "--resume", "maybe"])
    assert info.value.code == 2 and "--resume" in capsys.readouterr().err


def test_a_field_marked_nargs_takes_several_values_among_repeated_lists():
    parser = _parser(Job)
    values = parse_values(parser, ["/m", "--names", "a", "b", "--roots", "/x", "--roots", "/y"])
    assert values == {"model": "/m", "names": ["a", "b"], "roots": ["/x", "/y"]}
    # a repeatable list flag does not swallow the positional after it
    assert parse_values(parser, ["--roots", "/x", "/m"]) == {"model": "/m", "roots": ["/x"]}


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--port", "abc"], "--port"),
        (["--log-level", "loud"], "--log-level"),
        (["--no-such-flag"], "--no-such-flag"),
    ],
)
def test_argparse_errors_exit_2_naming_the_flag(argv, needle, capsys):
    with pytest.raises(SystemExit) as info:
        parse_values(_parser(Server), argv)
    assert info.value.code == 2 and needle in capsys.readouterr().err


def test_parse_bool_words():
    assert [parse_bool(w) for w in ("1", "TRUE", "yes", "on", "0", "False", "no", "off")] == [
        True,
        True,
        True,
        True,
        False,
        False,
        False,
        False,
    ]
    with pytest.raises(argparse.ArgumentTypeError):
        parse_bool("maybe")


# ------------------------------------------------------------------ validation


def test_a_value_out_of_bounds_exits_2_with_one_line_naming_flag_and_variable(capsys):
    with pytest.raises(SystemExit) as info:
        validate(Server, {"port": 70000, "max_queue_mb": 0}, prog="demo")
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("demo: error: invalid value: --port (or DEMO_PORT): ")
    assert "--max-queue-mb (or DEMO_MAX_QUEUE_MB): " in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_a_bad_environment_variable_names_the_variable(monkeypatch, capsys):
    monkeypatch.setenv("DEMO_PORT", "eighty")
    with pytest.raises(SystemExit) as info:
        validate(Server, {}, prog="demo")
    assert info.value.code == 2 and "DEMO_PORT" in capsys.readouterr().err


def test_the_rejected_value_is_not_echoed(capsys):
    class Keyed(BaseModel):
        token: str = Field("x", min_length=8, description="Secret.")

    with pytest.raises(SystemExit):
        validate(Keyed, {"token": "s3kr"}, prog="demo")
    err = capsys.readouterr().err
    assert "--token" in err and "s3kr" not in err


def test_validator_messages_and_missing_required_values(capsys):
    with pytest.raises(SystemExit) as info:
        validate(Job, {"model": "./missing"}, prog="demo")
    assert info.value.code == 2
    assert (
        capsys.readouterr().err == "demo: error: invalid value: MODEL: ./missing does not exist\n"
    )
    with pytest.raises(SystemExit) as info:
        validate(Job, {}, prog="demo")
    assert info.value.code == 2
    assert "the following arguments are required: MODEL" in capsys.readouterr().err


# ------------------------------------------------------------------ the commands


def test_every_field_of_each_command_is_one_of_its_flags():
    from atroposlib.api.settings import APISettings
    from atroposlib.cli.run_api import build_parser as run_api_parser
    from atroposlib.cli.serve_model import build_parser as serve_model_parser
    from atroposlib.serving.config import ServeModelConfig
    from example_trainer.cli import build_parser as trainer_parser
    from example_trainer.config import TrainingConfig

    for model, parser in (
        (APISettings, run_api_parser()),
        (ServeModelConfig, serve_model_parser()),
        (TrainingConfig, trainer_parser()),
    ):
        dests = {a.dest for a in parser._actions} - {"help"}
        assert dests == set(model.model_fields), model.__name__


def test_the_launcher_flags_that_set_run_config_fields_are_built_from_them():
    from example_trainer.launch.run_config import RunConfig
    from example_trainer.run import build_parser

    parser = build_parser()
    own = {"help", "config", "training_steps", "no_warmup", "no_eval"}
    fields = {a.dest for a in parser._actions} - own
    assert fields <= set(RunConfig.model_fields)
    by_dest = {a.dest: a for a in parser._actions}
    assert by_dest["envs"].option_strings == ["--env"]
    assert by_dest["group_size"].help.startswith(RunConfig.model_fields["group_size"].description)
