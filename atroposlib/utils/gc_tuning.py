"""Keep the cyclic garbage collector off the objects a server creates at start-up."""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator

__all__ = ["startup_objects_frozen"]


@contextmanager
def startup_objects_frozen() -> Iterator[bool]:
    """Exempt every object alive now (modules, the app, its tokenizer and data) from the
    collector's full passes until the block ends; yields True when it froze them.

    A serving loop's requests and groups live long enough to reach the oldest generation,
    so full passes come every second or so and each walks every object of the process:
    several percent of its CPU. Only reference cycles among the exempted objects wait for
    the end of the block; everything else is freed as before. When another part of the
    process already froze objects, its choice stands and nothing is done here. The freeze
    is always undone on the way out, so a server run inside a longer-lived process (a
    test, a notebook) leaves the collector as it found it.
    """
    if gc.get_freeze_count():
        yield False
        return
    gc.collect()
    gc.freeze()
    try:
        yield True
    finally:
        gc.unfreeze()
