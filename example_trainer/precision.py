"""The trainer's numeric precision: what dtype weights, optimizer state and compute use.

Policies (``--precision``):

- ``fp32``: everything in float32.
- ``bf16-mixed``: float32 master weights and optimizer state; forward/backward under
  ``torch.autocast(bfloat16)``. The default on a GPU with bf16 support.
- ``fp16-mixed``: float32 master weights; float16 autocast with a gradient scaler
  (overflowing steps are skipped and the scale lowered). For GPUs without bf16.
- ``bf16-pure``: weights and AdamW state in bfloat16, no master copy. Half the
  memory, but an update smaller than about 1/256 of a weight rounds away: at the
  original's default ``--lr 1e-5`` most weights never change. Only when asked.

``auto`` (the default) picks from the device and ``--dtype``: on CUDA, ``bfloat16`` →
``bf16-mixed`` (``fp16-mixed`` with a warning on GPUs without bf16), ``float16`` →
``fp16-mixed``, ``float32`` → ``fp32``; on the CPU ``fp32`` unless ``--dtype`` was
given explicitly (bf16 autocast works on CPUs but is rarely faster there).
``--dtype`` therefore names the compute dtype, never the dtype of the master weights.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, ContextManager

import torch

logger = logging.getLogger(__name__)

PRECISIONS = ("auto", "fp32", "bf16-mixed", "fp16-mixed", "bf16-pure")

DTYPE_NAMES = {
    "bfloat16": "bf16",
    "bf16": "bf16",
    "float16": "fp16",
    "fp16": "fp16",
    "half": "fp16",
    "float32": "fp32",
    "fp32": "fp32",
    "float": "fp32",
    "auto": "auto",
}

LOST_UPDATE_WARNING = (
    "--precision bf16-pure keeps weights and optimizer state in bfloat16 with no fp32 master copy: "
    "an update smaller than ~1/256 of a weight is rounded away, so at small learning rates "
    "(the default 1e-5) most weights never change. Use bf16-mixed unless memory forces this."
)


class PrecisionError(ValueError):
    """An unsupported combination of ``--precision``, ``--dtype`` and device."""


@dataclass(frozen=True)
class PrecisionPolicy:
    """Resolved precision: the dtype of the weights and the autocast dtype (None = no autocast)."""

    name: str
    param_dtype: torch.dtype
    compute_dtype: torch.dtype | None
    device_type: str

    @property
    def uses_scaler(self) -> bool:
        """fp16 gradients underflow without loss scaling."""
        return self.compute_dtype == torch.float16

    def autocast(self) -> ContextManager[Any]:
        """The context forward passes run under."""
        if self.compute_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.compute_dtype)

    def make_scaler(self) -> torch.amp.GradScaler | None:
        """A gradient scaler for ``fp16-mixed``, else None."""
        return torch.amp.GradScaler(self.device_type) if self.uses_scaler else None


def _policy(name: str, device_type: str) -> PrecisionPolicy:
    table = {
        "fp32": (torch.float32, None),
        "bf16-mixed": (torch.float32, torch.bfloat16),
        "fp16-mixed": (torch.float32, torch.float16),
        "bf16-pure": (torch.bfloat16, None),
    }
    param, compute = table[name]
    return PrecisionPolicy(name, param, compute, device_type)


def _cuda_bf16_supported(device: str) -> bool:
    return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())


def resolve_precision(
    precision: str,
    dtype: str,
    device: str,
    dtype_explicit: bool = True,
    bf16_supported: bool | None = None,
) -> PrecisionPolicy:
    """Turn ``--precision``/``--dtype``/``--device`` into a :class:`PrecisionPolicy`.

    Raises :class:`PrecisionError` for combinations that cannot work (fp16 on the
    CPU, bf16 on a GPU without it, a ``--dtype`` contradicting ``--precision``).
    ``bf16_supported`` overrides the GPU query (for tests).
    """
    device_type = torch.device(device).type
    on_cuda = device_type == "cuda"
    if precision not in PRECISIONS:
        raise PrecisionError(
            f"--precision must be one of {', '.join(PRECISIONS)}, got {precision!r}"
        )
    if dtype not in DTYPE_NAMES:
        raise PrecisionError(
            f"--dtype must be one of bfloat16, float16, float32 (or bf16, fp16, fp32), got {dtype!r}"
        )
    want = DTYPE_NAMES[dtype]
    if bf16_supported is None:
        bf16_supported = _cuda_bf16_supported(device) if on_cuda else True
    if precision == "auto":
        if want == "auto":
            want = "bf16" if on_cuda else "fp32"
        if not on_cuda and not dtype_explicit:
            name = "fp32"
        else:
            name = {"bf16": "bf16-mixed", "fp16": "fp16-mixed", "fp32": "fp32"}[want]
        if name == "bf16-mixed" and on_cuda and not bf16_supported:
            logger.warning("this GPU has no bfloat16 support; training in fp16-mixed instead")
            name = "fp16-mixed"
    else:
        name = precision
        if dtype_explicit and want != "auto" and not name.startswith(want):
            raise PrecisionError(
                f"--dtype {dtype} contradicts --precision {precision}; give one of them "
                f"(--dtype is the compute dtype: bfloat16 → bf16-mixed, float16 → fp16-mixed, float32 → fp32)"
            )
    if name.startswith("bf16") and on_cuda and not bf16_supported:
        raise PrecisionError(
            f"--precision {name}: this GPU has no bfloat16 support; use fp16-mixed or fp32"
        )
    if name == "fp16-mixed" and not on_cuda:
        raise PrecisionError(
            f"--precision fp16-mixed needs a CUDA device (got --device {device}); use bf16-mixed or fp32"
        )
    return _policy(name, device_type)


def policy_for(config: Any) -> PrecisionPolicy:
    """The policy of a :class:`~example_trainer.config.TrainingConfig`."""
    return resolve_precision(
        config.precision,
        config.dtype,
        config.device,
        dtype_explicit="dtype" in config.model_fields_set,
    )


def fp32_lm_head(model: torch.nn.Module) -> bool:
    """Make ``model``'s output projection (the LM head) compute in float32 whatever the
    autocast dtype: its inputs and weight are cast to float32 and autocast is off inside
    it. The logits then carry float32's precision into the log-probs and the ratio to
    the sampler. Returns False (and changes nothing) when the model has no output
    embeddings."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Linear):
        logger.warning("--fp32-lm-head: the model has no linear output projection; left as is")
        return False

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        with torch.autocast(hidden.device.type, enabled=False):
            bias = None if head.bias is None else head.bias.float()
            return torch.nn.functional.linear(hidden.float(), head.weight.float(), bias)

    head.forward = forward  # type: ignore[method-assign]
    return True
