"""Routing overhead of ``ServerManager``: throughput against the ideal.

Setup: ``--servers`` in-process servers that answer after ``--latency-ms`` each, with
``--slots`` concurrent requests per server, and ``--callers`` concurrent callers that
loop on ``chat_completion`` for ``--seconds``. The ideal throughput is
``servers * min(slots, callers / servers) / latency``; the target is >= 90 % of it.

``--http`` runs the same load against fake-server processes on loopback instead (that
also measures the HTTP and JSON costs of the backends' lean transport, so it is a
reference, not the routing target; ``--fake-server uvicorn`` serves them with uvicorn).

Example::

    python benchmarks/servers_bench.py                     # 4 servers, 20 ms, 256 callers
    python benchmarks/servers_bench.py --slots 16 --callers 256
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from atroposlib.envs.server_handling.server_baseline import APIServer, APIServerConfig  # noqa: E402
from atroposlib.envs.server_handling.server_harness import create_chat_completion  # noqa: E402
from atroposlib.envs.server_handling.server_manager import ServerManager  # noqa: E402

MESSAGES = [{"role": "user", "content": "hi"}]


class LatencyServer(APIServer):
    """A server that answers every request after a fixed delay."""

    latency = 0.02
    transport_has_timeout = True  # like the HTTP backends, whose client enforces the timeout
    _response = create_chat_completion("ok")

    async def _chat_completion_wrapper(self, **kwargs: Any) -> Any:
        await asyncio.sleep(self.latency)
        return self._response

    async def _completion_wrapper(self, **kwargs: Any) -> Any:
        await asyncio.sleep(self.latency)
        return self._response


async def _load(manager: ServerManager, callers: int, seconds: float) -> tuple[int, float]:
    stop_at = time.perf_counter() + seconds
    done = 0

    async def caller() -> None:
        nonlocal done
        while time.perf_counter() < stop_at:
            await manager.chat_completion(messages=MESSAGES, max_tokens=1)
            done += 1

    start = time.perf_counter()
    cpu = time.process_time()
    await asyncio.gather(*(caller() for _ in range(callers)))
    _load.cpu = time.process_time() - cpu  # type: ignore[attr-defined]
    return done, time.perf_counter() - start


async def run_inprocess(args: argparse.Namespace) -> dict[str, float]:
    LatencyServer.latency = args.latency_ms / 1000.0
    configs = [
        APIServerConfig(
            base_url=f"http://bench{i}/v1",
            health_check=False,
            num_max_requests_at_once=args.slots,
            timeout=60,
        )
        for i in range(args.servers)
    ]
    manager = ServerManager(configs, server_class=LatencyServer)
    await _load(manager, args.callers, 0.5)  # warm-up
    done, elapsed = await _load(manager, args.callers, args.seconds)
    await manager.close()
    return {"requests": done, "elapsed": elapsed, "cpu": _load.cpu}  # type: ignore[attr-defined]


async def run_baseline(args: argparse.Namespace) -> dict[str, float]:
    """No router: one asyncio.Semaphore of servers*slots around a sleep (the box's ceiling)."""
    sem = asyncio.Semaphore(args.servers * args.slots)
    latency = args.latency_ms / 1000.0
    done = 0

    async def caller(stop_at: float) -> None:
        nonlocal done
        while time.perf_counter() < stop_at:
            async with sem:
                await asyncio.sleep(latency)
            done += 1

    for seconds in (0.5, args.seconds):
        done = 0
        start = time.perf_counter()
        cpu = time.process_time()
        await asyncio.gather(*(caller(start + seconds) for _ in range(args.callers)))
    return {
        "requests": done,
        "elapsed": time.perf_counter() - start,
        "cpu": time.process_time() - cpu,
    }


async def run_http(args: argparse.Namespace) -> dict[str, float]:
    from atroposlib.testing.launch import fake_server_cmd
    from atroposlib.testing.ports import free_port
    from atroposlib.testing.processes import start_process, stop_process, wait_http

    ports = [free_port() for _ in range(args.servers)]
    procs = [
        start_process(
            fake_server_cmd(
                p,
                "--latency-ms",
                str(args.latency_ms),
                *(["--lean"] if args.fake_server == "lean" else []),
            )
        )
        for p in ports
    ]
    try:
        for p, proc in zip(ports, procs, strict=False):
            wait_http(f"http://127.0.0.1:{p}/health", timeout=60, proc=proc)
        configs = [
            APIServerConfig(
                base_url=f"http://127.0.0.1:{p}/v1",
                model_name="fake",
                num_max_requests_at_once=args.slots,
                timeout=60,
            )
            for p in ports
        ]
        manager = ServerManager(configs)
        await _load(manager, args.callers, 0.5)
        done, elapsed = await _load(manager, args.callers, args.seconds)
        await manager.close()
        return {"requests": done, "elapsed": elapsed, "cpu": _load.cpu}  # type: ignore[attr-defined]
    finally:
        for proc in procs:
            stop_process(proc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", type=int, default=4)
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--slots", type=int, default=64, help="num_max_requests_at_once per server")
    parser.add_argument("--callers", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--http", action="store_true", help="use fake-server processes")
    parser.add_argument(
        "--fake-server",
        choices=["lean", "uvicorn"],
        default="lean",
        help="with --http: the fake servers' HTTP server (lean: minimal asyncio server)",
    )
    parser.add_argument(
        "--baseline", action="store_true", help="no router, a bare semaphore + sleep (box ceiling)"
    )
    args = parser.parse_args()

    if args.baseline:
        result = asyncio.run(run_baseline(args))
    else:
        result = asyncio.run(run_http(args) if args.http else run_inprocess(args))
    concurrent = min(args.servers * args.slots, args.callers)
    ideal = concurrent / (args.latency_ms / 1000.0)
    rate = result["requests"] / result["elapsed"]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    mode = f"http ({args.fake_server} fake-server processes)" if args.http else "in-process servers"
    if args.baseline:
        mode = "baseline (no router: bare semaphore + sleep)"
    print(f"mode: {mode}")
    print(
        f"servers={args.servers} latency={args.latency_ms}ms slots/server={args.slots} callers={args.callers}"
    )
    print(f"requests: {int(result['requests'])} in {result['elapsed']:.2f}s")
    print(f"throughput: {rate:.0f} req/s; ideal: {ideal:.0f} req/s; ratio: {rate / ideal:.1%}")
    cpu_us = result["cpu"] / max(result["requests"], 1) * 1e6
    print(f"CPU per request (this process): {cpu_us:.0f} us")
    print(
        f"throughput one free core could sustain: {min(1e6 / cpu_us, ideal):.0f} req/s "
        f"({min(1e6 / cpu_us / ideal, 1.0):.1%} of ideal)"
    )
    print(f"load average (1 min): {load:.2f}")
    try:
        print(
            "uptime:",
            subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip(),
        )
    except (OSError, subprocess.SubprocessError):
        pass


if __name__ == "__main__":
    main()
