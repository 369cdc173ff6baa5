"""An on-disk FIFO of scored groups that could not be delivered yet (D10).

Each entry is one JSON file named by a zero-padded sequence number, written to a
temporary name and renamed, so a crash never leaves a half-written entry and the
order survives restarts of the environment process.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Optional, Tuple

logger = logging.getLogger(__name__)

_SUFFIX = ".json"


def default_outbox_dir(env_name: Optional[str]) -> Path:
    """Where an environment keeps its outbox.

    ``$ATROPOS_OUTBOX_DIR/<env>-<pid>`` when that variable is set, otherwise
    ``~/.cache/atroposlib/outbox/<env>-<pid>``.
    """
    root = os.environ.get("ATROPOS_OUTBOX_DIR") or str(Path.home() / ".cache" / "atroposlib" / "outbox")
    return Path(root) / f"{env_name or 'env'}-{os.getpid()}"


class Outbox:
    """A durable FIFO queue of JSON payloads in one directory.

    Example::

        box = Outbox(tmp_path / "outbox")
        box.put({"tokens": [[1]]})
        key, payload = box.peek()
        box.remove(key)
    """

    def __init__(self, directory: "str | Path") -> None:
        self.directory = Path(directory)
        self._keys: list[str] = []
        self._next = 0
        if self.directory.exists():
            self._keys = sorted(p.name for p in self.directory.glob(f"*{_SUFFIX}"))
            if self._keys:
                self._next = int(self._keys[-1][: -len(_SUFFIX)]) + 1
                logger.warning("outbox %s holds %d undelivered groups", self.directory, len(self._keys))

    def __len__(self) -> int:
        return len(self._keys)

    def put(self, payload: Any) -> str:
        """Append ``payload``; returns its key."""
        self.directory.mkdir(parents=True, exist_ok=True)
        key = f"{self._next:012d}{_SUFFIX}"
        self._next += 1
        tmp = self.directory / f".{key}.tmp"
        tmp.write_text(json.dumps(payload, separators=(",", ":")))
        os.replace(tmp, self.directory / key)
        self._keys.append(key)
        return key

    def peek(self) -> Optional[Tuple[str, Any]]:
        """The oldest entry as ``(key, payload)``, or None when empty."""
        if not self._keys:
            return None
        key = self._keys[0]
        return key, json.loads((self.directory / key).read_text())

    def remove(self, key: str) -> None:
        """Delete the entry ``key`` (after it was delivered or definitively rejected)."""
        (self.directory / key).unlink(missing_ok=True)
        self._keys.remove(key)
        if not self._keys and self.directory.exists():
            try:
                self.directory.rmdir()
            except OSError:
                pass
