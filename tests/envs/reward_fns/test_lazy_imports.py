"""Importing the reward package stays cheap: math-verify/sympy load on the first math reward."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("sympy", "math_verify", "latex2sympy2_extended")

PROBE = """
import json, sys
import atroposlib.envs.reward_fns as rf
before = [m for m in {heavy!r} if m in sys.modules]
names = rf.registry.list()
fmt = rf.registry.create("format")(["<think>a</think> b"])
after_format = [m for m in {heavy!r} if m in sys.modules]
acc = rf.registry.create("accuracy")(["so \\\\boxed{{12}}"], solution="12")
after_math = [m for m in {heavy!r} if m in sys.modules]
print(json.dumps(dict(before=before, names=names, after_format=after_format,
                      acc=acc, after_math=after_math)))
"""


def test_reward_package_import_defers_math_verify():
    """A fresh interpreter: the import and a non-math reward leave sympy unloaded."""
    proc = subprocess.run(
        [sys.executable, "-c", PROBE.format(heavy=HEAVY)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["before"] == [], out
    assert "accuracy" in out["names"] and "format" in out["names"]
    assert out["after_format"] == [], out
    assert out["acc"] == [1.0]
    assert set(out["after_math"]) >= {"sympy", "math_verify"}


def test_importtime_of_reward_package_has_no_sympy():
    """``python -X importtime``, the measurement the issue used, lists no sympy module."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import atroposlib.envs.reward_fns"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines()}
    assert "atroposlib.envs.reward_fns" in imported
    assert not any(name.split(".")[0] in HEAVY for name in imported)
