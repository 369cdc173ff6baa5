"""An on-disk FIFO of scored groups that could not be delivered yet (docs/design.md, "Delivery guarantee").

Each entry is one JSON file named by a zero-padded sequence number, written to a
temporary name and renamed, so a crash never leaves a half-written entry and the
order survives restarts of the environment process.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Tuple

logger = logging.getLogger(__name__)

_SUFFIX = ".json"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def default_outbox_dir(env_name: str | None) -> Path:
    """Where an environment keeps its outbox.

    ``$ATROPOS_OUTBOX_DIR/<env>-<pid>`` when that variable is set, otherwise
    ``~/.cache/atroposlib/outbox/<env>-<pid>``.
    """
    root = os.environ.get("ATROPOS_OUTBOX_DIR") or str(
        Path.home() / ".cache" / "atroposlib" / "outbox"
    )
    return Path(root) / f"{env_name or 'env'}-{os.getpid()}"


class Outbox:
    """A durable FIFO queue of JSON payloads in one directory.

    Example::

        box = Outbox(tmp_path / "outbox")
        box.put({"tokens": [[1]]})
        key, payload = box.peek()
        box.remove(key)
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self._keys: list[str] = []
        self._next = 0
        if self.directory.exists():
            self._keys = sorted(p.name for p in self.directory.glob(f"*{_SUFFIX}"))
            if self._keys:
                self._next = int(self._keys[-1].split(".", 1)[0]) + 1
                logger.warning(
                    "outbox %s holds %d undelivered groups", self.directory, len(self._keys)
                )

    def adopt_orphans(self, root: str | Path, prefix: str) -> int:
        """Take over the entries of ``<root>/<prefix>-<pid>`` outboxes whose process is gone.

        A previous run of the same environment that stopped with undelivered groups
        left them there; they are appended here in their original order (oldest
        outbox first) and re-sent by this process. Returns how many were adopted.
        """
        root = Path(root)
        if not root.is_dir():
            return 0
        orphans = []
        for folder in root.glob(f"{prefix}-*"):
            pid_text = folder.name[len(prefix) + 1 :]
            if folder == self.directory or not pid_text.isdigit() or _pid_alive(int(pid_text)):
                continue
            orphans.append((folder.stat().st_mtime, folder))
        adopted = 0
        for _, folder in sorted(orphans):
            for entry in sorted(folder.glob(f"*{_SUFFIX}")):
                self.put(json.loads(entry.read_text()))
                entry.unlink()
                adopted += 1
            try:
                folder.rmdir()
            except OSError:
                logger.warning("could not remove old outbox %s", folder)
        if adopted:
            logger.warning("adopted %d undelivered groups from earlier runs", adopted)
        return adopted

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

    def peek(self) -> Tuple[str, Any] | None:
        """The oldest entry as ``(key, payload)``, or None when empty."""
        if not self._keys:
            return None
        key = self._keys[0]
        return key, json.loads((self.directory / key).read_text())

    def split(self, key: str, payloads: list) -> None:
        """Replace entry ``key`` by ``payloads``, one entry each, keeping its place in line.

        Only whole entries (``<n>.json``) are split; the parts are ``<n>.<i>.json``.
        """
        stem = key.split(".", 1)[0]
        index = self._keys.index(key)
        new_keys = []
        for i, payload in enumerate(payloads):
            sub = f"{stem}.{i:04d}{_SUFFIX}"
            tmp = self.directory / f".{sub}.tmp"
            tmp.write_text(json.dumps(payload, separators=(",", ":")))
            os.replace(tmp, self.directory / sub)
            new_keys.append(sub)
        (self.directory / key).unlink(missing_ok=True)
        self._keys[index : index + 1] = new_keys

    def remove(self, key: str) -> None:
        """Delete the entry ``key`` (after it was delivered or definitively rejected)."""
        (self.directory / key).unlink(missing_ok=True)
        self._keys.remove(key)
        if not self._keys and self.directory.exists():
            try:
                self.directory.rmdir()
            except OSError:
                pass
