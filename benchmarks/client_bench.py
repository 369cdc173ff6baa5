"""Client CPU per request with many requests in flight: aiohttp (our stack) against httpx.

Starts the fake inference server (``--lean``, 5 ms latency here) as a process, then in a child
process per client sends ``--requests`` chat-sized POSTs with ``--concurrency`` in flight and
prints the client process's CPU time per request (load-independent enough to compare side by
side) and requests/s. Each client runs ``--rounds`` times, alternating.

    python benchmarks/client_bench.py
    python benchmarks/client_bench.py --clients aiohttp httpx --requests 1280 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PAYLOAD = json.dumps({"model": "fake", "prompt": "item 1", "n": 4, "max_tokens": 8}).encode()


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _client_run(kind: str, url: str, requests: int, concurrency: int) -> tuple[float, float]:
    if kind == "aiohttp":
        from atroposlib.envs.server_handling._transport import JsonTransport

        transport = JsonTransport(timeout=60)

        async def one() -> None:
            await transport.post_json(url, json.loads(PAYLOAD))

        async def close() -> None:
            await transport.close()
    else:
        module = __import__(kind)
        client = module.AsyncClient(limits=module.Limits(max_connections=concurrency), timeout=60)

        async def one() -> None:
            response = await client.post(url, content=PAYLOAD)
            response.json()

        async def close() -> None:
            await client.aclose()

    async def worker(n: int) -> None:
        for _ in range(n):
            await one()

    await asyncio.gather(*(worker(2) for _ in range(concurrency)))  # connections up
    per_worker = max(1, requests // concurrency)
    c0, t0 = _cpu(), time.monotonic()
    await asyncio.gather(*(worker(per_worker) for _ in range(concurrency)))
    c1, t1 = _cpu(), time.monotonic()
    await close()
    done = per_worker * concurrency
    return 1e6 * (c1 - c0) / done, done / (t1 - t0)


def main() -> None:
    """Run the benchmark and print one line per client and round."""
    if sys.argv[1:2] == ["client"]:
        kind, url, requests, concurrency = sys.argv[2], sys.argv[3], *map(int, sys.argv[4:6])
        us, rate = asyncio.run(_client_run(kind, url, requests, concurrency))
        print(json.dumps({"us": us, "rate": rate}))
        return
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clients", nargs="+", default=["aiohttp", "httpx"])
    parser.add_argument("--requests", type=int, default=1280)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--latency-ms", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per client run")
    args = parser.parse_args()

    from atroposlib.testing.launch import fake_server_cmd
    from atroposlib.testing.ports import free_port
    from atroposlib.testing.processes import start_process, stop_process, wait_http

    port = free_port()
    server = start_process(
        fake_server_cmd(port, "--latency-ms", str(args.latency_ms), "--lean"),
        log_path=Path("/tmp/atropos-client-bench-fake.log"),
    )
    load = os.getloadavg()
    print(f"load: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} cores")
    print(f"{args.concurrency} in flight, {args.latency_ms} ms server latency")
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc=server)
        url = f"http://127.0.0.1:{port}/v1/completions"
        for _ in range(args.rounds):
            for kind in args.clients:
                cmd = [sys.executable, __file__, "client", kind, url, str(args.requests)]
                try:
                    out = subprocess.run(
                        [*cmd, str(args.concurrency)],
                        capture_output=True,
                        text=True,
                        timeout=args.timeout,
                        check=True,
                    ).stdout
                except subprocess.TimeoutExpired:
                    print(f"{kind:>8}: did not finish within {args.timeout:g} s", flush=True)
                    continue
                r = json.loads(out.strip().splitlines()[-1])
                print(
                    f"{kind:>8}: {r['us']:8.0f} us CPU/request {r['rate']:8.0f} req/s", flush=True
                )
    finally:
        stop_process(server)
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
