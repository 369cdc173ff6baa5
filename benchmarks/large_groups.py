"""Large groups through ``run-api``: ingest and ``/batch`` of 16 x 32k-token groups.

Each group carries what an environment's ``ScoredData`` carries for an agentic
rollout: ``tokens``, ``masks`` (prompt half masked with -100) and
``inference_logprobs`` for 16 sequences of 32,768 tokens (about 10 MB of JSON).
``run-api`` runs as a real process (uvicorn, as in ``api_bench.py``, whose
client and helpers this script imports); the groups are posted to
``/scored_data`` from ready-made requests, then drained with ``/batch`` by a
trainer whose batch holds two groups (32 sequences). Printed per run, with and
without ``--persist``, and for a typical small group (8 x 256) for reference:

- server CPU per MB posted (user + sys from ``/proc`` of the server, delta over
  the phase, divided by the MB of JSON posted), for ingest and for ``/batch``;
- wall MB/s of ingest and of the drain;
- peak RSS of the server (``VmHWM`` of ``/proc/<pid>/status``).

    .venv/bin/python benchmarks/large_groups.py                # 3 repeats of each case
    .venv/bin/python benchmarks/large_groups.py --repeats 5 --groups 12
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Dict, List

import orjson
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

from api_bench import (  # noqa: E402
    Connection,
    _json,
    blast,
    cpu_seconds,
    drain,
    http_request,
    make_group,
    start_server,
)

from atroposlib.testing.launch import run_api_cmd  # noqa: E402
from atroposlib.testing.ports import free_port  # noqa: E402

MB = 1024 * 1024

CASES = {
    # name: (group_size, seq_len, batch_size in sequences, max_token_len)
    "large 16x32k": (16, 32768, 32, 32768),
    "small 8x256": (8, 256, 64, 2048),
}


def vm_hwm(pid: int) -> int:
    """Peak resident set size (``VmHWM``) of ``pid`` in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM for pid {pid}")


def setup(conn: Connection, port: int, group_size: int, batch: int, max_len: int) -> int:
    """Reset, register a trainer (``batch`` sequences, ``max_len`` tokens) and one env."""
    conn.request(http_request("GET", "/reset_data", port))
    trainer = {
        "wandb_group": "bench",
        "wandb_project": "bench",
        "batch_size": batch,
        "max_token_len": max_len,
        "checkpoint_dir": "ckpt",
        "save_checkpoint_interval": 100,
        "starting_step": 0,
        "num_steps": 10**6,
    }
    _json(conn, http_request("POST", "/register", port, orjson.dumps(trainer)))
    _json(conn, http_request("GET", "/batch", port))
    env = {"max_token_length": max_len, "desired_name": "bench", "weight": 1.0}
    body = orjson.dumps({**env, "group_size": group_size})
    return _json(conn, http_request("POST", "/register-env", port, body))["env_id"]


def one_run(case: str, persist: bool, groups: int, bodies: List[bytes]) -> Dict[str, float]:
    """Start ``run-api``, post ``groups`` groups, drain them; the figures."""
    group_size, _, batch, max_len = CASES[case]
    port = free_port()
    cmd = run_api_cmd(port, "--log-level", "warning")
    with tempfile.TemporaryDirectory() as tmp:
        if persist:
            cmd += ["--persist", str(Path(tmp) / "api.db")]
        with start_server(cmd, port) as proc:
            server = psutil.Process(proc.pid)
            conn = Connection(port)
            setup(conn, port, group_size, batch, max_len)
            posts = [http_request("POST", "/scored_data", port, b) for b in bodies]
            mb = sum(len(bodies[i % len(bodies)]) for i in range(groups)) / MB
            p = blast(port, server, posts, groups, 1, 2)
            if p.failures:
                raise RuntimeError(f"{p.failures} posts failed")
            cpu0 = cpu_seconds(server)
            d = drain(conn, port, server, gzip=False)
            drain_cpu = cpu_seconds(server) - cpu0
            expected = groups * group_size // batch
            if d.n != expected:
                raise RuntimeError(f"drained {d.n} batches, expected {expected}")
            hwm = vm_hwm(proc.pid)
            conn.close()
    return {
        "mb": mb,
        "ingest_cpu_s_per_mb": p.server_cpu / mb,
        "ingest_mb_s": mb / p.wall,
        "batch_cpu_s_per_mb": drain_cpu / mb,
        "batch_mb_s": mb / d.wall,
        "peak_rss_mb": hwm / MB,
    }


def summary(values: List[float], fmt: str) -> str:
    """``median (min-max)``."""
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--groups", type=int, default=8, help="large groups per run")
    ap.add_argument("--small-groups", type=int, default=1000, help="small groups per run")
    args = ap.parse_args()
    rng = random.Random(0)
    print(f"load average at start: {os.getloadavg()}")
    for case in CASES:
        group_size, seq_len, _, _ = CASES[case]
        bodies = [make_group(rng, group_size, seq_len, 0, logprobs=True) for _ in range(4)]
        groups = args.groups if seq_len > 1000 else args.small_groups
        for persist in (False, True):
            runs = [one_run(case, persist, groups, bodies) for _ in range(args.repeats)]
            label = f"{case}{' --persist' if persist else ''}"
            print(
                f"{label}: {groups} groups of {len(bodies[0]) / MB:.2f} MB, "
                f"{args.repeats} runs, median (range); load {os.getloadavg()[0]:.1f}"
            )
            for key, fmt in (
                ("ingest_cpu_s_per_mb", "{:.4f}"),
                ("ingest_mb_s", "{:.1f}"),
                ("batch_cpu_s_per_mb", "{:.4f}"),
                ("batch_mb_s", "{:.1f}"),
                ("peak_rss_mb", "{:.0f}"),
            ):
                print(f"  {key:22s} {summary([r[key] for r in runs], fmt)}")


if __name__ == "__main__":
    main()
