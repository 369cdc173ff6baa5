"""The slot KV cache on its own: cached forward passes against full forward passes."""

from __future__ import annotations

import pytest
import torch

from atroposlib.serving.kv_cache import (
    STAGING_SLOTS,
    SlotKV,
    budget_plan,
    bytes_per_slot,
    plan_slots,
)
from atroposlib.utils.transformers_compat import forward_with_cache


def _full_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def _pass(model, kv: SlotKV, slots: list[int], chunks: list[list[int]], starts: list[int]):
    """One forward over ``chunks`` (equal lengths) continuing rows in ``slots``."""
    q = len(chunks[0])
    pos = torch.tensor([[s + j for j in range(q)] for s in starts])
    length = max(starts) + q
    rows = torch.tensor(slots)
    cache = kv.pass_view(
        rows,
        torch.tensor([s for s in slots for _ in range(q)]),
        pos.reshape(-1),
        length,
    )
    mask = (torch.arange(length) <= pos.unsqueeze(-1)).unsqueeze(1)
    with torch.no_grad():
        return forward_with_cache(model, torch.tensor(chunks), pos, mask, cache, 0)


def test_cached_steps_match_full_forward_with_rows_of_different_ages(local_model):
    """Two sequences of different lengths share decode passes from different slots;
    one is then moved to another slot and forked, and every step's logits equal a
    full forward pass over the whole sequence."""
    model = local_model
    kv = SlotKV.for_model(model, 6, 64)
    a = [5, 17, 99, 3, 250, 41, 7]
    b = [12, 8, 300]
    _pass(model, kv, [0], [a], [0])
    _pass(model, kv, [3], [b], [0])
    seq = {0: list(a), 3: list(b)}
    for step in range(5):
        nxt = {s: (s * 31 + step * 7) % 200 + 1 for s in seq}
        starts = [len(seq[0]), len(seq[3])]
        logits = _pass(model, kv, [0, 3], [[nxt[0]], [nxt[3]]], starts)
        for row, s in enumerate((0, 3)):
            seq[s].append(nxt[s])
            want = _full_logits(model, seq[s])[-1]
            assert torch.allclose(logits[row, -1], want, atol=1e-4)
    kv.move([1], [3], len(seq[3]))
    kv.fork(1, [4, 5], len(seq[3]))
    for slot in (1, 4, 5):
        logits = _pass(model, kv, [slot], [[9]], [len(seq[3])])
        want = _full_logits(model, seq[3] + [9])[-1]
        assert torch.allclose(logits[0, -1], want, atol=1e-4)


def test_writes_land_in_place_without_reallocation(local_model):
    kv = SlotKV.for_model(local_model, 3, 32)
    before = kv.kv.data_ptr()
    _pass(local_model, kv, [2], [[4, 5, 6]], [0])
    assert kv.kv.data_ptr() == before
    assert kv.kv[:, :, 2, :, :3].abs().sum() > 0
    assert kv.kv[:, :, 2, :, 3:].abs().sum() == 0  # nothing past the written positions
    assert kv.kv[:, :, :2].abs().sum() == 0  # other slots untouched


def test_cpu_cache_is_sized_by_max_num_seqs(local_model):
    plan = plan_slots(
        local_model, max_len=128, max_num_seqs=7, max_prefill_tokens=64, gpu_memory_fraction=0.5
    )
    assert plan.slots == 7 and plan.reason == "--max-num-seqs"
    assert plan.bytes_per_slot == bytes_per_slot(local_model.config, 128, torch.float32)
    cfg = local_model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    assert plan.bytes_per_slot == 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (
        head_dim * 128 * 4
    )
    assert plan.total_bytes == (7 + STAGING_SLOTS) * plan.bytes_per_slot


def test_gpu_budget_limits_the_slots_and_refuses_when_nothing_fits():
    gib = 2**30
    common = dict(per_slot=gib // 4, max_len=4096, fraction=0.5)
    # 0.5 * 40 GiB - 2 GiB held - 6 GiB reserved = 12 GiB -> 48 slots, 2 of them staging
    plan = budget_plan(total=40 * gib, free=38 * gib, held=2 * gib, reserve=6 * gib,
                       max_num_seqs=256, **common)  # fmt: skip
    assert plan.slots == 46 and "gpu-memory-fraction" in plan.reason
    # another process holds most of the device: what is free bounds it
    plan = budget_plan(total=40 * gib, free=8 * gib, held=2 * gib, reserve=6 * gib,
                       max_num_seqs=256, **common)  # fmt: skip
    assert plan.slots == 8 - STAGING_SLOTS
    plan = budget_plan(total=40 * gib, free=38 * gib, held=0, reserve=0,
                       max_num_seqs=16, **common)  # fmt: skip
    assert plan.slots == 16 and plan.reason == "--max-num-seqs"
    with pytest.raises(ValueError, match="max-model-len"):
        budget_plan(total=40 * gib, free=38 * gib, held=2 * gib, reserve=17 * gib + gib // 2,
                    max_num_seqs=4, **common)  # fmt: skip


def test_cpu_reservation_never_exceeds_the_machine_ram():
    from atroposlib.serving.kv_cache import _host_plan

    mib = 2**20
    assert _host_plan(16 * mib, 1024, 256, 64 * 1024 * mib).slots == 256
    capped = _host_plan(400 * mib, 32768, 256, 24 * 1024 * mib)
    assert capped.slots == 24 * 1024 // 400 - STAGING_SLOTS and capped.reason == "the machine's RAM"
    with pytest.raises(ValueError, match="max-model-len"):
        _host_plan(400 * mib, 32768, 256, 1000 * mib)
