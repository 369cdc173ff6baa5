"""Load user functions named as ``'path/to/file.py:function'`` (or ``'package.module:function'``).

The launcher's warm-up examples, warm-up score and evaluation come from the
environment file itself, so a task ships its own data and metric.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import Any, Callable


def load_function(spec: str) -> Callable[..., Any]:
    """Import ``'path/to/file.py:name'`` (or ``'package.module:name'``) and return the attribute."""
    target, _, attr = spec.partition(":")
    if not attr:
        raise ValueError(f"expected 'file.py:function', got {spec!r}")
    if target.endswith(".py"):
        path = Path(target)
        if not path.exists():
            raise FileNotFoundError(f"{target} does not exist")
        mod_spec = importlib.util.spec_from_file_location(f"_atropos_run_{path.stem}", path)
        module = importlib.util.module_from_spec(mod_spec)  # type: ignore[arg-type]
        mod_spec.loader.exec_module(module)  # type: ignore[union-attr]
    else:
        module = importlib.import_module(target)
    try:
        return getattr(module, attr)
    except AttributeError as exc:
        raise ValueError(f"{target} has no {attr!r}") from exc
