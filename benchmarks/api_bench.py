"""Benchmark of the rollout API (``run-api`` as a real process on a free port).

Prints ingest groups/s (2,000 groups x 8 sequences x 256 tokens, 16 concurrent
posters), ``/status-env`` p50 latency at a full queue and its flatness from 100
to 10,000 queued groups, drain batches/s (batch 64, with and without gzip), and
the server's peak RSS. The client's own CPU time is reported so a saturated
client is visible.

    .venv/bin/python benchmarks/api_bench.py [--groups 2000] [--persist] [--pack-above-mb N]

Wall-clock rates depend on what else the machine runs; the server CPU time per
request (``psutil`` before/after each phase) and the in-process per-stage CPU
times at the end are the load-independent figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Dict, List

import aiohttp
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.helpers.procs import PYTHON, free_port, running_process  # noqa: E402

TRAINER = {
    "wandb_group": "bench",
    "wandb_project": "bench",
    "batch_size": 64,
    "max_token_len": 2048,
    "checkpoint_dir": "ckpt",
    "save_checkpoint_interval": 100,
    "starting_step": 0,
    "num_steps": 10**6,
}


def make_group(
    rng: random.Random, group_size: int, seq_len: int, env_id: int, logprobs: bool = False
) -> bytes:
    """One realistic group: half prompt (masked), half completion; optionally inference logprobs."""
    prompt = seq_len // 2
    tokens, masks, lps = [], [], []
    for _ in range(group_size):
        seq = [rng.randrange(0, 32000) for _ in range(seq_len)]
        tokens.append(seq)
        masks.append([-100] * prompt + seq[prompt:])
        lps.append([1.0] * prompt + [round(-rng.random() * 5, 4) for _ in range(seq_len - prompt)])
    group = {
        "tokens": tokens,
        "masks": masks,
        "scores": [rng.choice([1.0, -1.0]) for _ in tokens],
        "env_id": env_id,
    }
    if logprobs:
        group["inference_logprobs"] = lps
    return json.dumps(group).encode()


class RssSampler:
    """Polls a process's RSS in a thread and remembers the peak."""

    def __init__(self, pid: int) -> None:
        self.proc = psutil.Process(pid)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, self.proc.memory_info().rss)
            except psutil.Error:
                return
            time.sleep(0.05)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


async def setup(session: aiohttp.ClientSession, base: str, group_size: int) -> int:
    await (await session.get(f"{base}/reset_data")).read()
    await (await session.post(f"{base}/register", json=TRAINER)).read()
    await (await session.get(f"{base}/batch")).read()
    r = await session.post(
        f"{base}/register-env",
        json={
            "max_token_length": 2048,
            "desired_name": "bench",
            "weight": 1.0,
            "group_size": group_size,
        },
    )
    return (await r.json())["env_id"]


async def ingest(
    session: aiohttp.ClientSession,
    base: str,
    bodies: List[bytes],
    n: int,
    concurrency: int,
    path: str = "/scored_data",
) -> float:
    """POST ``n`` bodies to ``path`` from ``concurrency`` posters; the wall time taken."""
    counter = iter(range(n))
    headers = {"Content-Type": "application/json"}

    async def poster() -> None:
        for i in counter:
            async with session.post(
                f"{base}{path}", data=bodies[i % len(bodies)], headers=headers
            ) as r:
                await r.read()
                if r.status != 200:
                    raise RuntimeError(f"POST {path} answered {r.status}")

    t0 = time.perf_counter()
    await asyncio.gather(*(poster() for _ in range(concurrency)))
    return time.perf_counter() - t0


async def status_p50(session: aiohttp.ClientSession, base: str, env_id: int, n: int = 500) -> float:
    lat = []
    for _ in range(n):
        t0 = time.perf_counter()
        async with session.get(f"{base}/status-env", params={"env_id": env_id}) as r:
            await r.read()
        lat.append(time.perf_counter() - t0)
    return statistics.median(lat) * 1000


async def drain(session: aiohttp.ClientSession, base: str, gzip: bool) -> tuple[int, float]:
    headers = {} if gzip else {"Accept-Encoding": "identity"}
    batches = 0
    t0 = time.perf_counter()
    while True:
        async with session.get(f"{base}/batch", headers=headers) as r:
            data = await r.read()  # not parsed: the client must not be the bottleneck
        if r.status != 200 or data.startswith(b'{"batch":null'):
            break
        batches += 1
    return batches, time.perf_counter() - t0


def _cpu_per_call(fn: Callable[[int], object], n: int, repeats: int = 5) -> float:
    """Least CPU seconds per call of ``fn(i)`` over ``repeats`` runs of ``n`` calls (least is least disturbed)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.process_time()
        for i in range(n):
            fn(i)
        best = min(best, (time.process_time() - t0) / n)
    return best


def handler_stages(bodies: List[bytes], n: int) -> Dict[str, float]:
    """In-process CPU per stage of the hot path, without HTTP (seconds per call)."""
    from atroposlib.api import handlers
    from atroposlib.api.compression import gzip_compress, pack
    from atroposlib.api.models import RegisterEnv, Registration, ScoredData
    from atroposlib.api.store import RolloutStore

    def store(pack_above: int) -> RolloutStore:
        s = RolloutStore(2**40, pack_above_bytes=pack_above)
        s.register_trainer(Registration(**TRAINER))
        s.next_batch()
        s.register_env(
            RegisterEnv(max_token_length=2048, desired_name="b", weight=1.0, group_size=8)
        )
        return s

    def body(i: int) -> bytes:
        return bodies[i % len(bodies)]

    stages: Dict[str, float] = {}
    stages["validate (pydantic, strict)"] = _cpu_per_call(
        lambda i: ScoredData.model_validate_json(body(i)), n
    )
    raw, packed = store(2**40), store(0)
    stages["ingest, raw (validate+check+store)"] = _cpu_per_call(
        lambda i: handlers.ingest_groups(raw, body(i), many=False), n
    )
    stages["ingest, packed (+deflate)"] = _cpu_per_call(
        lambda i: handlers.ingest_groups(packed, body(i), many=False), n
    )
    stages["deflate one group (pack)"] = _cpu_per_call(lambda i: pack(body(i)), n)
    batches = min(len(raw.queue), len(packed.queue)) // 8
    stages["/batch assembly, raw"] = _cpu_per_call(lambda i: handlers.serve_batch(raw), batches, 1)
    stages["/batch assembly, packed"] = _cpu_per_call(
        lambda i: handlers.serve_batch(packed), batches, 1
    )
    one_batch = b'{"batch":[' + b",".join(bodies[:8]) + b"]}"
    stages["gzip of one batch (level 1)"] = _cpu_per_call(lambda i: gzip_compress(one_batch, 1), 50)
    return stages


async def run(args: argparse.Namespace, base: str, pid: int) -> None:
    me = psutil.Process()
    rng = random.Random(0)
    bodies = [make_group(rng, 8, 256, 0, args.logprobs) for _ in range(64)]
    tiny = [make_group(rng, 8, 4, 0) for _ in range(16)]
    conn = aiohttp.TCPConnector(limit=64)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=60)) as s:
        env_id = await setup(s, base, 8)
        server = psutil.Process(pid)
        cpu0, scpu0 = sum(me.cpu_times()[:2]), sum(server.cpu_times()[:2])
        with RssSampler(pid) as rss:
            secs = await ingest(s, base, bodies, args.groups, args.concurrency)
            client_cpu = sum(me.cpu_times()[:2]) - cpu0
            server_cpu = sum(server.cpu_times()[:2]) - scpu0
            p50_full = await status_p50(s, base, env_id)
            rss_full = psutil.Process(pid).memory_info().rss
            scpu0 = sum(server.cpu_times()[:2])
            await status_p50(s, base, env_id, n=200)
            status_cpu = (sum(server.cpu_times()[:2]) - scpu0) / 200
            scpu0 = sum(server.cpu_times()[:2])
            batches, dsecs = await drain(s, base, gzip=True)
            drain_cpu = sum(server.cpu_times()[:2]) - scpu0
        print(f"body size            {len(bodies[0]) / 1024:.1f} KiB per group")
        print(
            f"ingest               {args.groups / secs:,.0f} groups/s "
            f"({args.groups} groups in {secs:.2f}s, client CPU {client_cpu / secs * 100:.0f}% of a core, "
            f"server CPU {server_cpu / args.groups * 1e6:.0f} us/group)"
        )
        print(
            f"/status-env p50      {p50_full:.3f} ms at {args.groups} queued groups "
            f"(server CPU {status_cpu * 1e6:.0f} us per request)"
        )
        print(
            f"RSS full queue       {rss_full / 2**20:.1f} MiB (peak during run {rss.peak / 2**20:.1f} MiB)"
        )
        print(
            f"drain (gzip)         {batches / dsecs:,.0f} batches/s ({batches} batches of 64 in {dsecs:.2f}s, "
            f"server CPU {drain_cpu / max(batches, 1) * 1e3:.2f} ms/batch)"
        )
        # Refill through /scored_data_list, lists of 8 groups (what a busy BaseEnv sends).
        lists = [b"[" + b",".join(bodies[i : i + 8]) + b"]" for i in range(0, len(bodies), 8)]
        scpu0 = sum(server.cpu_times()[:2])
        secs = await ingest(
            s, base, lists, args.groups // 8, args.concurrency, path="/scored_data_list"
        )
        list_cpu = sum(server.cpu_times()[:2]) - scpu0
        print(
            f"ingest (lists of 8)  {args.groups // 8 * 8 / secs:,.0f} groups/s "
            f"(server CPU {list_cpu / (args.groups // 8 * 8) * 1e6:.0f} us/group)"
        )
        scpu0 = sum(server.cpu_times()[:2])
        batches, dsecs = await drain(s, base, gzip=False)
        drain_cpu = sum(server.cpu_times()[:2]) - scpu0
        print(
            f"drain (identity)     {batches / dsecs:,.0f} batches/s ({batches} batches of 64 in {dsecs:.2f}s, "
            f"server CPU {drain_cpu / max(batches, 1) * 1e3:.2f} ms/batch)"
        )
        for target in (100, 10_000):
            env_id = await setup(s, base, 8)
            await ingest(s, base, tiny, target, args.concurrency)
            print(
                f"/status-env p50      {await status_p50(s, base, env_id):.3f} ms at {target} queued groups"
            )
    from atroposlib.api.compression import BACKEND

    print(f"in-process CPU per call, no HTTP (least of 5 runs; deflate by {BACKEND}):")
    for stage, secs in handler_stages(bodies, min(args.groups, 500)).items():
        print(f"  {stage:36s} {secs * 1e6:8.0f} us")
    print(f"load average         {os.getloadavg()}")


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--groups", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--logprobs", action="store_true", help="groups also carry inference_logprobs")
    p.add_argument(
        "--persist", action="store_true", help="run the server with --persist (SQLite WAL)"
    )
    p.add_argument(
        "--pack-above-mb",
        type=float,
        default=None,
        help="pass --pack-above-mb to the server (default: the server's default)",
    )
    args = p.parse_args()
    port = free_port()
    cmd = [PYTHON, "-m", "atroposlib.cli.run_api", "--port", str(port), "--log-level", "warning"]
    with tempfile.TemporaryDirectory() as tmp:
        if args.persist:
            cmd += ["--persist", str(Path(tmp) / "api.db")]
        if args.pack_above_mb is not None:
            cmd += ["--pack-above-mb", str(args.pack_above_mb)]
        with running_process(cmd, health_url=f"http://127.0.0.1:{port}/health", cwd=ROOT) as proc:
            print(
                f"run-api pid {proc.pid} on port {port}{' with --persist' if args.persist else ''}"
            )
            asyncio.run(run(args, f"http://127.0.0.1:{port}", proc.pid))


if __name__ == "__main__":
    main()
