"""Peak RSS of ``run-api`` receiving one large valid group (issue: "one 52 MB group").

Starts ``run-api`` (in memory, or ``--persist``), reads its peak RSS (``VmHWM``
from ``/proc/PID/status``) after start-up, posts one valid group of about
``--mb`` MB of JSON, then serves it with ``/batch``, and prints the peak RSS
growth as a multiple of the group's size. The server's figure is read from
``/proc``, so the load of the machine does not change it.

    .venv/bin/python benchmarks/api_bigpost_rss.py --mb 52 [--persist]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from atroposlib.testing.launch import run_api_cmd  # noqa: E402
from atroposlib.testing.ports import free_port  # noqa: E402
from atroposlib.testing.processes import running_process  # noqa: E402


def _hwm_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError("no VmHWM")


def _big_group(mb: float, group_size: int = 8) -> bytes:
    # Token ids of 5-6 digits, as real vocabularies give, masks equal to the tokens.
    per_seq = int(mb * 1e6 / group_size / 2 / 7)
    tokens = [[100000 + (i * 7919 + j) % 50000 for j in range(per_seq)] for i in range(group_size)]
    body = {"tokens": tokens, "masks": tokens, "scores": [1.0] * group_size}
    return json.dumps(body, separators=(",", ":")).encode()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=52)
    p.add_argument("--persist", action="store_true")
    args = p.parse_args()
    body = _big_group(args.mb)
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        flags = ["--max-request-mb", str(int(len(body) / 2**20) + 8)]
        flags += ["--max-queue-mb", str(int(len(body) / 2**20) * 4 + 64)]
        if args.persist:
            flags += ["--persist", str(Path(tmp) / "api.db")]
        cmd = run_api_cmd(port, "--log-level", "warning")
        with (
            running_process(
                cmd + flags,
                health_url=f"http://127.0.0.1:{port}/health",
                log_path=Path(tmp) / "log",
            ) as proc,
            httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300) as c,
        ):
            reg = {
                "wandb_group": "g",
                "wandb_project": "p",
                "batch_size": 8,
                "max_token_len": 10**7,
                "checkpoint_dir": "c",
                "save_checkpoint_interval": 1,
                "starting_step": 0,
                "num_steps": 1,
            }
            c.post("/register", json=reg)
            c.get("/batch")
            base = _hwm_kib(proc.pid)
            r = c.post("/scored_data", content=body, headers={"Content-Type": "application/json"})
            assert r.status_code == 200, r.text
            after_post = _hwm_kib(proc.pid)
            served = c.get("/batch", headers={"Accept-Encoding": "identity"})
            assert served.status_code == 200 and len(served.content) >= len(body)
            after_batch = _hwm_kib(proc.pid)
    size_mib = len(body) / 2**20
    print(f"group JSON                 {size_mib:.1f} MiB")
    print(f"peak RSS after start-up    {base / 1024:.1f} MiB")
    grow_post = (after_post - base) / 1024
    grow_all = (after_batch - base) / 1024
    print(f"peak RSS growth, post      {grow_post:.1f} MiB = {grow_post / size_mib:.1f}x the group")
    print(f"peak RSS growth, + /batch  {grow_all:.1f} MiB = {grow_all / size_mib:.1f}x the group")


if __name__ == "__main__":
    main()
