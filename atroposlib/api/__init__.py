"""The rollout API service: environments post scored groups, the trainer pulls batches.

``app`` (for ``uvicorn atroposlib.api:app``) is built on first access from
``ATROPOS_*`` environment variables; ``create_app(settings)`` builds one explicitly.
"""

from __future__ import annotations

from typing import Any

from atroposlib.api.server import create_app
from atroposlib.api.settings import APISettings
from atroposlib.api.store import RolloutStore

__all__ = ["APISettings", "RolloutStore", "app", "create_app"]


def __getattr__(name: str) -> Any:
    if name == "app":  # one lazily built instance, shared with ``atroposlib.api.server.app``
        from atroposlib.api import server

        return server.app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
