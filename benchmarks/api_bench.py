"""Benchmark of the rollout API (``run-api`` as a real process on a free port).

Ingest: 2,000 groups x 8 sequences x 256 tokens (26 KiB of JSON each) posted to
``/scored_data``, then again to ``/scored_data_list`` in posts of 16 groups.
The bodies are encoded before the clock starts and sent as ready-made HTTP/1.1
requests over keep-alive sockets from several client processes, so the client
stays far below the server's cost; the client's CPU is printed to show it.

The load-independent figure is the **server's CPU time per group**, read from
``/proc`` (``psutil``) before and after each phase; the wall-clock rates and the
server's CPU utilisation (its CPU seconds over the phase's wall seconds, 100 %
= one core saturated) are printed next to it. Also measured: ``/status-env``
p50 at 100 / 2,000 / 10,000 queued groups, drain of batches of 64 (gzip and
identity) with server CPU per batch, RSS with 2,000 groups queued, and the
per-request floor of the HTTP server itself: a bare ASGI app under the same
uvicorn settings that reads the same bodies and answers ``{"status":"received"}``.

    .venv/bin/python benchmarks/api_bench.py                 # one in-memory run
    .venv/bin/python benchmarks/api_bench.py --persist       # one run with --persist
    .venv/bin/python benchmarks/api_bench.py --table --repeats 3
        # in-memory, --persist and the floor, 3 runs each; prints the markdown
        # table of the READMEs (median and range)
    .venv/bin/python benchmarks/api_bench.py --table --repeats 5 --write
        # the same, and writes the table into the API README's marked block and
        # the "API ..." rows of docs/performance.md
    .venv/bin/python benchmarks/api_bench.py --original --repeats 3
        # run-api and the original's API (atroposlib 0.4.0, from PyPI) alternately,
        # the same phases against each, and the ratios of their server CPU: the
        # bars are ingest >= 2x and /batch drain >= 10x cheaper than the original

The original is the last atroposlib release on PyPI, unpacked under
``.cache/original-atroposlib-0.4.0`` (``pip download atroposlib==0.4.0 --no-deps``, done
on first use; ``--original DIR`` takes an unpacked copy elsewhere). It runs in this
project's virtual environment (its API needs only FastAPI, pydantic and uvicorn; the
same uvloop and httptools as run-api), as its ``run-api`` starts it, access log off. It
takes ``/status-env``'s ``env_id`` only as a JSON body, so it is asked that way.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import random
import selectors
import socket
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Sequence

import orjson
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from atroposlib.http.asgi import answer_lifespan  # noqa: E402
from atroposlib.testing.launch import run_api_cmd  # noqa: E402
from atroposlib.testing.ports import free_port  # noqa: E402
from atroposlib.testing.processes import PYTHON, running_process  # noqa: E402

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
LIST_GROUPS = 16
"""Groups per ``/scored_data_list`` post."""


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
    return json.dumps(group).encode()  # what json.dumps-based clients send


# ---------------------------------------------------------------- raw HTTP client
def http_request(method: str, path: str, port: int, body: bytes = b"", headers: str = "") -> bytes:
    """A complete HTTP/1.1 keep-alive request as bytes."""
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{headers}"
    if body or method == "POST":
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    return head.encode() + b"\r\n" + body


class Connection:
    """One keep-alive socket that sends ready-made requests and reads whole responses."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""

    def send(self, request: bytes) -> None:
        self.sock.sendall(request)

    def read(self) -> tuple[int, bytes]:
        """``(status, body)`` of the next response (``Content-Length`` framed)."""
        while b"\r\n\r\n" not in self.buf:
            self._fill()
        head, _, rest = self.buf.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status = int(lines[0].split()[1])
        length = 0
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        self.buf = rest
        while len(self.buf) < length:
            self._fill()
        body, self.buf = self.buf[:length], self.buf[length:]
        return status, body

    def request(self, request: bytes) -> tuple[int, bytes]:
        """Send and read one response; reconnect once if the server closed an idle socket."""
        try:
            self.send(request)
            return self.read()
        except (ConnectionError, BrokenPipeError):
            self.sock.close()
            self.__init__(self.port)  # type: ignore[misc]
            self.send(request)
            return self.read()

    def _fill(self) -> None:
        chunk = self.sock.recv(1 << 20)
        if not chunk:
            raise ConnectionError("server closed the connection")
        self.buf += chunk

    def close(self) -> None:
        self.sock.close()


def _client_worker(
    port: int,
    requests: Sequence[bytes],
    indices: Sequence[int],
    conns: int,
    ready: mp.Barrier,
    out: mp.Queue,
) -> None:
    """Send ``requests[i]`` for each ``i`` over ``conns`` sockets, each with one request in flight."""
    sockets = [Connection(port) for _ in range(conns)]
    sel = selectors.DefaultSelector()
    todo = iter(indices)
    bad = 0
    ready.wait()
    cpu0 = time.process_time()
    for c in sockets:
        i = next(todo, None)
        if i is not None:
            c.send(requests[i])
            sel.register(c.sock, selectors.EVENT_READ, c)
    while sel.get_map():
        for key, _ in sel.select():
            c = key.data
            c._fill()
            while b"\r\n\r\n" in c.buf:
                try:
                    status, _ = _parse_buffered(c)
                except _Incomplete:
                    break
                bad += status != 200
                i = next(todo, None)
                if i is None:
                    sel.unregister(c.sock)
                else:
                    c.send(requests[i])
    out.put((time.process_time() - cpu0, bad))
    for c in sockets:
        c.close()


class _Incomplete(Exception):
    pass


def _parse_buffered(c: Connection) -> tuple[int, bytes]:
    """A response already wholly in ``c.buf`` (else :class:`_Incomplete`, buffer untouched)."""
    head, _, rest = c.buf.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    if len(rest) < length:
        raise _Incomplete
    c.buf = rest[length:]
    return int(lines[0].split()[1]), rest[:length]


@dataclass
class Phase:
    """Wall time, server CPU and client CPU of one timed phase."""

    n: int
    wall: float
    server_cpu: float
    client_cpu: float = 0.0
    failures: int = 0
    server_sys: float = 0.0
    """Of ``server_cpu``, the seconds spent in the kernel (sockets, page faults)."""

    @property
    def utilisation(self) -> float:
        return self.server_cpu / self.wall


def cpu_seconds(proc: psutil.Process) -> float:
    """User + system CPU seconds of ``proc`` (from /proc)."""
    t = proc.cpu_times()
    return t.user + t.system


def system_seconds(proc: psutil.Process) -> float:
    """System (kernel) CPU seconds of ``proc`` (from /proc)."""
    return proc.cpu_times().system


def blast(
    port: int,
    server: psutil.Process,
    requests: Sequence[bytes],
    n: int,
    procs: int,
    conns: int,
) -> Phase:
    """Send ``n`` requests (cycling through ``requests``) from ``procs`` processes x ``conns`` sockets."""
    ctx = mp.get_context("fork")
    ready = ctx.Barrier(procs + 1)
    out: mp.Queue = ctx.Queue()
    workers = [
        ctx.Process(
            target=_client_worker,
            args=(
                port,
                requests,
                [i % len(requests) for i in range(p, n, procs)],
                conns,
                ready,
                out,
            ),
        )
        for p in range(procs)
    ]
    for w in workers:
        w.start()
    ready.wait()
    cpu0, sys0, t0 = cpu_seconds(server), system_seconds(server), time.perf_counter()
    results = [out.get(timeout=600) for _ in workers]
    wall, server_cpu = time.perf_counter() - t0, cpu_seconds(server) - cpu0
    server_sys = system_seconds(server) - sys0
    for w in workers:
        w.join()
    return Phase(
        n,
        wall,
        server_cpu,
        sum(r[0] for r in results),
        sum(r[1] for r in results),
        server_sys,
    )


# ---------------------------------------------------------------- server under test
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


def _json(conn: Connection, request: bytes) -> dict:
    status, body = conn.request(request)
    if status != 200:
        raise RuntimeError(f"{request.split(b' ', 2)[:2]} answered {status}: {body[:200]!r}")
    return orjson.loads(body)


def setup(conn: Connection, port: int, group_size: int) -> int:
    """Reset the server, register a trainer and one env; the env's id."""
    conn.request(http_request("GET", "/reset_data", port))
    _json(conn, http_request("POST", "/register", port, orjson.dumps(TRAINER)))
    _json(conn, http_request("GET", "/batch", port))
    env = {"max_token_length": 2048, "desired_name": "bench", "weight": 1.0}
    body = orjson.dumps({**env, "group_size": group_size})
    return _json(conn, http_request("POST", "/register-env", port, body))["env_id"]


def status_request(port: int, env_id: int, body_form: bool = False) -> bytes:
    """``GET /status-env`` by query, or (``body_form``, the original's only form) JSON body."""
    if body_form:
        return http_request("GET", "/status-env", port, orjson.dumps({"env_id": env_id}))
    return http_request("GET", f"/status-env?env_id={env_id}", port)


def status_p50(
    conn: Connection, port: int, env_id: int, n: int = 500, body_form: bool = False
) -> float:
    """Median latency (ms) of sequential ``/status-env`` calls."""
    request = status_request(port, env_id, body_form)
    lat = []
    for _ in range(n):
        t0 = time.perf_counter()
        conn.request(request)
        lat.append(time.perf_counter() - t0)
    return statistics.median(lat) * 1000


def drain(conn: Connection, port: int, server: psutil.Process, gzip: bool) -> Phase:
    """Pull ``/batch`` until it is empty, one request at a time like a trainer."""
    encoding = "gzip" if gzip else "identity"
    request = http_request("GET", "/batch", port, headers=f"Accept-Encoding: {encoding}\r\n")
    batches = 0
    cpu0, t0 = cpu_seconds(server), time.perf_counter()
    while True:
        status, body = conn.request(request)  # not parsed: the client must not be the bottleneck
        if status != 200 or body.startswith(b'{"batch":null'):
            break
        batches += 1
    return Phase(batches, time.perf_counter() - t0, cpu_seconds(server) - cpu0)


@dataclass
class Run:
    """The figures of one benchmark run (seconds and bytes)."""

    figures: Dict[str, float] = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)


def bench_api(port: int, pid: int, args: argparse.Namespace, body_form: bool = False) -> Run:
    """Every phase against one started ``run-api`` (``body_form``: the original's API)."""
    run = Run()
    f = run.figures
    server = psutil.Process(pid)
    rng = random.Random(0)
    bodies = [make_group(rng, 8, 256, 0, args.logprobs) for _ in range(64)]
    tiny = [make_group(rng, 8, 4, 0) for _ in range(16)]
    singles = [http_request("POST", "/scored_data", port, b) for b in bodies]
    lists = [
        http_request(
            "POST", "/scored_data_list", port, b"[" + b",".join(bodies[i : i + LIST_GROUPS]) + b"]"
        )
        for i in range(0, len(bodies), LIST_GROUPS)
    ]
    conn = Connection(port)
    env_id = setup(conn, port, 8)
    n = args.groups
    with RssSampler(pid) as rss:
        p = blast(port, server, singles, n, args.procs, args.conns)
        f["single_us"] = p.server_cpu / n * 1e6
        f["single_rate"] = n / p.wall
        f["single_util"] = p.utilisation
        f["single_client"] = p.client_cpu / p.wall
        f["single_sys_us"] = p.server_sys / n * 1e6
        if p.failures:
            run.notes.append(f"{p.failures} posts to /scored_data failed")
        f["status_full"] = status_p50(conn, port, env_id, body_form=body_form)
        f["rss_full"] = server.memory_info().rss
        cpu0 = cpu_seconds(server)
        status_p50(conn, port, env_id, n=200, body_form=body_form)
        f["status_cpu_us"] = (cpu_seconds(server) - cpu0) / 200 * 1e6
        d = drain(conn, port, server, gzip=True)
    f["rss_peak"] = rss.peak
    f["drain_gzip_ms"] = d.server_cpu / max(d.n, 1) * 1e3
    f["drain_gzip_rate"] = d.n / d.wall
    posts = n // LIST_GROUPS
    p = blast(port, server, lists, posts, args.procs, args.conns)
    f["list_us"] = p.server_cpu / (posts * LIST_GROUPS) * 1e6
    f["list_rate"] = posts * LIST_GROUPS / p.wall
    f["list_util"] = p.utilisation
    f["list_client"] = p.client_cpu / p.wall
    f["list_sys_us"] = p.server_sys / (posts * LIST_GROUPS) * 1e6
    if p.failures:
        run.notes.append(f"{p.failures} posts to /scored_data_list failed")
    d = drain(conn, port, server, gzip=False)
    f["drain_identity_ms"] = d.server_cpu / max(d.n, 1) * 1e3
    f["drain_identity_rate"] = d.n / d.wall
    for target in (100, 10_000):
        env_id = setup(conn, port, 8)
        tiny_posts = [http_request("POST", "/scored_data", port, b) for b in tiny]
        blast(port, server, tiny_posts, target, args.procs, args.conns)
        f[f"status_{target}"] = status_p50(conn, port, env_id, body_form=body_form)
    conn.close()
    return run


# ---------------------------------------------------------------- HTTP floor
async def _floor_app(scope: dict, receive: Callable, send: Callable) -> None:
    """The least an ASGI app can do per request: read the whole body, answer a constant."""
    if scope["type"] == "lifespan":
        await answer_lifespan(receive, send)
        return
    more = True
    while more:
        message = await receive()
        more = message.get("more_body", False)
    payload = b'{"status":"received"}'
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload})


def serve_floor(port: int) -> None:
    """Run :func:`_floor_app` with the uvicorn settings ``run-api`` uses."""
    import uvicorn

    from atroposlib.http.transport import http_protocol

    uvicorn.run(
        _floor_app,
        host="127.0.0.1",
        port=port,
        log_level="warning",
        access_log=False,
        loop="auto",
        http=http_protocol(),
        proxy_headers=False,
    )


def bench_floor(port: int, pid: int, args: argparse.Namespace) -> Run:
    run = Run()
    server = psutil.Process(pid)
    rng = random.Random(0)
    bodies = [make_group(rng, 8, 256, 0, args.logprobs) for _ in range(64)]
    singles = [http_request("POST", "/scored_data", port, b) for b in bodies]
    lists = [
        http_request(
            "POST", "/scored_data_list", port, b"[" + b",".join(bodies[i : i + LIST_GROUPS]) + b"]"
        )
        for i in range(0, len(bodies), LIST_GROUPS)
    ]
    p = blast(port, server, singles, args.groups, args.procs, args.conns)
    run.figures["floor_us"] = p.server_cpu / args.groups * 1e6
    run.figures["floor_rate"] = args.groups / p.wall
    run.figures["floor_sys_us"] = p.server_sys / args.groups * 1e6
    posts = args.groups // LIST_GROUPS
    p = blast(port, server, lists, posts, args.procs, args.conns)
    run.figures["floor_list_us"] = p.server_cpu / (posts * LIST_GROUPS) * 1e6
    return run


# ---------------------------------------------------------------- in-process stages
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
    """In-process CPU per stage of the hot path, without HTTP (seconds per group)."""
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

    lists = [
        b"[" + b",".join(bodies[i : i + LIST_GROUPS]) + b"]"
        for i in range(0, len(bodies), LIST_GROUPS)
    ]
    stages: Dict[str, float] = {}
    stages["pydantic strict validation (error path only)"] = _cpu_per_call(
        lambda i: ScoredData.model_validate_json(body(i)), n
    )
    stages["parse + check one group (handlers.parse_groups)"] = _cpu_per_call(
        lambda i: handlers.parse_groups(body(i), many=False), n
    )
    stages["parse + check, per group of a list of 16"] = (
        _cpu_per_call(
            lambda i: handlers.parse_groups(lists[i % len(lists)], many=True), n // LIST_GROUPS
        )
        / LIST_GROUPS
    )
    raw, packed = store(2**40), store(0)
    stages["ingest, raw (parse+check+store)"] = _cpu_per_call(
        lambda i: handlers.ingest_groups(raw, body(i), many=False), n
    )
    stages["ingest, packed (+LZ4 pack)"] = _cpu_per_call(
        lambda i: handlers.ingest_groups(packed, body(i), many=False), n
    )
    stages["pack one group (LZ4)"] = _cpu_per_call(lambda i: pack(body(i)), n)
    batches = min(len(raw.queue), len(packed.queue)) // 8
    stages["/batch assembly, raw (per batch)"] = _cpu_per_call(
        lambda i: handlers.serve_batch(raw), batches, 1
    )
    stages["/batch assembly, packed (per batch)"] = _cpu_per_call(
        lambda i: handlers.serve_batch(packed), batches, 1
    )
    one_batch = b'{"batch":[' + b",".join(bodies[:8]) + b"]}"
    stages["gzip of one batch, 64 sequences (level 1)"] = _cpu_per_call(
        lambda i: gzip_compress(one_batch, 1), 50
    )
    return stages


# ---------------------------------------------------------------- driver
def start_server(cmd: List[str], port: int) -> running_process:
    return running_process(cmd, health_url=f"http://127.0.0.1:{port}/health", cwd=ROOT)


def one_run(args: argparse.Namespace, persist: bool) -> Run:
    port = free_port()
    cmd = run_api_cmd(port, "--log-level", "warning")
    with tempfile.TemporaryDirectory() as tmp:
        if persist:
            cmd += ["--persist", str(Path(tmp) / "api.db")]
        if args.pack_above_mb is not None:
            cmd += ["--pack-above-mb", str(args.pack_above_mb)]
        with start_server(cmd, port) as proc:
            return bench_api(port, proc.pid, args)


ORIGINAL_VERSION = "0.4.0"
ORIGINAL_DIR = ROOT / ".cache" / f"original-atroposlib-{ORIGINAL_VERSION}"
_SERVE_ORIGINAL = (
    "import sys; sys.path.insert(0, sys.argv[1]); import uvicorn; "
    "uvicorn.run('atroposlib.api:app', host='127.0.0.1', port=int(sys.argv[2]), "
    "log_level='warning', access_log=False)"
)
"""How the original's ``run-api`` starts its app (``uvicorn.run("atroposlib.api:app", ...)``),
with its access log off as run-api's is, and its package first on ``sys.path``."""


def original_dir(path: Path | None) -> Path:
    """An unpacked original atroposlib: ``path``, or the release fetched once from PyPI."""
    where = path or ORIGINAL_DIR
    if (where / "atroposlib" / "api" / "server.py").is_file():
        return where
    if path is not None:
        raise SystemExit(f"--original {path}: no atroposlib/api/server.py there")
    import subprocess
    import zipfile

    wheels = where.parent / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheels)]
        + [f"atroposlib=={ORIGINAL_VERSION}"],
        check=True,
    )
    (wheel,) = wheels.glob(f"atroposlib-{ORIGINAL_VERSION}-*.whl")
    with zipfile.ZipFile(wheel) as z:
        z.extractall(where)
    return where


def original_run(args: argparse.Namespace) -> Run:
    """The same phases against the original's API."""
    port = free_port()
    cmd = [PYTHON, "-c", _SERVE_ORIGINAL, str(args.original_dir), str(port)]
    with start_server(cmd, port) as proc:
        return bench_api(port, proc.pid, args, body_form=True)


COMPARED = (
    ("ingest /scored_data, server CPU per group", "single_us", 2.0),
    ("ingest /scored_data_list, server CPU per group", "list_us", 2.0),
    ("/batch drain, gzip, server CPU per batch", "drain_gzip_ms", 10.0),
    ("/batch drain, identity, server CPU per batch", "drain_identity_ms", 10.0),
)
"""(what, figure, bar): the original's figure over ours must reach the bar."""


def compare(ours: List[Run], original: List[Run]) -> bool:
    """Print the original's cost over ours, run pair by run pair (median and range); True
    when every median reaches its bar."""
    print(f"\nthe original's server CPU over run-api's, {len(ours)} alternating pairs:")
    held = True
    for what, key, bar in COMPARED:
        ratios = sorted(
            o.figures[key] / r.figures[key] for r, o in zip(ours, original, strict=True)
        )
        median = statistics.median(ratios)
        held = held and median >= bar
        print(
            f"  {what:46s} {median:6.1f}x ({ratios[0]:.1f}-{ratios[-1]:.1f}x)  "
            f"bar >= {bar:.0f}x: {'holds' if median >= bar else 'MISSED'}   "
            f"ours {statistics.median(r.figures[key] for r in ours):.2f}, original "
            f"{statistics.median(o.figures[key] for o in original):.2f}"
        )
    return held


def floor_run(args: argparse.Namespace) -> Run:
    port = free_port()
    cmd = [PYTHON, str(Path(__file__).resolve()), "--serve-floor", str(port)]
    with start_server(cmd, port) as proc:
        return bench_floor(port, proc.pid, args)


def print_run(run: Run, label: str) -> None:
    f = run.figures
    print(f"--- {label}")
    if "single_us" in f:
        print(
            f"ingest /scored_data        {f['single_rate']:8,.0f} groups/s   server CPU "
            f"{f['single_us']:5.0f} us/group (kernel {f['single_sys_us']:3.0f})   server "
            f"utilisation {f['single_util']:4.0%}   clients {f['single_client']:4.0%} of a core"
        )
        print(
            f"ingest /scored_data_list   {f['list_rate']:8,.0f} groups/s   server CPU "
            f"{f['list_us']:5.0f} us/group (kernel {f['list_sys_us']:3.0f})   server "
            f"utilisation {f['list_util']:4.0%}   clients {f['list_client']:4.0%} of a core   "
            f"({LIST_GROUPS} groups per post)"
        )
        print(
            f"drain, gzip                {f['drain_gzip_rate']:8,.0f} batches/s  server CPU "
            f"{f['drain_gzip_ms']:5.2f} ms/batch of 64"
        )
        print(
            f"drain, identity            {f['drain_identity_rate']:8,.0f} batches/s  server CPU "
            f"{f['drain_identity_ms']:5.2f} ms/batch of 64"
        )
        print(
            f"RSS with {args_groups} queued      {f['rss_full'] / 2**20:8.1f} MiB "
            f"(peak {f['rss_peak'] / 2**20:.1f} MiB)"
        )
        print(
            f"/status-env p50            {f['status_100']:.3f} / {f['status_full']:.3f} / "
            f"{f['status_10000']:.3f} ms at 100 / {args_groups} / 10,000 queued groups "
            f"(server CPU {f['status_cpu_us']:.0f} us per sequential request)"
        )
    if "floor_us" in f:
        print(
            f"bare ASGI app (floor)      {f['floor_rate']:8,.0f} requests/s server CPU "
            f"{f['floor_us']:5.0f} us/request of one group (kernel {f['floor_sys_us']:3.0f}), "
            f"{f['floor_list_us']:.0f} us/group in posts of {LIST_GROUPS}"
        )
    for note in run.notes:
        print(f"!! {note}")


args_groups = 2000


def _agg(runs: List[Run], key: str, scale: float = 1.0, fmt: str = "{:,.0f}") -> str:
    values = sorted(r.figures[key] * scale for r in runs if key in r.figures)
    if not values:
        return "—"
    med = fmt.format(statistics.median(values))
    if len(values) == 1:
        return med
    return f"{med} ({fmt.format(values[0])}–{fmt.format(values[-1])})"


def markdown_table(
    mem: List[Run], persist: List[Run], floor: List[Run], args: argparse.Namespace
) -> str:
    """The README table (median and range of the runs); every row names its command, date and machine."""
    day = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    load = f"{args.load_start:.1f}–{os.getloadavg()[0]:.1f}"
    cmd = f"`python benchmarks/api_bench.py --table` ({day}, {os.cpu_count()} cores, load {load})"
    g = f"{args.groups:,}"
    rows = [
        (
            f"API ingest `/scored_data`: server CPU per group ({g} groups × 8 × 256 tokens)",
            "≤ 150 µs",
            f"{_agg(mem, 'single_us')} µs (kernel {_agg(mem, 'single_sys_us')}); "
            f"{_agg(mem, 'single_rate')} groups/s at {_agg(mem, 'single_util', 100)} % server CPU",
        ),
        (
            f"API ingest `/scored_data_list`, {LIST_GROUPS} groups per post: server CPU per group",
            "≤ 90 µs",
            f"{_agg(mem, 'list_us')} µs (kernel {_agg(mem, 'list_sys_us')}); "
            f"{_agg(mem, 'list_rate')} groups/s at {_agg(mem, 'list_util', 100)} % server CPU",
        ),
        (
            "API ingest `/scored_data` with `--persist` (SQLite WAL): server CPU per group",
            "≤ 250 µs",
            f"{_agg(persist, 'single_us')} µs; {_agg(persist, 'single_rate')} groups/s "
            f"(`/scored_data_list`: {_agg(persist, 'list_us')} µs per group)",
        ),
        (
            "API HTTP floor: bare ASGI app under the same uvicorn, same bodies: server CPU per request",
            "—",
            f"{_agg(floor, 'floor_us')} µs (kernel {_agg(floor, 'floor_sys_us')}; "
            f"{_agg(floor, 'floor_list_us')} µs/group in posts of {LIST_GROUPS})",
        ),
        (
            "API `/batch` drain, batch of 64, gzip: server CPU per batch",
            "≤ 1.1 ms",
            f"{_agg(mem, 'drain_gzip_ms', fmt='{:.2f}')} ms; {_agg(mem, 'drain_gzip_rate')} batches/s "
            f"(`--persist`: {_agg(persist, 'drain_gzip_ms', fmt='{:.2f}')} ms)",
        ),
        (
            "API `/batch` drain, identity: server CPU per batch",
            "—",
            f"{_agg(mem, 'drain_identity_ms', fmt='{:.2f}')} ms; "
            f"{_agg(mem, 'drain_identity_rate')} batches/s "
            f"(`--persist`: {_agg(persist, 'drain_identity_ms', fmt='{:.2f}')} ms)",
        ),
        (
            f"API RSS with {g} groups queued",
            "≤ 90 MiB",
            f"{_agg(mem, 'rss_full', 1 / 2**20, '{:.1f}')} MiB "
            f"(`--persist`: {_agg(persist, 'rss_full', 1 / 2**20, '{:.1f}')} MiB)",
        ),
        (
            "API `/status-env` p50 at 100 / 2,000 / 10,000 queued groups",
            "≤ 1 ms, flat",
            f"{_agg(mem, 'status_100', fmt='{:.2f}')} / {_agg(mem, 'status_full', fmt='{:.2f}')} / "
            f"{_agg(mem, 'status_10000', fmt='{:.2f}')} ms",
        ),
    ]
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    cpu = platform.processor() or platform.machine()
    header = (
        f"Measured {now} on {os.cpu_count()} cores ({cpu}), load average {load} "
        f"(start–end), {len(mem)} runs each: median (range).\n\n"
        "| what | target | measured | command |\n|---|---|---|---|\n"
    )
    return header + "\n".join(f"| {a} | {b} | {c} | {cmd} |" for a, b, c in rows)


API_README = ROOT / "atroposlib" / "api" / "README.md"
MAIN_README = ROOT / "docs" / "performance.md"
TABLE_START, TABLE_END = "<!-- api_bench table start -->", "<!-- api_bench table end -->"


def table_rows(text: str) -> List[str]:
    """The ``| API ...`` rows of a markdown text, in order."""
    return [line for line in text.splitlines() if line.startswith("| API ")]


def write_readmes(table: str) -> None:
    """Put ``table`` between the API README's markers and its rows into docs/performance.md's table."""
    text = API_README.read_text()
    start, end = text.index(TABLE_START) + len(TABLE_START), text.index(TABLE_END)
    lines = MAIN_README.read_text().splitlines(keepends=True)
    old = [i for i, line in enumerate(lines) if line.startswith("| API ")]
    new = table_rows(table)
    if len(old) != len(new) or old != list(range(old[0], old[0] + len(old))):
        raise SystemExit(
            "docs/performance.md's API rows are not one block of the same length: edit by hand"
        )
    lines[old[0] : old[-1] + 1] = [row + "\n" for row in new]
    API_README.write_text(text[:start] + "\n" + table + "\n" + text[end:])
    MAIN_README.write_text("".join(lines))
    print(
        f"wrote the table into {API_README.relative_to(ROOT)} and {MAIN_README.relative_to(ROOT)}"
    )


def main() -> None:
    global args_groups
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--groups", type=int, default=2000)
    p.add_argument("--procs", type=int, default=4, help="client processes")
    p.add_argument("--conns", type=int, default=4, help="keep-alive sockets per client process")
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
    p.add_argument("--floor", action="store_true", help="also measure the bare ASGI floor")
    p.add_argument("--stages", action="store_true", help="also print in-process CPU per stage")
    p.add_argument(
        "--table", action="store_true", help="in-memory, --persist and floor runs; markdown table"
    )
    p.add_argument("--repeats", type=int, default=3, help="runs of each kind with --table")
    p.add_argument(
        "--write",
        action="store_true",
        help="with --table: write the table into the API README and docs/performance.md",
    )
    p.add_argument(
        "--original",
        nargs="?",
        const="",
        metavar="DIR",
        help="alternate with the original's API (unpacked atroposlib; default: fetch 0.4.0 "
        "from PyPI into .cache) and print the ratios against the bars",
    )
    p.add_argument("--serve-floor", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve_floor:
        serve_floor(args.serve_floor)
        return
    args_groups = args.groups
    if args.original is not None:
        args.original_dir = original_dir(Path(args.original) if args.original else None)
        ours, original = [], []
        for i in range(args.repeats):
            ours.append(one_run(args, persist=False))
            print_run(ours[-1], f"run-api, in memory, run {i + 1}")
            original.append(original_run(args))
            print_run(original[-1], f"the original's API ({ORIGINAL_VERSION}), run {i + 1}")
        held = compare(ours, original)
        print(f"load average {os.getloadavg()}")
        raise SystemExit(0 if held else 1)
    if args.table:
        args.load_start = os.getloadavg()[0]
        mem, persist, floor = [], [], []
        for i in range(args.repeats):
            mem.append(one_run(args, persist=False))
            print_run(mem[-1], f"in memory, run {i + 1}")
            persist.append(one_run(args, persist=True))
            print_run(persist[-1], f"--persist, run {i + 1}")
            floor.append(floor_run(args))
            print_run(floor[-1], f"floor, run {i + 1}")
        print()
        table = markdown_table(mem, persist, floor, args)
        print(table)
        if args.write:
            write_readmes(table)
    else:
        run = one_run(args, persist=args.persist)
        print_run(run, "with --persist" if args.persist else "in memory")
        if args.floor:
            print_run(floor_run(args), "floor")
    if args.stages:
        from atroposlib.api.compression import BACKEND

        rng = random.Random(0)
        bodies = [make_group(rng, 8, 256, 0, args.logprobs) for _ in range(64)]
        print(f"in-process CPU, no HTTP (least of 5 runs; gzip by {BACKEND}):")
        for stage, secs in handler_stages(bodies, min(args.groups, 512)).items():
            print(f"  {stage:48s} {secs * 1e6:8.0f} us")
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
