"""The adapters import their libraries only when an environment is set up, so the core
(and the adapter modules themselves) import without the extras."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT

_SCRIPT = """
import sys
import atroposlib
import atroposlib.envs.adapters.reasoning_gym
import atroposlib.envs.adapters.text_games
import atroposlib.envs.adapters.textarena
import atroposlib.envs.adapters.verifiers_v1
loaded = sorted(m for m in ("reasoning_gym", "textarena", "verifiers") if m in sys.modules)
print(",".join(loaded) or "none")
"""


def test_importing_the_adapters_loads_neither_library():
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        check=True,
    )
    assert out.stdout.strip() == "none", out.stdout
