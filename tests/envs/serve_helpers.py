"""A fake trainer and process launchers for the serve-loop tests and the benchmark."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List

import httpx

ROOT = Path(__file__).resolve().parents[2]
TRIVIAL_ENV = ROOT / "tests" / "envs" / "trivial_env.py"


def api_cmd(port: int, *extra: str) -> List[str]:
    return [
        sys.executable,
        "-m",
        "atroposlib.cli.run_api",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *extra,
    ]


def fake_server_cmd(port: int, latency_ms: int) -> List[str]:
    return [
        sys.executable,
        "-m",
        "atroposlib.testing.fake_server",
        "--port",
        str(port),
        "--latency-ms",
        str(latency_ms),
    ]


def env_cmd(mode: str, api_port: int | None, infer_port: int, *extra: str) -> List[str]:
    cmd = [
        sys.executable,
        str(TRIVIAL_ENV),
        mode,
        "--openai.base_url",
        f"http://127.0.0.1:{infer_port}/v1",
    ]
    if api_port is not None:
        cmd += ["--env.rollout_server_url", f"http://127.0.0.1:{api_port}"]
    return cmd + list(extra)


class FakeTrainer:
    """Registers with the API and pulls batches in a thread, recording every group.

    ``paused`` stops pulling (to let the queue fill up); connection errors (an API
    restart) are retried.
    """

    def __init__(
        self, api_port: int, batch_size: int, num_steps: int, max_token_len: int = 4096
    ) -> None:
        self.url = f"http://127.0.0.1:{api_port}"
        self.batch_size = batch_size
        self.num_steps = num_steps
        self.max_token_len = max_token_len
        self.batches: List[List[dict]] = []
        self.errors = 0
        self.last_batch_id: str | None = None
        self._pull_lock = threading.Lock()
        self.redelivered = 0
        self.paused = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def register(self) -> None:
        body = {
            "wandb_group": "g",
            "wandb_project": "p",
            "batch_size": self.batch_size,
            "max_token_len": self.max_token_len,
            "checkpoint_dir": "",
            "save_checkpoint_interval": -1,
            "starting_step": 0,
            "num_steps": self.num_steps,
        }
        httpx.post(f"{self.url}/register", json=body, timeout=10).raise_for_status()
        self.pull_once()  # the first /batch lets environments register

    def pull_once(self) -> bool:
        """One ``/batch`` call that acknowledges the last batch received (D19).

        After an API restart the unacknowledged batch is served again; it carries the
        ``batch_id`` already seen and is skipped, as the trainer's client does. One call at
        a time (``drain`` may run beside the pulling thread): two calls sending the same
        ``ack`` would both receive the next batch.
        """
        with self._pull_lock:
            return self._pull_locked()

    def _pull_locked(self) -> bool:
        response = httpx.get(
            f"{self.url}/batch", params={"ack": self.last_batch_id or ""}, timeout=10
        )
        response.raise_for_status()
        answer = response.json()
        batch = answer.get("batch")
        if not batch:
            return False
        batch_id = answer.get("batch_id")
        if batch_id is not None and batch_id == self.last_batch_id:
            self.redelivered += 1
            return True
        assert sum(len(g["tokens"]) for g in batch) == self.batch_size
        self.batches.append(batch)
        self.last_batch_id = batch_id
        return True

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.paused.is_set():
                time.sleep(0.05)
                continue
            try:
                if not self.pull_once():
                    time.sleep(0.02)
            except httpx.HTTPError:
                self.errors += 1
                time.sleep(0.1)

    def start(self) -> FakeTrainer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def drain(self, timeout: float = 10.0) -> None:
        """Pull until no full batch is left."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if not self.pull_once():
                    return
            except httpx.HTTPError:
                time.sleep(0.1)

    def group_ids(self) -> List[int]:
        return [g["tokens"][0][0] for batch in self.batches for g in batch]

    def queue_size(self) -> int:
        return int(httpx.get(f"{self.url}/status", timeout=10).json()["queue_size"])


def produced_ids(path: Path) -> List[int]:
    """Group ids the env wrote to its jsonl (one line per produced group).

    Later runs with the same path write ``<stem>_1.jsonl`` and so on; those count too.
    """
    ids = []
    for part in sorted(path.parent.glob(f"{path.stem}*{path.suffix}")):
        for line in part.read_text().splitlines():
            group: Dict = json.loads(line)
            ids.append(group["tokens"][0][0])
    return ids
