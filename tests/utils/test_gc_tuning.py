"""startup_objects_frozen: freezes what exists, undoes it on the way out, leaves an
earlier freeze alone."""

from __future__ import annotations

import gc

import pytest

from atroposlib.utils.gc_tuning import startup_objects_frozen


@pytest.fixture(autouse=True)
def no_freeze():
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_the_block_freezes_what_exists_and_undoes_it():
    with startup_objects_frozen() as froze:
        assert froze and gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0


def test_the_freeze_is_undone_when_the_block_raises():
    with pytest.raises(RuntimeError), startup_objects_frozen():
        raise RuntimeError("stop")
    assert gc.get_freeze_count() == 0


def test_an_earlier_freeze_stands():
    gc.freeze()
    before = gc.get_freeze_count()
    with startup_objects_frozen() as froze:
        assert not froze
    # frozen objects that die meanwhile (another thread's garbage) leave the count, so the
    # count may drop a little; undoing the earlier freeze would drop it to 0
    assert gc.get_freeze_count() > before // 2


def test_the_rollout_api_run_in_process_leaves_no_freeze_behind():
    from fastapi.testclient import TestClient

    from atroposlib.api.server import create_app

    with TestClient(create_app()):  # runs the app's lifespan: start-up, then shutdown
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0
