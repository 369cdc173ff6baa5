"""Run the command blocks of a markdown page against real processes, as a reader would.

A page's fenced ``bash``/``sh``/``shell`` blocks run in order, in one working directory,
each in a fresh ``bash`` that sees the variables the earlier blocks set (``MODEL=...``).
The line before a block may hold a marker, an HTML comment the rendered page hides but
its source shows::

    <!-- docs-test: background http://127.0.0.1:9001/health -->   a server: start it, wait
                                                                  until the URL answers
    <!-- docs-test: skip needs the internet (Hugging Face dataset) -->   not run; the reason
                                                                  is required
    <!-- docs-test: file repeat_env.py -->                        (a python block) appended
                                                                  to that file

Every other shell block must exit 0 within its time limit; a block that cannot run gets
a marker saying why, or the test fails. Ports the docs use (8000, 9001, 7860) are mapped to
free ones, so the run never collides with servers already on the machine, and a bare
``run-api`` / ``view-run`` gets the mapped ``--port``. Everything started is stopped at the end.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List

import httpx

from atroposlib.testing.ports import free_port

SHELL_LANGS = {"bash", "sh", "shell"}
DOC_PORTS = (8000, 9001, 7860)
_FENCE = re.compile(r"^```([\w-]*)\s*$")
_MARKER = re.compile(r"^<!--\s*docs-test:\s*(\w+)\s*(.*?)\s*-->\s*$")
_KINDS = {"background", "skip", "file"}


@dataclass
class Block:
    """One fenced block of a page, with the marker on the line before it."""

    source: Path
    line: int
    lang: str
    text: str
    kind: str | None = None
    arg: str = ""

    @property
    def where(self) -> str:
        return f"{self.source.name}:{self.line}"


def parse_blocks(path: Path) -> List[Block]:
    """The fenced blocks of ``path`` in order; raises ValueError on a malformed marker."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: List[Block] = []
    i = 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        start = i
        body: List[str] = []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i])
            i += 1
        block = Block(path, start + 1, fence.group(1).lower(), "\n".join(body) + "\n")
        prev = start - 1
        while prev >= 0 and not lines[prev].strip():
            prev -= 1
        if prev >= 0 and "docs-test" in lines[prev]:
            marker = _MARKER.match(lines[prev].strip())
            if marker is None or marker.group(1) not in _KINDS:
                raise ValueError(f"{path.name}:{prev + 1}: malformed marker {lines[prev]!r}")
            block.kind, block.arg = marker.group(1), marker.group(2)
            if block.kind in ("skip", "file", "background") and not block.arg:
                raise ValueError(f"{path.name}:{prev + 1}: '{block.kind}' needs an argument")
        blocks.append(block)
        i += 1
    return blocks


@dataclass
class DocRun:
    """Runs a page's blocks in ``workdir``; use as a context manager (stops what it started)."""

    workdir: Path
    env: Dict[str, str] = field(default_factory=dict)
    timeout: float = 180.0
    ports: Dict[int, int] = field(default_factory=dict)
    started: List[subprocess.Popen] = field(default_factory=list)
    ran: List[str] = field(default_factory=list)
    skipped: List[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.ports = self.ports or {p: free_port() for p in DOC_PORTS}
        self.state = self.workdir / ".docs-test-state.sh"
        venv_bin = str(Path(sys.executable).parent)
        base = dict(os.environ)
        base.update(
            {
                "PATH": venv_bin + os.pathsep + base.get("PATH", ""),
                "PYTHONUNBUFFERED": "1",
                "WANDB_MODE": "disabled",
                "HF_HUB_OFFLINE": "1",
                "ATROPOS_OUTBOX_DIR": str(self.workdir / ".outbox"),
            }
        )
        base.update(self.env)
        self.env = base

    # -- text rewriting --------------------------------------------------------------------

    def rewrite(self, text: str) -> str:
        """Map the documented ports to this run's free ones; give bare servers a ``--port``."""
        for doc_port, port in self.ports.items():
            text = re.sub(rf"(?<![\d.]){doc_port}(?!\d)", str(port), text)
        out = []
        for line in text.splitlines():
            command = line.split("#", 1)[0]
            for tool, doc_port in (("run-api", 8000), ("view-run", 7860)):
                if re.match(rf"^\s*{tool}(\s|$)", command) and "--port" not in command:
                    line = re.sub(
                        rf"^(\s*{tool})", rf"\1 --port {self.ports[doc_port]}", line, count=1
                    )
            out.append(line)
        return "\n".join(out) + "\n"

    def url(self, text: str) -> str:
        return self.rewrite(text).strip()

    # -- running -------------------------------------------------------------------------

    def _script(self, block: Block, save_state: bool) -> str:
        prelude = (
            f"set -a\n[ -f {self.state} ] && . {self.state}\nset -eo pipefail\ncd {self.workdir}\n"
        )
        tail = f"\nexport -p > {self.state}.new && mv {self.state}.new {self.state}\n"
        return prelude + self.rewrite(block.text) + (tail if save_state else "")

    def _log(self, block: Block) -> Path:
        return self.workdir / f".docs-test-{block.source.stem}-{block.line}.log"

    def run_block(self, block: Block) -> None:
        """Run (or record the skip of) one block; raise AssertionError on failure."""
        if block.kind == "skip":
            self.skipped.append(f"{block.where} ({block.arg})")
            return
        if block.kind == "file":
            target = self.workdir / block.arg
            existing = target.read_text() if target.exists() else ""
            target.write_text(existing + ("\n\n" if existing else "") + block.text)
            self.ran.append(block.where)
            return
        if block.lang not in SHELL_LANGS:
            return
        log = self._log(block)
        if block.kind == "background":
            proc = self._popen(self._script(block, save_state=False), log)
            self.started.append(proc)
            self._wait_url(self.url(block.arg), proc, log, block)
            self.ran.append(block.where)
            return
        proc = self._popen(self._script(block, save_state=True), log)
        self.started.append(proc)  # a block may leave servers behind with '&'
        try:
            code = proc.wait(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{block.where}: still running after {self.timeout:.0f}s; mark a server block "
                f"'<!-- docs-test: background URL -->'\n{self._tail(log)}"
            ) from None
        if code != 0:
            raise AssertionError(f"{block.where}: exit code {code}\n{self._tail(log)}")
        self.ran.append(block.where)

    def run_page(self, path: Path) -> None:
        """Run every block of a page; an unmarked block that fails fails the test."""
        for block in parse_blocks(path):
            self.run_block(block)

    def output(self, block: Block) -> str:
        """What a block printed (stdout and stderr)."""
        return self._log(block).read_text(errors="replace")

    def _popen(self, script: str, log: Path) -> subprocess.Popen:
        with open(log, "wb") as out:
            return subprocess.Popen(
                ["bash", "-c", script],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.workdir,
                start_new_session=True,
            )

    def _wait_url(self, url: str, proc: subprocess.Popen, log: Path, block: Block) -> None:
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise AssertionError(
                    f"{block.where}: server exited with {proc.returncode}\n{self._tail(log)}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url, timeout=2).status_code < 500:
                    return
            time.sleep(0.2)
        raise AssertionError(f"{block.where}: {url} did not answer\n{self._tail(log)}")

    @staticmethod
    def _tail(log: Path) -> str:
        """The first warnings and errors of a block's output, then its last 3,000 characters."""
        if not log.exists():
            return ""
        text = log.read_text(errors="replace")
        alerts = [ln for ln in text.splitlines() if " WARNING " in ln or " ERROR " in ln][:10]
        head = "first warnings/errors:\n" + "\n".join(alerts) + "\n---\n" if alerts else ""
        return head + text[-3000:]

    def stop(self) -> None:
        for proc in reversed(self.started):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.started:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)

    def __enter__(self) -> DocRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def iter_shell_blocks(path: Path) -> Iterator[Block]:
    """The shell blocks of a page (what the docs tests must run or see marked)."""
    return (b for b in parse_blocks(path) if b.lang in SHELL_LANGS)
