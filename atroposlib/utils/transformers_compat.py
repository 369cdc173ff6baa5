"""Everything atroposlib relies on inside ``transformers``, in one place.

The embedded engine plugs its own KV cache into ``transformers``' ``Cache``
interface and drives a model's forward pass with it; that interface moves between
releases (5.24 passes ``kwargs=`` to ``Cache.update``; 5.x renames the forward
argument ``past_key_values`` to ``cache``; 4.x sizes masks from a ``cache_position``
tensor where 5.x passes a query length). This module is written against the
interface as documented and accepts the extra arguments newer versions pass, so a
release that changes it breaks here, and the contract test
(``tests/serving/test_transformers_contract.py``) is what fails first.

What the rest of the package may use:

- :class:`CacheAdapter`, the base of the engine's slot cache;
- :func:`forward_with_cache`, one forward pass with such a cache;
- :func:`prefer_sdpa`, which attention kernel the engine's masks are built for;
- :data:`TRANSFORMERS_MAJOR`, which keys the on-disk model caches (a directory written by
  5.x does not load under 4.x: tokenizer class and rope fields differ).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from transformers import Cache

from atroposlib.utils.dependencies import installed_major

TRANSFORMERS_MAJOR = installed_major("transformers")


class CacheAdapter(Cache):
    """A ``transformers`` ``Cache`` whose storage is the subclass's own.

    Subclasses implement :meth:`store` (write one layer's new keys/values, return what
    attention sees), :meth:`visible_length` and :meth:`capacity`. Every method
    ``transformers`` calls on a cache during a forward pass is mapped onto those three,
    whatever extra positional or keyword arguments the installed release passes.
    """

    is_compileable = False

    def __init__(self) -> None:
        try:
            super().__init__(layers=[])
        except TypeError:  # releases whose Cache takes no layer list
            super().__init__()

    def store(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``layer_idx``'s new keys/values; return the keys/values attention sees."""
        raise NotImplementedError

    def visible_length(self) -> int:
        """Key positions the current pass attends over."""
        raise NotImplementedError

    def capacity(self) -> int:
        """Longest sequence the cache holds."""
        raise NotImplementedError

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Called by every attention layer (``cache_kwargs``, ``kwargs=`` and the like ignored)."""
        return self.store(key_states, value_states, layer_idx)

    def get_seq_length(self, layer_idx: int | None = 0, *args: Any, **kwargs: Any) -> int:
        """Positions visible to this pass (the engine's mask narrows it per row)."""
        return self.visible_length()

    def get_mask_sizes(self, *args: Any, **kwargs: Any) -> tuple[int, int]:
        """``(kv_length, kv_offset)``; the engine passes its own 4-D masks, so only sizes."""
        return self.visible_length(), 0

    def get_max_cache_shape(self, *args: Any, **kwargs: Any) -> int:
        """Longest sequence a slot holds (4.x name)."""
        return self.capacity()

    def get_max_length(self, *args: Any, **kwargs: Any) -> int:
        """Longest sequence a slot holds (5.x name)."""
        return self.capacity()


def _forward_parameters(model: Any) -> frozenset[str]:
    cached = getattr(model, "_atropos_forward_parameters", None)
    if cached is None:
        cached = frozenset(inspect.signature(model.forward).parameters)
        try:
            model._atropos_forward_parameters = cached
        except AttributeError:  # a model object that refuses new attributes
            pass
    return cached


def forward_with_cache(
    model: Any,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    attention_mask: Any,
    cache: Cache,
    logits_to_keep: int,
) -> torch.Tensor:
    """One forward pass of a causal LM through ``cache``; returns its logits.

    ``logits_to_keep`` (0 = every position) is passed where the model accepts it. The
    cache goes in as ``cache`` where the model's forward names it so (newer 5.x), else
    as ``past_key_values``.
    """
    params = _forward_parameters(model)
    kwargs: dict[str, Any] = {}
    if "logits_to_keep" in params:
        kwargs["logits_to_keep"] = logits_to_keep
    kwargs["cache" if "cache" in params else "past_key_values"] = cache
    out = model(
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=attention_mask,
        use_cache=True,
        return_dict=True,
        **kwargs,
    )
    return out.logits


def prefer_sdpa(model: Any) -> bool:
    """Select PyTorch's SDPA attention where the model runs another kernel.

    Returns whether masks must be additive (float, ``-inf`` where hidden): true for
    the eager kernel, false for SDPA, which takes boolean masks.
    """
    impl = getattr(model.config, "_attn_implementation", None)
    if impl not in ("sdpa", "eager") and hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation("sdpa")
    return model.config._attn_implementation != "sdpa"
