"""The directory of a program this interpreter runs (the verifiers chat program): ``mkdtemp``
under a base only this user can write, checked by file descriptor; what is in the way is
refused with an error that says what to do."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from atroposlib.envs.adapters._private_dir import (
    PrivateDirError,
    check_private,
    default_base,
    private_dir,
)

pytestmark = pytest.mark.skipif(os.name != "posix", reason="POSIX permissions")


@pytest.fixture
def base(tmp_path: Path) -> Path:
    path = tmp_path / "base"
    path.mkdir(mode=0o700)
    return path


def test_each_call_makes_a_fresh_0700_directory_of_this_users_under_the_base(base):
    first, second = private_dir("atropos-chat-", base), private_dir("atropos-chat-", base)
    assert first != second and first.parent == base == second.parent
    assert first.name.startswith("atropos-chat-")
    info = first.stat()
    assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.getuid()
    check_private(first)


def test_a_missing_base_is_made_private(tmp_path):
    made = private_dir("p-", tmp_path / "deep" / "base")
    assert stat.S_IMODE((tmp_path / "deep" / "base").stat().st_mode) == 0o700
    assert made.parent == tmp_path / "deep" / "base"


def test_a_plain_file_at_the_base_name_is_the_clear_error_not_file_exists(tmp_path):
    """``mkdir(exist_ok=True)`` raised FileExistsError here."""
    blocker = tmp_path / "base"
    blocker.write_text("not a directory")
    with pytest.raises(PrivateDirError, match=r"base is not a directory \(a file is in the way\)"):
        private_dir("p-", blocker)


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777, 0o722])
def test_a_base_others_can_write_is_refused(base, mode):
    base.chmod(mode)
    with pytest.raises(PrivateDirError, match="writable by others"):
        private_dir("p-", base)
    assert list(base.iterdir()) == []  # nothing made there


def test_a_symbolic_link_as_the_base_is_refused(tmp_path, base):
    link = tmp_path / "link"
    link.symlink_to(base)
    with pytest.raises(PrivateDirError, match="is a symbolic link"):
        private_dir("p-", link)


def test_a_base_under_a_directory_others_can_write_is_refused(tmp_path):
    """The swap the check must rule out: a writable, non-sticky parent lets anyone rename the
    base away and put their own in its place between the check and the run."""
    open_parent = tmp_path / "open"
    open_parent.mkdir()
    open_parent.chmod(0o777)
    (open_parent / "base").mkdir(mode=0o700)
    with pytest.raises(PrivateDirError, match=r"open \(above .*\) is writable by others"):
        private_dir("p-", open_parent / "base")
    open_parent.chmod(0o1777)  # sticky, like /tmp: only an entry's owner may move it
    assert private_dir("p-", open_parent / "base").parent == open_parent / "base"


def test_a_directory_that_became_readable_by_others_is_refused_on_the_next_check(base):
    made = private_dir("p-", base)
    made.chmod(0o755)
    with pytest.raises(PrivateDirError, match="mode 0755; it must be mode 0700"):
        check_private(made)


def test_a_directory_swapped_for_a_link_is_refused_on_the_next_check(tmp_path, base):
    made = private_dir("p-", base)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    made.rmdir()
    made.symlink_to(elsewhere)
    with pytest.raises(PrivateDirError, match="symbolic link"):
        check_private(made)


def test_the_default_base_is_the_users_runtime_dir_else_their_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert default_base() == tmp_path
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_base() == tmp_path / "home" / ".cache" / "atropos"
