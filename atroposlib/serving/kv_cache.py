"""A preallocated KV cache of fixed slots, written in place.

The whole cache is one tensor ``[layers, 2, slots, kv_heads, max_len, head_dim]``,
allocated once when the server starts. Slot ``s`` holds one sequence: the keys and
values of its token at position ``p`` live at ``[:, :, s, :, p]``, so a sequence's
cache never moves while it is decoded and a decode step only writes one column per
row. Rotary position is applied to keys before they are stored, which is why a
sequence may be copied to another slot (compaction, ``n > 1`` forks) unchanged.

:class:`SlotCache` is what one forward pass sees: a ``transformers`` ``Cache``
(through :mod:`atroposlib.utils.transformers_compat`)
whose ``update`` scatters the new keys/values into their slots and returns views
of the rows of this pass up to the longest row (masked per row by the caller),
instead of concatenating tensors as ``DynamicCache`` does.

How many slots fit is decided by :func:`plan_slots`: ``--max-num-seqs`` on CPU
(the memory is reserved lazily and touched only as sequences grow; at most the
machine's RAM is reserved), and on CUDA
what ``--gpu-memory-fraction`` of the device leaves after the weights, a second
copy of them for a weight update (none with ``--swap-in-place``), and the
activations of the largest step.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from atroposlib.utils.transformers_compat import CacheAdapter

logger = logging.getLogger(__name__)

STAGING_SLOTS = 2
"""Extra slots for a prompt whose prefill spans steps (one finishing, one starting)."""


def model_kv_shape(config: Any) -> tuple[int, int, int]:
    """``(layers, kv_heads, head_dim)`` of a decoder-only ``transformers`` config."""
    text = getattr(config, "get_text_config", lambda: config)()
    layers = int(text.num_hidden_layers)
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return layers, kv_heads, int(head_dim)


def check_supported(config: Any) -> None:
    """Refuse architectures whose layers are not plain (or sliding-window) attention."""
    text = getattr(config, "get_text_config", lambda: config)()
    kinds = set(getattr(text, "layer_types", None) or ["full_attention"])
    unknown = kinds - {"full_attention", "sliding_attention"}
    if unknown:
        raise ValueError(
            f"the slot KV cache supports full and sliding-window attention layers; this "
            f"model has {sorted(unknown)}"
        )


def _lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros that cost no resident memory until written, on CPU.

    ``numpy.zeros`` maps fresh zero pages (calloc), so a large reservation only
    takes RAM as sequences fill it; unwritten positions must read as finite zeros
    because masked keys still pass through the attention product.
    """
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    count = int(np.prod(shape))
    raw = torch.from_numpy(np.zeros(count * itemsize, dtype=np.uint8))
    return raw.view(dtype).view(shape)


@dataclass(frozen=True)
class CachePlan:
    """How many sequence slots the cache holds and what that costs."""

    slots: int
    max_len: int
    bytes_per_slot: int
    reason: str

    @property
    def total_bytes(self) -> int:
        """Bytes of the whole cache, staging slots included."""
        return (self.slots + STAGING_SLOTS) * self.bytes_per_slot


def bytes_per_slot(config: Any, max_len: int, dtype: torch.dtype) -> int:
    """Bytes of keys and values for one sequence of ``max_len`` tokens."""
    layers, kv_heads, head_dim = model_kv_shape(config)
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * layers * kv_heads * head_dim * max_len * itemsize


def plan_slots(
    model: Any,
    *,
    max_len: int,
    max_num_seqs: int,
    max_prefill_tokens: int,
    gpu_memory_fraction: float,
    update_copy: bool = True,
) -> CachePlan:
    """Size the cache: ``max_num_seqs`` slots on CPU; on CUDA as many as the budget allows.

    The CUDA budget is ``gpu_memory_fraction`` of the device minus the memory torch
    already holds (the weights), one more copy of the weights (a weight update loads
    the new checkpoint while the old one serves; not with ``update_copy=False``, for
    ``--swap-in-place``), and the activations of the largest
    step (logits of ``max(max_num_seqs, max_prefill_tokens)`` rows in float32 plus the
    sampling buffers, and the hidden states of a prefill chunk). Raises ``ValueError``
    when not even one sequence of ``max_len`` tokens fits.
    """
    param = next(model.parameters())
    dtype, device = param.dtype, param.device
    per_slot = bytes_per_slot(model.config, max_len, dtype)
    if device.type != "cuda":
        return _host_plan(per_slot, max_len, max_num_seqs, _physical_ram())
    text = model.config.get_text_config()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    vocab = int(model.get_output_embeddings().weight.shape[0])
    rows = max(max_num_seqs, max_prefill_tokens)
    hidden = int(text.hidden_size)
    inter = int(getattr(text, "intermediate_size", 4 * hidden))
    activations = (
        rows * vocab * 16
        + max_prefill_tokens * (8 * hidden + 4 * inter) * param.element_size()
        + (256 << 20)
    )
    total = torch.cuda.get_device_properties(device).total_memory
    free, _ = torch.cuda.mem_get_info(device)
    held = torch.cuda.memory_reserved(device)
    return budget_plan(
        total=total,
        free=free,
        held=held,
        reserve=(weights if update_copy else 0) + activations,
        per_slot=per_slot,
        max_len=max_len,
        max_num_seqs=max_num_seqs,
        fraction=gpu_memory_fraction,
    )


def _physical_ram() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _host_plan(per_slot: int, max_len: int, max_num_seqs: int, ram: int) -> CachePlan:
    """``max_num_seqs`` slots, but never a reservation larger than the machine's RAM
    (pages are touched lazily, yet the kernel may refuse an absurd mapping)."""
    fits = ram // per_slot - STAGING_SLOTS
    if fits < 1:
        raise ValueError(
            f"the KV cache needs {per_slot / 2**20:.0f} MiB per sequence at max_model_len="
            f"{max_len}, more than this machine's RAM allows; lower --max-model-len"
        )
    if fits < max_num_seqs:
        return CachePlan(fits, max_len, per_slot, "the machine's RAM")
    return CachePlan(max_num_seqs, max_len, per_slot, "--max-num-seqs")


def budget_plan(
    *,
    total: int,
    free: int,
    held: int,
    reserve: int,
    per_slot: int,
    max_len: int,
    max_num_seqs: int,
    fraction: float,
) -> CachePlan:
    """Slots that fit in ``fraction * total`` bytes minus what is ``held`` and ``reserve``d.

    Never more than the device has ``free``; raises ``ValueError`` when no sequence fits.
    """
    budget = min(fraction * total - held, free) - reserve
    fits = int(budget // per_slot) - STAGING_SLOTS
    if fits < 1:
        raise ValueError(
            f"the KV cache needs {per_slot / 2**20:.0f} MiB per sequence at max_model_len="
            f"{max_len}, and only {max(budget, 0) / 2**20:.0f} MiB are left of "
            f"--gpu-memory-fraction {fraction}; lower --max-model-len or raise "
            f"--gpu-memory-fraction"
        )
    if fits < max_num_seqs:
        return CachePlan(fits, max_len, per_slot, f"--gpu-memory-fraction {fraction}")
    return CachePlan(max_num_seqs, max_len, per_slot, "--max-num-seqs")


def kv_cache_line(
    slots: int, max_len: int, nbytes: int, device: torch.device, dtype: torch.dtype, reason: str
) -> str:
    """The start-up log line that says what the cache costs, truthfully per device.

    On CUDA the whole cache is allocated at start. On CPU it is a bound: the zero pages
    are mapped, not committed, and only the positions sequences actually reach take RAM
    (a tiny model's 256 x 32768-token reservation is a few GiB of address space while the
    process stays at a few hundred MB).
    """
    size = f"{slots} sequences x {max_len} tokens"
    mib = nbytes / 2**20
    if device.type == "cpu":
        return (
            f"KV cache: {size} (sized by {reason}); up to {mib:.1f} MiB of {dtype} on cpu, "
            "reserved as address space only: RAM is used as sequences grow (lower "
            "--max-num-seqs or --max-model-len to lower the bound)"
        )
    return f"KV cache: {size} = {mib:.1f} MiB of {dtype} allocated on {device} (sized by {reason})"


class SlotKV:
    """The preallocated cache: ``slots`` sequences of up to ``max_len`` tokens each."""

    def __init__(
        self,
        slots: int,
        max_len: int,
        *,
        layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.slots = slots
        self.max_len = max_len
        self.kv = _lazy_zeros((layers, 2, slots, kv_heads, max_len, head_dim), dtype, device)
        # Flat offset of position 0 of each (slot, head) row, for SlotCache's writes.
        self.head_base = torch.arange(slots * kv_heads, device=device).view(slots, kv_heads)
        self.head_base *= max_len

    @classmethod
    def for_model(cls, model: Any, slots: int, max_len: int) -> SlotKV:
        """A cache shaped for ``model``'s attention layers, on its device and dtype."""
        layers, kv_heads, head_dim = model_kv_shape(model.config)
        param = next(model.parameters())
        return cls(
            slots,
            max_len,
            layers=layers,
            kv_heads=kv_heads,
            head_dim=head_dim,
            dtype=param.dtype,
            device=param.device,
        )

    @property
    def nbytes(self) -> int:
        """Bytes reserved for keys and values."""
        return self.kv.numel() * self.kv.element_size()

    def move(self, dst: list[int], src: list[int], length: int) -> None:
        """Copy the first ``length`` positions of slots ``src`` into slots ``dst`` (disjoint)."""
        if not dst or length <= 0:
            return
        device = self.kv.device
        d = torch.tensor(dst, device=device)
        s = torch.tensor(src, device=device)
        self.kv[:, :, d, :, :length] = self.kv[:, :, s, :, :length]

    def fork(self, src: int, dst: list[int], length: int) -> None:
        """Copy slot ``src``'s first ``length`` positions into every slot of ``dst``."""
        self.move(dst, [src] * len(dst), length)

    def pass_view(
        self,
        rows: slice | torch.Tensor,
        write_slots: torch.Tensor,
        write_pos: torch.Tensor,
        length: int,
        source: torch.Tensor | None = None,
    ) -> SlotCache:
        """The cache one forward pass uses (see :class:`SlotCache`)."""
        return SlotCache(self, rows, write_slots, write_pos, length, source)


class SlotCache(CacheAdapter):
    """One forward pass's view of a :class:`SlotKV`.

    ``rows`` are the slots of the batch rows (a ``slice`` when they are consecutive,
    which makes the returned keys a view, else an index tensor). The new keys and
    values of the pass, flattened to ``[rows * q_len]`` tokens and optionally
    narrowed to ``source`` (the non-padding tokens), are written at
    ``(write_slots[i], write_pos[i])``; attention then sees the first ``length``
    positions of each row, and the caller's mask hides what a row does not own.
    How ``transformers`` calls it is :class:`CacheAdapter`'s business.
    """

    def __init__(
        self,
        store: SlotKV,
        rows: slice | torch.Tensor,
        write_slots: torch.Tensor,
        write_pos: torch.Tensor,
        length: int,
        source: torch.Tensor | None,
    ) -> None:
        super().__init__()
        self.slots = store
        self.rows = rows
        self.length = length
        self.source = source
        # One flat index per (token, kv head) into a [2, slots * heads * max_len, dim]
        # view of the store, computed once and shared by every layer of the pass.
        self.index = (store.head_base[write_slots] + write_pos.unsqueeze(1)).reshape(-1)

    def store(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this layer's new keys/values in place; return the rows' keys/values."""
        table = self.slots.kv[layer_idx]
        batch, heads, q_len, dim = key_states.shape
        both = torch.stack((key_states, value_states))  # [2, B, H, q, D]
        flat = both.transpose(2, 3).reshape(2, batch * q_len, heads, dim)
        if self.source is not None:
            flat = flat.index_select(1, self.source)
        table.view(2, -1, dim).index_copy_(1, self.index, flat.reshape(2, -1, dim).to(table.dtype))
        return table[0, self.rows, :, : self.length], table[1, self.rows, :, : self.length]

    def visible_length(self) -> int:
        """Positions visible to this pass (the mask narrows it per row)."""
        return self.length

    def capacity(self) -> int:
        """Longest sequence a slot holds."""
        return self.slots.max_len
