"""Hostile programs in the real bubblewrap sandbox: each ends with a clear reason, and
nothing outside the sandbox (files, sockets, processes, this test) is affected."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from atroposlib.sandbox import EndReason, Sandbox, SandboxConfig


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    return Sandbox(SandboxConfig(timeout_s=5, max_processes=16, memory_mb=256))


def _processes_with(token: str) -> list[int]:
    """Host pids whose command line contains ``token``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if token.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


async def test_network_is_unreachable_even_on_loopback(sandbox):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    port = listener.getsockname()[1]
    code = f"""
import json, socket
out = {{}}
for name, addr in (("loopback", ("127.0.0.1", {port})), ("internet", ("1.1.1.1", 53))):
    s = socket.socket()
    s.settimeout(2)
    try:
        s.connect(addr)
        out[name] = "connected"
    except OSError as e:
        out[name] = type(e).__name__
try:
    socket.getaddrinfo("example.com", 80)
    out["dns"] = "resolved"
except OSError as e:
    out["dns"] = type(e).__name__
print(json.dumps(out))
"""
    try:
        result = await sandbox.run_python(code)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing reached the host's loopback
    finally:
        listener.close()
    assert result.reason is EndReason.OK, result
    out = json.loads(result.stdout)
    assert "connected" not in out.values() and out["dns"] != "resolved", out


async def test_host_files_and_environment_are_invisible(sandbox, tmp_path, monkeypatch):
    secret = f"secret-{uuid.uuid4()}"
    (tmp_path / "secret.txt").write_text(secret)
    monkeypatch.setenv("ATROPOS_TEST_SECRET", secret)
    code = f"""
import json, os
out = {{"env": dict(os.environ)}}
for path in ({str(tmp_path / "secret.txt")!r}, "/etc/shadow", "/etc/passwd", "/root", "/work"):
    try:
        out[path] = open(path).read() if not os.path.isdir(path) else os.listdir(path)
    except OSError as e:
        out[path] = type(e).__name__
print(json.dumps(out))
"""
    result = await sandbox.run_python(code)
    assert result.reason is EndReason.OK, result
    assert secret not in result.stdout and secret not in result.stderr
    out = json.loads(result.stdout)
    assert "ATROPOS_TEST_SECRET" not in out["env"]
    for path in (str(tmp_path / "secret.txt"), "/etc/shadow", "/etc/passwd", "/root", "/work"):
        assert out[path] in ("FileNotFoundError", "PermissionError"), (path, out[path])


async def test_writes_outside_the_private_tmp_fail_and_change_nothing(sandbox, tmp_path):
    marker = f"pwned-{uuid.uuid4().hex}"
    targets = [str(tmp_path / marker), f"/usr/{marker}", f"/{marker}", f"/dev/{marker}"]
    code = f"""
import json
out = {{}}
for path in {targets!r}:
    try:
        open(path, "w").write("x")
        out[path] = "written"
    except OSError as e:
        out[path] = type(e).__name__
open("/tmp/{marker}", "w").write("inside")
out["tmp"] = open("/tmp/{marker}").read()
print(json.dumps(out))
"""
    result = await sandbox.run_python(code)
    assert result.reason is EndReason.OK, result
    out = json.loads(result.stdout)
    assert out.pop("tmp") == "inside"  # the private /tmp is writable...
    assert "written" not in out.values(), out
    for path in [*targets, f"/tmp/{marker}"]:  # ...and none of it reached the host
        assert not os.path.exists(path), path


async def test_no_privileges_and_no_way_to_gain_them(sandbox):
    code = """
import ctypes, json, os
libc = ctypes.CDLL(None, use_errno=True)
out = {"cap_eff": [l.split()[1] for l in open("/proc/self/status") if l.startswith("CapEff")][0]}
out["unshare_user"] = libc.unshare(0x10000000)  # CLONE_NEWUSER: -1 when refused
out["unshare_net"] = libc.unshare(0x40000000)  # CLONE_NEWNET
try:
    os.setuid(0)
    out["setuid"] = "root"
except OSError:  # EINVAL: no uid 0 exists in the sandbox's user namespace
    out["setuid"] = "refused"
print(json.dumps(out))
"""
    result = await sandbox.run_python(code)
    assert result.reason is EndReason.OK, result
    out = json.loads(result.stdout)
    assert out == {
        "cap_eff": "0000000000000000",
        "unshare_user": -1,
        "unshare_net": -1,
        "setuid": "refused",
    }, out


async def test_the_process_limit_stops_forks_inside_one_sandbox(sandbox):
    code = """
import os, time
started = 0
try:
    while started < 100:
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
        started += 1
except OSError as e:
    print(started, type(e).__name__)
"""
    result = await sandbox.run_python(code)
    assert result.reason is EndReason.OK, result
    started, error = result.stdout.split()
    assert int(started) < 16 and error == "BlockingIOError", result.stdout


async def test_a_fork_bomb_is_contained_and_its_neighbour_runs(sandbox):
    token = uuid.uuid4().hex
    bomb = (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    )
    bombed, neighbour = await asyncio.gather(
        sandbox.run_python(bomb, args=[token], timeout_s=0.6),
        sandbox.run_python("import os; os.fork() or print('still forking')"),
    )
    assert bombed.reason in (EndReason.TIMEOUT, EndReason.CPU_LIMIT), bombed
    assert neighbour.reason is EndReason.OK and "still forking" in neighbour.stdout, neighbour
    assert _processes_with(token) == []


async def test_a_memory_hog_ends_with_memory_limit():
    sandbox = Sandbox(SandboxConfig(memory_mb=96))
    code = "chunks = []\nwhile True:\n    chunks.append(bytearray(8 << 20))\n"
    result = await sandbox.run_python(code)
    assert result.reason is EndReason.MEMORY_LIMIT, result
    assert "memory limit" in result.message


async def test_an_infinite_loop_is_killed_at_the_deadline(sandbox):
    result = await sandbox.run_python("while True:\n    pass\n", timeout_s=0.5)
    assert result.reason is EndReason.TIMEOUT, result
    assert 0.5 <= result.duration_s < 4.0
    assert "0.5 s deadline" in result.message


async def test_cpu_time_is_bounded_separately_from_the_deadline():
    sandbox = Sandbox(SandboxConfig(timeout_s=8, cpu_seconds=1))
    result = await sandbox.run_python("while True:\n    pass\n")
    assert result.reason is EndReason.CPU_LIMIT, result
    assert result.duration_s < 8.0


async def test_an_output_flood_is_cut_at_the_bound():
    sandbox = Sandbox(SandboxConfig(max_output_bytes=64 << 10))
    result = await sandbox.run_python("while True:\n    print('x' * 1000)\n")
    assert result.reason is EndReason.OUTPUT_LIMIT, result
    assert result.stdout_truncated and len(result.stdout) == 64 << 10


@pytest.mark.parametrize(
    ("path", "limits"),
    [
        ("/tmp/big", {"max_file_mb": 1}),  # one file beyond RLIMIT_FSIZE
        ("/tmp/big", {"tmp_mb": 1}),  # a full private /tmp
        ("/dev/shm/big", {"tmp_mb": 1}),  # and /dev/shm, bounded the same way
    ],
)
async def test_big_files_stop_at_the_file_size_or_tmp_limit(path, limits):
    sandbox = Sandbox(SandboxConfig(**limits))
    result = await sandbox.run_python(f"open({path!r}, 'wb').write(b'x' * (2 << 20))")
    assert result.reason is EndReason.FILE_SIZE_LIMIT, result


async def test_killing_the_parent_or_the_host_reaches_nothing(sandbox):
    code = f"""
import os, signal
for pid in (os.getppid(), 1, -1, {os.getpid()}):
    try:
        os.kill(pid, signal.SIGKILL)
        print(pid, "sent", flush=True)
    except OSError as e:
        print(pid, type(e).__name__, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""
    result = await sandbox.run_python(code)
    assert result.reason is EndReason.SIGNAL and result.signal == 9, result
    assert "SIGKILL" in result.message
    assert f"{os.getpid()} ProcessLookupError" in result.stdout  # this test is not visible
    again = await sandbox.run_python("print('fine')")
    assert again.ok and again.stdout == "fine\n"


@pytest.mark.parametrize("then", ["exit", "loop"])
async def test_no_process_outlives_the_run(sandbox, then):
    token = uuid.uuid4().hex
    code = f"""
import subprocess, sys
# A daemon in its own session, and a grandchild whose parent exits at once.
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "{token}"],
                 start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
subprocess.Popen(["/bin/sh", "-c", "(sleep 60; echo {token}) &"])
print("spawned", flush=True)
if {then!r} == "loop":
    while True:
        pass
"""
    result = await sandbox.run_python(code, timeout_s=1.0)
    expected = EndReason.OK if then == "exit" else EndReason.TIMEOUT
    assert result.reason is expected, result
    assert "spawned" in result.stdout
    assert _processes_with(token) == []


def test_the_sandbox_dies_with_the_process_that_started_it():
    token = uuid.uuid4().hex
    starter = (
        "import asyncio, sys\n"
        "from atroposlib.sandbox import Sandbox\n"
        "code = 'import time\\ntime.sleep(60)'\n"
        "asyncio.run(Sandbox().run_python(code, args=[sys.argv[1]]))\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", starter, token])

    def sandboxed() -> list[int]:  # the starter's own command line holds the token too
        return [pid for pid in _processes_with(token) if pid != proc.pid]

    try:
        for _ in range(200):  # the sandboxed sleeper appears (at most ~20 s on a loaded machine)
            if sandboxed():
                break
            time.sleep(0.1)
        assert sandboxed(), "the sandboxed program never started"
        proc.kill()  # SIGKILL: no cleanup code runs in the starter
        proc.wait(timeout=10)
        for _ in range(50):
            if not sandboxed():
                break
            time.sleep(0.1)
        assert sandboxed() == []
    finally:
        proc.kill()
        proc.wait(timeout=10)
