"""Throttling arithmetic of the serve loop and the worker pool's re-queue rules."""

from __future__ import annotations

import asyncio

from hypothesis import given
from hypothesis import strategies as st

from atroposlib.envs.scheduling import (
    EnvStatus,
    derived_batch_size,
    offpolicy_full,
    should_terminate,
    train_worker_cap,
)
from atroposlib.envs.workers import WorkerPool


def cap(**overrides):
    args = dict(
        max_num_workers=16,
        eval_running=False,
        eval_handling="STOP_TRAIN",
        eval_limit_ratio=0.5,
        max_batches_offpolicy=3,
        derived_batch=32,
        group_size=4,
        status=EnvStatus(),
        min_batch_allocation=None,
        batch_size=32,
    )
    args.update(overrides)
    return train_worker_cap(**args)


def test_eval_handling_stop_limit_none():
    assert cap(eval_running=True, eval_handling="STOP_TRAIN") == 0
    assert cap(eval_running=True, eval_handling="LIMIT_TRAIN") == 8
    assert cap(eval_running=True, eval_handling="NONE") == 16


def test_offpolicy_cap_subtracts_queued_groups():
    # 3 batches of 32 sequences = 24 groups of 4; 20 already queued -> 4 more.
    assert cap(status=EnvStatus(queue_size=20)) == 4
    assert cap(status=EnvStatus(queue_size=30)) == 0
    assert cap(max_batches_offpolicy=0, status=EnvStatus(queue_size=30)) == 16


def test_min_allocation_raises_cap_to_fill_own_quota():
    status = EnvStatus(queue_size=40, self_queue_size=0, max_group_size=4)
    assert cap(status=status) == 0
    assert cap(status=status, min_batch_allocation=0.5) == 4  # 16 sequences = 4 groups


@given(
    workers=st.integers(0, 512),
    queued=st.integers(0, 10_000),
    mbo=st.integers(-1, 8),
    gs=st.sampled_from([1, 2, 4, 8, 16]),
    bs=st.sampled_from([-1, 16, 64, 256]),
    evaluating=st.booleans(),
    handling=st.sampled_from(["STOP_TRAIN", "LIMIT_TRAIN", "NONE"]),
)
def test_cap_is_never_negative_and_never_above_workers_without_min_alloc(
    workers, queued, mbo, gs, bs, evaluating, handling
):
    status = EnvStatus(queue_size=queued)
    derived = derived_batch_size(bs, status, None)
    value = cap(
        max_num_workers=workers,
        status=status,
        max_batches_offpolicy=mbo,
        group_size=gs,
        batch_size=bs,
        derived_batch=derived,
        eval_running=evaluating,
        eval_handling=handling,
    )
    assert 0 <= value <= workers
    if evaluating and handling == "STOP_TRAIN":
        assert value == 0


def test_pause_rule_and_termination():
    status = EnvStatus(current_step=5, queue_size=24)
    assert offpolicy_full(status, 4, 32, 3, None) is True
    assert offpolicy_full(status, 4, 32, 0, None) is False
    assert offpolicy_full(status, 4, 32, 3, 0.5) is False  # own quota not queued yet
    assert should_terminate(status, 4, 32, total_steps=7) is True  # 5 + 3 > 7
    assert should_terminate(status, 4, 32, total_steps=8) is False
    assert derived_batch_size(-1, status, None) == -1
    assert derived_batch_size(64, EnvStatus(unallocated_fraction=0.5), 0.25) == 48


def test_status_payload_with_missing_fields_uses_defaults():
    status = EnvStatus.from_payload({"current_step": 3, "queue_size": None})
    assert status.current_step == 3 and status.queue_size == 0 and status.max_group_size == 1


async def test_timed_out_item_is_requeued_once_then_dropped():
    pool = WorkerPool()

    async def hang(_key):
        await asyncio.sleep(3600)

    key = pool.spawn("item-a", hang)
    pool.running[key]["start_time"] -= 10
    assert pool.reap_timeouts(5) == []
    assert list(pool.requeue) == [("item-a", 1)]
    item, timeouts = pool.requeue.popleft()
    key = pool.spawn(item, hang, timeouts=timeouts)
    pool.running[key]["start_time"] -= 10
    assert pool.reap_timeouts(5) == ["item-a"]
    assert pool.timed_out_dropped == 1 and not pool.requeue
    await pool.wait_all(1)
    assert len(pool) == 0


async def test_sending_workers_are_not_cancelled_by_pause():
    pool = WorkerPool()
    release = asyncio.Event()
    finished = []

    async def work(key):
        pool.mark_sending(key)
        await release.wait()
        finished.append(key)

    key = pool.spawn("x", work)
    await asyncio.sleep(0)
    assert pool.park_all() == 0
    release.set()
    await pool.wait_all(1)
    assert finished == [key] and not pool.requeue


async def test_park_excess_cancels_newest_and_requeues_fifo():
    pool = WorkerPool()

    async def hang(_key):
        await asyncio.sleep(3600)

    for i in range(4):
        key = pool.spawn(i, hang)
        pool.running[key]["start_time"] += i
    assert pool.park_excess(2) == 2
    assert sorted(item for item, _ in pool.requeue) == [2, 3]
    pool.park_all()
    await pool.wait_all(1)
