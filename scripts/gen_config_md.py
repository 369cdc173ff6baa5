"""Print CONFIG.md: one table per configuration model, generated from the pydantic models.

Every config field in atroposlib is a pydantic ``Field(default, description=...)``; the same
description is the ``--help`` text. Generating this file from the models keeps the docs from
drifting (``tests/test_config_docs.py`` fails when CONFIG.md is stale).

Usage: ``python scripts/gen_config_md.py > CONFIG.md`` (or ``make config-docs``).
"""

from __future__ import annotations

import enum
import importlib
import os
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

# (section title, "module:Class", how users set it)
MODELS: list[tuple[str, str, str]] = [
    (
        "Environment: `BaseEnvConfig`",
        "atroposlib.envs.base:BaseEnvConfig",
        "`--env.<field>` on an environment's CLI, or the `env:` key of its YAML config.",
    ),
    (
        "Inference server: `APIServerConfig` (alias `OpenaiConfig`)",
        "atroposlib.envs.server_handling.server_baseline:APIServerConfig",
        "`--openai.<field>`, or the `openai:` key (a dict, or a list of dicts for several servers).",
    ),
    (
        "Inference server template: `ServerBaseline`",
        "atroposlib.envs.server_handling.server_baseline:ServerBaseline",
        "Returned by `config_init()` when servers are discovered (SLURM) rather than listed.",
    ),
    (
        "Server manager: `ServerManagerConfig`",
        "atroposlib.envs.server_handling.server_manager:ServerManagerConfig",
        "Un-prefixed flags (`--slurm`, `--testing`, ...) or top-level YAML keys.",
    ),
    (
        "Teacher distillation: `TeacherDistillationConfig`",
        "atroposlib.envs.teacher_distillation_env:TeacherDistillationConfig",
        "`--env.<field>` on a `TeacherDistillationEnv`.",
    ),
    (
        "Code sandbox: `SandboxConfig`",
        "atroposlib.sandbox.config:SandboxConfig",
        "`Sandbox(SandboxConfig(...))` in Python (docs/sandbox.md).",
    ),
    (
        "Code-execution server: `SandboxServerSettings`",
        "atroposlib.sandbox.settings:SandboxServerSettings",
        "`atropos-sandbox-server --<field-with-dashes>`, or `ATROPOS_SANDBOX_<FIELD>`.",
    ),
    (
        "Trainer: `TrainingConfig`",
        "example_trainer.config:TrainingConfig",
        "`atropos-grpo --<field-with-dashes>`.",
    ),
]


def _default(field: Any) -> str:
    if field.default is not PydanticUndefined:
        value = field.default
    elif field.default_factory is not None:
        try:
            value = field.default_factory()
        except TypeError:
            return "(computed)"
        if value != field.default_factory():  # e.g. a random W&B group name
            return "(random)"
    else:
        return "**required**"
    if isinstance(value, enum.Enum):
        value = value.value
    text = repr(value)
    return f"`{text}`" if len(text) < 60 else f"`{text[:57]}...`"


def _type(annotation: Any) -> str:
    text = getattr(annotation, "__name__", None) if isinstance(annotation, type) else None
    text = text or str(annotation).replace("typing.", "")
    return text.replace("|", "\\|")


def table(model: type[BaseModel]) -> str:
    """Markdown table of ``model``'s fields: name, type, default, description."""
    rows = ["| field | type | default | description |", "|---|---|---|---|"]
    for name, field in model.model_fields.items():
        desc = (field.description or "").replace("\n", " ").replace("|", "\\|")
        rows.append(f"| `{name}` | {_type(field.annotation)} | {_default(field)} | {desc} |")
    return "\n".join(rows)


def main() -> None:
    out = [
        "# Configuration reference",
        "",
        "Generated from the pydantic models by `scripts/gen_config_md.py` (`make config-docs`);",
        "do not edit by hand. Precedence for environments: CLI > YAML (`--config`) >",
        "`config_init()` > class defaults.",
        "",
    ]
    for title, path, how in MODELS:
        module_name, cls_name = path.split(":")
        model = getattr(importlib.import_module(module_name), cls_name)
        out += [f"## {title}", "", f"`{path.replace(':', '.')}` — {how}", "", table(model), ""]
    os.environ["COLUMNS"] = "100"  # argparse wraps help to the terminal: keep the output stable
    run_api = importlib.import_module("atroposlib.cli.run_api")
    parser = getattr(run_api, "build_parser", None)
    if parser is not None:
        out += [
            "## Rollout API: `run-api` flags",
            "",
            "```",
            parser().format_help().rstrip(),
            "```",
            "",
        ]
    print("\n".join(out))


if __name__ == "__main__":
    main()
