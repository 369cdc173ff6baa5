"""The managed-server proxy in front of a hostile inference server (issue: "a hostile or broken
upstream exhausts the proxy").

Starts the hostile upstream double (``tests/hostile_upstream.py``) and a proxy
process over it, then for each hostile answer posts one chat request while a thread polls
``/health``. Prints the answer's status and time, the proxy's RSS before / at its peak /
after (read from ``/proc``, so the machine's load does not change it), and the slowest
``/health`` answer seen meanwhile (this one does depend on the load). Extra arguments go
to the proxy (e.g. ``--max-upstream-mb 256``).

    .venv/bin/python benchmarks/proxy_hostile_upstream.py [--max-upstream-mb N]
"""

from __future__ import annotations

import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from atroposlib.testing.ports import free_port  # noqa: E402
from atroposlib.testing.processes import PYTHON, start_process, stop_process, wait_http  # noqa: E402
from atroposlib.tiny_model import load_tiny_tokenizer  # noqa: E402
from tests.hostile_upstream import HOSTILE, Upstream  # noqa: E402

CASES = [
    ("Content-Length 10**12, then 300 MB", {"mode": "huge_length", "mb": 300}),
    ("300 MB read-to-close", {"mode": "stream_close", "mb": 300}),
    ("100 MB of headers without an end", {"mode": "endless_headers", "mb": 100}),
    ("3 MB in 1-byte chunks", {"mode": "chunked", "pad": 3_000_000, "chunk": 1}),
    (
        "20 MB in 64-byte chunks (a valid answer)",
        {"mode": "chunked", "pad": 20_000_000, "chunk": 64},
    ),
]


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def _case(url: str, sid: str, pid: int) -> str:
    before = _rss_mb(pid)
    peak, worst, done = [before], [0.0], threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss_mb(pid))
            started = time.perf_counter()
            httpx.get(f"{url}/health", timeout=120)
            worst[0] = max(worst[0], time.perf_counter() - started)
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    started = time.perf_counter()
    r = httpx.post(
        f"{url}/{sid}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        timeout=600,
    )
    elapsed = time.perf_counter() - started
    done.set()
    watcher.join()
    detail = r.json()["error"]["message"][:90] if r.status_code != 200 else "choices returned"
    return (
        f"{r.status_code} in {elapsed:.1f}s; RSS {before:.0f} -> peak {peak[0]:.0f} -> after "
        f"{_rss_mb(pid):.0f} MB; slowest /health {worst[0] * 1000:.0f} ms; {detail}"
    )


def main() -> None:
    tmp = Path(tempfile.mkdtemp())
    load_tiny_tokenizer().save_pretrained(tmp / "tok")
    up_port, port = free_port(), free_port()
    upstream_proc = start_process([*HOSTILE, "--port", str(up_port)], cwd=ROOT)
    upstream = Upstream("127.0.0.1", up_port)
    proxy = None
    try:
        wait_http(f"{upstream.url}/health", timeout=30, proc=upstream_proc)
        server = {"base_url": f"{upstream.url}/v1", "server_type": "vllm", "timeout": 120}
        (tmp / "servers.json").write_text(
            json.dumps({"servers": [{**server, "health_check": False}]})
        )
        proxy = start_process(
            [PYTHON, "-m", "atroposlib.envs.server_handling.managed_server_proxy"]
            + ["--port", str(port), "--config", str(tmp / "servers.json")]
            + ["--tokenizer", str(tmp / "tok"), *sys.argv[1:]],
            log_path=tmp / "proxy.log",
            env={"HF_HUB_OFFLINE": "1"},
            cwd=ROOT,
        )
        url = f"http://127.0.0.1:{port}"
        wait_http(f"{url}/health", timeout=120, proc=proxy)
        sid = httpx.post(f"{url}/sessions/create", json={}).json()["uuid"]
        for name, mode in CASES:
            upstream.mode(**mode)
            print(f"{name}: {_case(url, sid, proxy.pid)}", flush=True)
    finally:
        if proxy is not None:
            stop_process(proxy)
        stop_process(upstream_proc)


if __name__ == "__main__":
    main()
