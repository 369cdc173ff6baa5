"""Fan-in of many environment clients into one ``run-api`` (a real process, uvicorn).

Each simulated environment (an asyncio task on its own keep-alive connection)
registers with ``/register-env``, then polls ``/status-env`` every
``--poll-s`` seconds and posts a group (8 x 256 tokens with logprobs, 26 KiB of
JSON, prepared before the clock starts) to ``/scored_data`` every ``--post-s``
seconds, each with a random phase so the load is spread; a trainer task drains
``/batch``. The client count ramps (``--clients 100,300,1000``); for each step
the script prints the requests served per second against the rate offered,
p50/p99 latency of ``/status-env`` and of posts, the server's CPU share
(its CPU seconds from ``/proc`` over the wall seconds; 100 % = one core), the
client's CPU share (it shares the machine) and errors, with the load average.
One run-api keeps up while served ~= offered and the p99 stays small; the
step where served falls behind or the server's CPU share reaches ~100 % is
where it stops.

    .venv/bin/python benchmarks/fan_in.py                         # 100, 300, 1000 clients
    .venv/bin/python benchmarks/fan_in.py --clients 1000,2000 --seconds 30
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List

import orjson
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

from api_bench import cpu_seconds, http_request, make_group, start_server  # noqa: E402

from atroposlib.testing.launch import run_api_cmd  # noqa: E402
from atroposlib.testing.ports import free_port  # noqa: E402


class AsyncConnection:
    """One keep-alive HTTP/1.1 connection sending ready-made requests (``Content-Length`` framed)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, port: int) -> AsyncConnection:
        return cls(*await asyncio.open_connection("127.0.0.1", port))

    async def request(self, raw: bytes) -> tuple[int, bytes]:
        """Send ``raw`` and read the whole response: ``(status, body)``."""
        self.writer.write(raw)
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        length = 0
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        body = await self.reader.readexactly(length) if length else b""
        return int(lines[0].split()[1]), body

    def close(self) -> None:
        self.writer.close()


@dataclass
class Stats:
    """Latencies (seconds) and counts of one ramp step."""

    status: List[float] = field(default_factory=list)
    posts: List[float] = field(default_factory=list)
    errors: int = 0
    batches: int = 0
    codes: Dict[str, int] = field(default_factory=dict)
    """What each error was: a status code (``"POST 503"``) or an exception name."""

    def error(self, what: str) -> None:
        self.errors += 1
        self.codes[what] = self.codes.get(what, 0) + 1


async def env_client(
    port: int, bodies: List[bytes], args: argparse.Namespace, stats: Stats, stop: float
) -> None:
    """One environment: register, then poll and post on its schedule until ``stop``."""
    conn = await AsyncConnection.open(port)
    env = {"max_token_length": 2048, "desired_name": "fan", "weight": 1.0, "group_size": 8}
    status, body = await conn.request(
        http_request("POST", "/register-env", port, orjson.dumps(env))
    )
    if status != 200:
        stats.error(f"register {status}")
        conn.close()
        return
    env_id = orjson.loads(body)["env_id"]
    poll = http_request("GET", f"/status-env?env_id={env_id}", port)
    rng = random.Random(env_id)
    next_poll = time.monotonic() + rng.random() * args.poll_s
    next_post = time.monotonic() + rng.random() * args.post_s
    while True:
        now = time.monotonic()
        due = min(next_poll, next_post)
        if due >= stop:
            break
        if due > now:
            await asyncio.sleep(due - now)
        try:
            if next_poll <= next_post:
                t0 = time.perf_counter()
                status, _ = await conn.request(poll)
                stats.status.append(time.perf_counter() - t0)
                next_poll += args.poll_s
                what = "status-env"

            else:
                raw = http_request("POST", "/scored_data", port, rng.choice(bodies))
                t0 = time.perf_counter()
                status, _ = await conn.request(raw)
                stats.posts.append(time.perf_counter() - t0)
                next_post += args.post_s
                what = "scored_data"
            if status != 200:
                stats.error(f"{what} {status}")
        except (ConnectionError, asyncio.IncompleteReadError) as e:
            stats.error(type(e).__name__)
            conn.close()
            conn = await AsyncConnection.open(port)
    conn.close()


async def trainer(port: int, stats: Stats, stop: float) -> None:
    """Drain ``/batch`` like a trainer (a short pause when none is ready)."""
    conn = await AsyncConnection.open(port)
    raw = http_request("GET", "/batch", port, headers="Accept-Encoding: identity\r\n")
    while time.monotonic() < stop:
        status, body = await conn.request(raw)
        if status != 200 or body.startswith(b'{"batch":null'):
            await asyncio.sleep(0.2)
        else:
            stats.batches += 1
    conn.close()


async def step(port: int, n: int, bodies: List[bytes], args: argparse.Namespace) -> Stats:
    """One ramp step: ``n`` clients for ``args.seconds`` seconds."""
    stats = Stats()
    stop = time.monotonic() + args.seconds
    await asyncio.gather(
        trainer(port, stats, stop), *(env_client(port, bodies, args, stats, stop) for _ in range(n))
    )
    return stats


def reset(port: int) -> None:
    """Clear the server and register the trainer (batches of 64 sequences)."""
    from api_bench import TRAINER, Connection, _json

    conn = Connection(port)
    conn.request(http_request("GET", "/reset_data", port))
    _json(conn, http_request("POST", "/register", port, orjson.dumps(TRAINER)))
    _json(conn, http_request("GET", "/batch", port))
    conn.close()


def pct(values: List[float], q: float) -> float:
    """The ``q`` quantile of ``values`` in milliseconds (nan when empty)."""
    if not values:
        return float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[int(q * 100) - 1] * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", default="100,300,1000", help="comma-separated client counts")
    ap.add_argument("--seconds", type=float, default=20.0, help="duration of each step")
    ap.add_argument("--poll-s", type=float, default=1.0, help="seconds between /status-env polls")
    ap.add_argument("--post-s", type=float, default=10.0, help="seconds between group posts")
    ap.add_argument("--persist", action="store_true", help="run-api with --persist")
    args = ap.parse_args()
    rng = random.Random(0)
    bodies = [make_group(rng, 8, 256, 0, logprobs=True) for _ in range(16)]
    port = free_port()
    cmd = run_api_cmd(port, "--log-level", "warning")
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        if args.persist:
            cmd += ["--persist", str(Path(tmp) / "api.db")]
        with start_server(cmd, port) as proc:
            server, me = psutil.Process(proc.pid), psutil.Process()
            print(
                f"poll every {args.poll_s:g} s, post every {args.post_s:g} s, "
                f"{args.seconds:g} s per step; load average {os.getloadavg()}"
            )
            print(
                "clients | offered req/s | served req/s | status p50/p99 ms | post p50/p99 ms "
                "| server CPU | client CPU | errors | batches | load"
            )
            for n in (int(c) for c in args.clients.split(",")):
                reset(port)
                cpu0, me0, t0 = cpu_seconds(server), cpu_seconds(me), time.perf_counter()
                stats = asyncio.run(step(port, n, bodies, args))
                wall = time.perf_counter() - t0
                cpu, mine = cpu_seconds(server) - cpu0, cpu_seconds(me) - me0
                offered = n * (1 / args.poll_s + 1 / args.post_s)
                served = (len(stats.status) + len(stats.posts)) / wall
                print(
                    f"{n} | {offered:,.0f} | {served:,.0f} | "
                    f"{pct(stats.status, 0.5):.1f}/{pct(stats.status, 0.99):.1f} | "
                    f"{pct(stats.posts, 0.5):.1f}/{pct(stats.posts, 0.99):.1f} | "
                    f"{cpu / wall:.0%} | {mine / wall:.0%} | {stats.errors} | {stats.batches} | "
                    f"{os.getloadavg()[0]:.1f}",
                    flush=True,
                )
                if stats.codes:
                    print(f"  errors: {stats.codes}", flush=True)


if __name__ == "__main__":
    main()
