"""The ``inference-node-wandb-watcher`` console command as a process (its smoke): the installed
script starts, and a missing required flag is exit 2 with argparse's line naming it. The
watcher's loop is tested in-process in ``tests/frontend/test_original_helpers.py``."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path


def _command() -> list[str]:
    script = Path(sys.executable).with_name("inference-node-wandb-watcher")
    if script.exists():
        return [str(script)]
    found = shutil.which("inference-node-wandb-watcher")
    assert found, "the console script is not installed (pip install -e .)"
    return [found]


def test_console_script_exits_2_naming_the_missing_flag(tmp_path):
    done = subprocess.run(_command(), cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "--tp" in done.stderr
    assert "Traceback" not in done.stderr
