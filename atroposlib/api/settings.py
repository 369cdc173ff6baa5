"""Settings of the rollout API server; each field is a ``run-api`` flag and its description
that flag's ``--help`` text (see :mod:`atroposlib.utils.settings_cli`).

Values come from ``run-api`` flags, then ``ATROPOS_*`` environment variables (e.g.
``ATROPOS_API_KEY``, ``ATROPOS_PERSIST``; the only source for ``uvicorn atroposlib.api:app``),
then the defaults.
"""

from __future__ import annotations

from typing import Annotated, List

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from atroposlib.utils.settings_cli import Cli

__all__ = ["APISettings"]


class APISettings(BaseSettings):
    """Configuration of one ``run-api`` process."""

    model_config = SettingsConfigDict(env_prefix="ATROPOS_", extra="ignore")

    host: str = Field(
        "127.0.0.1", description="Address to bind. Use 0.0.0.0 to accept remote environments."
    )
    port: int = Field(8000, ge=0, le=65535, description="TCP port to listen on.")
    reload: bool = Field(
        False, description="Restart the server when the code changes (development)."
    )
    persist: Annotated[str | None, Cli(metavar="PATH")] = Field(
        None,
        description="SQLite file keeping queue, envs, registration and step across restarts (WAL mode).",
    )
    api_key: Annotated[str | None, Cli(metavar="KEY")] = Field(
        None,
        description="Require 'Authorization: Bearer KEY' on every endpoint but / and /health. "
        "A key on the command line shows in `ps`: prefer ATROPOS_API_KEY or --api-key-file.",
    )
    api_key_file: Annotated[str | None, Cli(metavar="PATH")] = Field(
        None, description="Read the API key from this file (the key alone; white space ignored)."
    )
    persist_recover: bool = Field(
        False,
        description="Start from a damaged --persist database: salvage every readable group into "
        "a fresh database (the damaged files are kept beside it) and report how many.",
    )
    max_buffer_mb: Annotated[float, Cli(metavar="N")] = Field(
        64,
        gt=0,
        description="Bound of the odd-sized group buffers in MiB (at most half of --max-queue-mb); "
        "beyond it the oldest buffered group is released onto the queue (when its size divides "
        "the group size) or dropped, logged and counted.",
    )
    env_timeout: Annotated[float, Cli(metavar="S")] = Field(
        300,
        ge=0,
        description="Seconds without a post after which an env stops counting for "
        "min_batch_allocation (until it posts again); 0 never.",
    )
    max_inflight_mb: Annotated[float, Cli(metavar="N")] = Field(
        512,
        gt=0,
        description="Bound on the request bodies being received or processed at once, in MiB, "
        "counting the bytes actually received (not declared lengths); beyond it requests get "
        "503 with Retry-After.",
    )
    body_timeout: Annotated[float, Cli(metavar="S")] = Field(
        30,
        ge=0,
        description="Seconds a request body may go without receiving a byte; a stalled body is "
        "dropped with 408 and its share of --max-inflight-mb freed; 0 never.",
    )
    max_queue_mb: Annotated[float, Cli(metavar="N")] = Field(
        1024,
        gt=0,
        description="Queue budget in MiB; above it /scored_data answers 503 with Retry-After.",
    )
    max_request_mb: Annotated[float, Cli(metavar="N")] = Field(
        256, gt=0, description="Largest accepted request body in MiB (413 above)."
    )
    pack_above_mb: Annotated[float, Cli(metavar="N")] = Field(
        4,
        ge=0,
        description="Without --persist, queued JSON beyond this many MiB is kept LZ4-compressed in "
        "memory (about 2x smaller, ~13 microseconds per 26 KiB group); 0 packs every group.",
    )
    cors_origins: Annotated[List[str], Cli(flag="--cors-origin")] = Field(
        default_factory=list, description="Origins allowed by CORS (repeatable); none by default."
    )
    gzip_level: int = Field(
        1,
        ge=1,
        le=9,
        description="gzip level of responses of 1000 bytes or more (1 is fastest; levels 1-3 "
        "use ISA-L when the isal package is installed, higher levels zlib).",
    )
    log_level: Annotated[str, Cli(choices=("debug", "info", "warning", "error"))] = Field(
        "info", description="Log level: debug, info, warning or error."
    )
    access_log: bool = Field(False, description="Log every request (costs throughput).")
    strict_groups: bool = Field(
        False,
        description="Answer 422 for groups whose advantages, ref_logprobs or inference_logprobs "
        "lengths differ from tokens (by default they are accepted, as by the original API, "
        "warned about once per env and counted in atropos_inconsistent_groups_total).",
    )

    max_staleness: Annotated[int | None, Cli(metavar="K")] = Field(
        None,
        ge=0,
        description="Drop groups whose policy_version is more than K trainer steps behind when "
        "a batch is formed (logged, counted per env in /metrics); off by default, as in the "
        "original. Groups without a policy_version are never dropped.",
    )

    @property
    def max_queue_bytes(self) -> int:
        """``max_queue_mb`` in bytes."""
        return int(self.max_queue_mb * 1024 * 1024)

    @property
    def pack_above_bytes(self) -> int:
        """``pack_above_mb`` in bytes."""
        return int(self.pack_above_mb * 1024 * 1024)

    @property
    def max_buffer_bytes(self) -> int:
        """``max_buffer_mb`` in bytes."""
        return int(self.max_buffer_mb * 1024 * 1024)

    @property
    def max_inflight_bytes(self) -> int:
        """``max_inflight_mb`` in bytes."""
        return int(self.max_inflight_mb * 1024 * 1024)

    @property
    def max_request_bytes(self) -> int:
        """``max_request_mb`` in bytes."""
        return int(self.max_request_mb * 1024 * 1024)
