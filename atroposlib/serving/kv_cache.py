"""A batch of per-sequence KV caches that sequences can join and leave between steps.

Rows are left-padded to a common length. Padding positions hold zeros and are
masked out by the attention mask; rotary position is already applied to cached
keys, so left-padding a cache (when merging two batches) does not change any
sequence's attention. Each row carries the position id of its next token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache


def cache_tensors(cache: object) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Return ``[(keys, values)]`` per layer (each ``[B, heads, T, dim]``) of an HF cache."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return [(layer.keys, layer.values) for layer in layers]
    key_cache = getattr(cache, "key_cache", None)
    if key_cache is not None:  # transformers 4.x DynamicCache
        return list(zip(key_cache, cache.value_cache, strict=True))  # type: ignore[attr-defined]
    if isinstance(cache, (tuple, list)):  # legacy tuple format
        return [(k, v) for k, v in cache]
    raise TypeError(f"unsupported KV cache type {type(cache).__name__}")


def make_cache(kv: list[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    """Wrap per-layer tensors into a fresh ``DynamicCache`` the model can extend."""
    cache = DynamicCache()
    for idx, (k, v) in enumerate(kv):
        cache.update(k, v, idx)
    return cache


def _left_pad(t: torch.Tensor, extra: int, dim: int) -> torch.Tensor:
    if extra == 0:
        return t
    shape = list(t.shape)
    shape[dim] = extra
    return torch.cat([t.new_zeros(shape), t], dim=dim)


@dataclass
class KVBatch:
    """KV tensors, attention mask ``[B, T]`` and next position ids ``[B]`` of a batch."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]
    mask: torch.Tensor
    positions: torch.Tensor

    @property
    def size(self) -> int:
        """Number of rows."""
        return int(self.mask.shape[0])

    def select(self, rows: list[int]) -> KVBatch:
        """Keep ``rows`` (in that order, repeats allowed) and drop all-padding columns."""
        idx = torch.tensor(rows, dtype=torch.long, device=self.mask.device)
        mask = self.mask.index_select(0, idx)
        kv = [(k.index_select(0, idx), v.index_select(0, idx)) for k, v in self.kv]
        used = mask.any(dim=0).nonzero()
        start = int(used[0]) if used.numel() else mask.shape[1]
        if start > 0:
            mask = mask[:, start:]
            kv = [(k[:, :, start:], v[:, :, start:]) for k, v in kv]
        return KVBatch(kv, mask, self.positions.index_select(0, idx))

    @staticmethod
    def merge(a: KVBatch | None, b: KVBatch) -> KVBatch:
        """Stack two batches (``a`` first), left-padding the shorter one."""
        if a is None or a.size == 0:
            return b
        length = max(a.mask.shape[1], b.mask.shape[1])
        pa, pb = length - a.mask.shape[1], length - b.mask.shape[1]
        kv = [
            (
                torch.cat([_left_pad(ka, pa, 2), _left_pad(kb, pb, 2)], dim=0),
                torch.cat([_left_pad(va, pa, 2), _left_pad(vb, pb, 2)], dim=0),
            )
            for (ka, va), (kb, vb) in zip(a.kv, b.kv, strict=True)
        ]
        mask = torch.cat([_left_pad(a.mask, pa, 1), _left_pad(b.mask, pb, 1)], dim=0)
        return KVBatch(kv, mask, torch.cat([a.positions, b.positions]))
