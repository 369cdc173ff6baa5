"""The policy version of a weights directory, written by the trainer beside the weights.

A server restarted on a checkpoint (``weight_bridge_mode=none``) would otherwise report
version 0 again, and every rollout after the restart would look many steps stale. The
trainer writes ``atropos_policy_version.json`` (``{"version": STEP}``) into each directory
it serves; ``atropos-serve-model`` starts at that version and adopts it on
``/update_weights`` when the request names none (and it is above the served version).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

WEIGHTS_VERSION_FILE = "atropos_policy_version.json"


def read_weights_version(path: str | os.PathLike[str]) -> int | None:
    """The version recorded in the weights directory ``path``, or None (no file, not a
    directory, unreadable: logged)."""
    target = Path(path) / WEIGHTS_VERSION_FILE
    try:
        if not target.is_file():  # raises for some paths (a component over NAME_MAX)
            return None
        version = json.loads(target.read_text()).get("version")
    except (OSError, ValueError, AttributeError) as exc:
        logger.warning("ignoring unreadable %s: %s", target, exc)
        return None
    return version if isinstance(version, int) and not isinstance(version, bool) else None


def write_weights_version(path: str | os.PathLike[str], version: int) -> None:
    """Record ``version`` for the weights directory ``path``."""
    (Path(path) / WEIGHTS_VERSION_FILE).write_text(json.dumps({"version": int(version)}))
