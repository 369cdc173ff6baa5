"""Settings of ``atropos-sandbox-server``; each field is a flag and its description the help
(see :mod:`atroposlib.utils.settings_cli`). ``ATROPOS_SANDBOX_*`` variables set them too."""

from __future__ import annotations

from typing import Annotated, List, Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from atroposlib.sandbox.config import SandboxConfig
from atroposlib.utils.settings_cli import Cli

__all__ = ["SandboxServerSettings"]


class SandboxServerSettings(BaseSettings):
    """Configuration of one ``atropos-sandbox-server`` process."""

    model_config = SettingsConfigDict(env_prefix="ATROPOS_SANDBOX_", extra="ignore")

    host: str = Field(
        "127.0.0.1",
        description="Address to bind. 0.0.0.0 accepts remote clients (then set an API key).",
    )
    port: int = Field(5002, ge=0, le=65535, description="TCP port to listen on.")
    api_key: Annotated[str | None, Cli(metavar="KEY")] = Field(
        None,
        description="Require 'Authorization: Bearer KEY' on /execute. Visible in `ps`: prefer "
        "$ATROPOS_SANDBOX_API_KEY or --api-key-file.",
    )
    api_key_file: Annotated[str | None, Cli(metavar="PATH")] = Field(
        None, description="Read the API key from this file (the key alone; white space ignored)."
    )
    cors_origin: Annotated[List[str] | None, Cli(metavar="ORIGIN")] = Field(
        None,
        description="Origin (scheme://host:port) whose browser requests are accepted; "
        "repeatable. Other Origins get 403.",
    )
    max_request_mb: Annotated[float, Cli(metavar="N")] = Field(
        4, gt=0, description="Largest request body in MiB (413 above)."
    )
    timeout_s: Annotated[float, Cli(metavar="S")] = Field(
        5.0, gt=0, le=3600, description="Wall-clock deadline of one execution in seconds."
    )
    memory_mb: Annotated[int, Cli(metavar="N")] = Field(
        512, ge=32, description="Address space of each sandboxed process in MiB."
    )
    max_processes: Annotated[int, Cli(metavar="N")] = Field(
        32, ge=2, description="Processes and threads one execution may hold at once."
    )
    max_output_kb: Annotated[int, Cli(metavar="N")] = Field(
        1024, ge=1, description="KiB kept of stdout and of stderr each; beyond, the run is killed."
    )
    max_concurrency: Annotated[int | None, Cli(metavar="N")] = Field(
        None, ge=1, description="Executions running at once; default: twice the CPU count."
    )
    max_waiting: Annotated[int, Cli(metavar="N")] = Field(
        256,
        ge=0,
        description="Requests allowed to wait for a free slot; beyond, 503 with Retry-After.",
    )
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field(
        "info", description="Log level of the server and uvicorn."
    )

    def sandbox_config(self) -> SandboxConfig:
        """The :class:`SandboxConfig` every execution runs under."""
        return SandboxConfig(
            timeout_s=self.timeout_s,
            memory_mb=self.memory_mb,
            max_processes=self.max_processes,
            max_output_bytes=self.max_output_kb << 10,
            max_input_bytes=int(self.max_request_mb * 2**20),
        )
