"""A sandbox that cannot isolate code refuses to start, naming the fix; bad inputs to a run
are refused before anything starts."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from atroposlib.sandbox import EndReason, Sandbox, SandboxConfig, SandboxUnavailable
from atroposlib.sandbox.command import bwrap_argv


def test_missing_bubblewrap_names_the_install_command():
    with pytest.raises(SandboxUnavailable, match=r"apt-get install bubblewrap"):
        Sandbox(SandboxConfig(bwrap="no-such-bwrap-here"))


@pytest.fixture
def refusing_bwrap():
    """A bwrap that fails as bubblewrap does where user namespaces are off (any user can run it)."""
    folder = Path(tempfile.mkdtemp(prefix="fake-bwrap-"))
    folder.chmod(0o755)
    script = folder / "bwrap"
    script.write_text(
        "#!/bin/sh\necho 'bwrap: No permissions to creating new namespace, likely because the "
        "kernel does not allow non-privileged user namespaces.' >&2\nexit 1\n"
    )
    script.chmod(0o755)
    yield str(script)
    shutil.rmtree(folder)


def test_refused_namespaces_name_the_sysctl_fix(refusing_bwrap):
    with pytest.raises(SandboxUnavailable) as info:
        Sandbox(SandboxConfig(bwrap=refusing_bwrap))
    message = str(info.value)
    assert "No permissions to creating new namespace" in message  # what bubblewrap said
    assert "user namespaces" in message and "sysctl" in message  # and the fix


def test_the_command_isolates_everything_and_limits_inside():
    config = SandboxConfig(timeout_s=3, memory_mb=128, max_processes=8, max_file_mb=2, tmp_mb=4)
    argv = bwrap_argv("bwrap", config, ["python3", "main.py"], files=[(5, "main.py")], info_fd=4)
    text = " ".join(argv)
    for flag in (
        "--unshare-all",
        "--unshare-user",
        "--disable-userns",
        "--die-with-parent",
        "--new-session",
        "--clearenv",
        "--remount-ro / ",
        "--cap-drop ALL",
    ):
        assert flag in text, flag
    assert "--size 4194304 --tmpfs /tmp" in text and "--file 5 /tmp/main.py" in text
    limits = argv[argv.index("--") + 1 : argv.index("python3")]
    assert limits == [
        "/usr/bin/prlimit",
        "--cpu=3:4",
        f"--as={128 << 20}",
        f"--fsize={2 << 20}",
        "--nproc=8",
        "--nofile=64",
        "--core=0",
        "--",
    ]
    mounted = {argv[i + 1] for i, a in enumerate(argv) if a in ("--bind", "--ro-bind")}
    assert "/" not in mounted and "/home" not in mounted and "/etc" not in mounted


async def test_bad_inputs_are_refused_before_a_run():
    sandbox = Sandbox(SandboxConfig(max_input_bytes=10))
    with pytest.raises(ValueError, match="stdin: 11 bytes"):
        await sandbox.run_python("pass", stdin="x" * 11)
    with pytest.raises(ValueError, match="not a plain file name"):
        await sandbox.run_python("pass", files={"../evil": "x"})
    ok = await sandbox.run_python(
        "import sys; print(sys.argv[1], open('data.txt').read())",
        args=["arg"],
        files={"data.txt": "content"},
    )
    assert ok.reason is EndReason.OK and ok.stdout == "arg content\n", ok


async def test_extra_read_only_paths_are_visible_and_read_only():
    folder = Path(tempfile.mkdtemp(prefix="sandbox-ro-"))
    try:
        folder.chmod(0o755)
        (folder / "lib.py").write_text("VALUE = 42\n")
        (folder / "lib.py").chmod(0o644)
        sandbox = Sandbox(SandboxConfig(ro_paths=[str(folder)]))
        code = (
            f"import sys; sys.path.insert(0, {str(folder)!r}); import lib; print(lib.VALUE)\n"
            f"open({str(folder / 'new.txt')!r}, 'w')\n"
        )
        result = await sandbox.run_python(code)
        assert result.stdout == "42\n" and "Read-only file system" in result.stderr, result
        assert not (folder / "new.txt").exists()
        with pytest.raises(ValueError, match="ro_paths"):
            Sandbox(SandboxConfig(ro_paths=[str(folder / "missing")]))
    finally:
        shutil.rmtree(folder)
