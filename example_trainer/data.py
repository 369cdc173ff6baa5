"""Turn an API batch (a list of scored groups) into padded training tensors.

Pure functions of their inputs. Conventions (SPEC §3.2, §6.1-6.2):

- inputs are ``tokens[:-1]``, labels are ``masks[1:]`` (−100 = no loss), padded with
  −100; the causal shift is done here, so the model never sees the last token as input;
- advantages come from the group's ``scores``, normalised per group:
  ``(s − mean) / max(std, 1e-8)`` when the group has more than one sequence;
  ``overrides[i]["set_advantage_to_zero"]`` forces 0; an env-supplied per-token
  ``advantages`` field wins over the scores (shifted like the labels);
- sampling temperature per sequence: ``overrides[i].temperature`` >
  ``generation_params.temperature`` > ``group_overrides.temperature`` > 1.0;
- ``inference_logprobs`` are shifted by one to align with the labels and padded
  with 1.0 (the "not generated" marker); ``ref_logprobs`` likewise.

Unlike the original, a remainder smaller than the micro-batch size becomes a
smaller last micro-batch instead of being dropped, and each micro-batch is
padded to its own longest sequence (rounded up to ``pad_to_multiple``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Sequence

import numpy as np
import torch

IGNORE_INDEX = -100


@dataclass
class Sample:
    """One sequence of a batch, shifted and ready to pad."""

    input_ids: List[int]
    labels: List[int]
    advantages: List[float]
    temperature: float
    score: float
    inference_logprobs: List[float] | None
    ref_logprobs: List[float] | None


@dataclass
class MicroBatch:
    """Padded tensors for one forward/backward pass. Shapes are ``[B, T]`` unless noted."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor
    advantages: torch.Tensor
    temperatures: torch.Tensor  # [B]
    inference_logprobs: torch.Tensor | None
    ref_logprobs: torch.Tensor | None

    @property
    def num_label_tokens(self) -> int:
        """Number of positions that carry a loss."""
        return int((self.labels != IGNORE_INDEX).sum())


def group_advantages(scores: Sequence[float]) -> List[float]:
    """Per-group normalised advantages: ``(s − mean) / max(std, 1e-8)`` for groups of 2+."""
    arr = np.asarray(scores, dtype=np.float64)
    if arr.size > 1:
        arr = arr - arr.mean()
        arr = arr / max(float(arr.std()), 1e-8)
    return arr.tolist()


def sequence_temperature(
    index: int,
    overrides: Sequence[Mapping[str, Any] | None] | None,
    generation_params: Mapping[str, Any] | None,
    group_overrides: Mapping[str, Any] | None,
) -> float:
    """Temperature of sequence ``index``: overrides > generation_params > group_overrides > 1.0."""
    if (
        overrides
        and index < len(overrides)
        and overrides[index]
        and overrides[index].get("temperature") is not None
    ):
        return float(overrides[index]["temperature"])
    if generation_params and generation_params.get("temperature") is not None:
        return float(generation_params["temperature"])
    if group_overrides and group_overrides.get("temperature") is not None:
        return float(group_overrides["temperature"])
    return 1.0


def _zero_advantage(index: int, overrides: Sequence[Mapping[str, Any] | None] | None) -> bool:
    return bool(
        overrides
        and index < len(overrides)
        and overrides[index]
        and overrides[index].get("set_advantage_to_zero")
    )


def group_to_samples(group: Mapping[str, Any]) -> List[Sample]:
    """Shift one scored group into per-sequence :class:`Sample` records."""
    tokens: List[List[int]] = group["tokens"]
    masks: List[List[int]] = group["masks"]
    scores: List[float] = group["scores"]
    if not (len(tokens) == len(masks) == len(scores)):
        raise ValueError(
            f"group has {len(tokens)} tokens, {len(masks)} masks and {len(scores)} scores; they must match"
        )
    overrides = group.get("overrides")
    token_adv = group.get("advantages")
    inf_lp = group.get("inference_logprobs")
    ref_lp = group.get("ref_logprobs")
    seq_adv = group_advantages(scores)
    samples: List[Sample] = []
    for i, (toks, mask) in enumerate(zip(tokens, masks, strict=False)):
        if len(toks) != len(mask):
            raise ValueError(f"sequence {i}: {len(toks)} tokens but {len(mask)} mask entries")
        if len(toks) < 2:
            continue  # nothing to predict
        n = len(toks) - 1
        if _zero_advantage(i, overrides):
            adv = [0.0] * n
        elif token_adv is not None and i < len(token_adv) and token_adv[i] is not None:
            adv = [float(a) for a in token_adv[i][1:]]
            adv += [0.0] * (n - len(adv))
        else:
            adv = [seq_adv[i]] * n
        samples.append(
            Sample(
                input_ids=list(toks[:-1]),
                labels=list(mask[1:]),
                advantages=adv[:n],
                temperature=sequence_temperature(
                    i, overrides, group.get("generation_params"), group.get("group_overrides")
                ),
                score=float(scores[i]),
                inference_logprobs=_shift(inf_lp, i, n),
                ref_logprobs=_shift(ref_lp, i, n),
            )
        )
    return samples


def _shift(values: Sequence[Sequence[float]] | None, i: int, n: int) -> List[float] | None:
    if values is None or i >= len(values) or values[i] is None:
        return None
    row = [float(v) for v in values[i][1:]]
    return (row + [1.0] * (n - len(row)))[:n]


def _pad(
    rows: Sequence[Sequence[Any]], length: int, value: Any, dtype: torch.dtype
) -> torch.Tensor:
    out = torch.full((len(rows), length), value, dtype=dtype)
    for r, row in enumerate(rows):
        m = min(len(row), length)
        if m:
            out[r, :m] = torch.as_tensor(list(row[:m]), dtype=dtype)
    return out


def collate(
    samples: Sequence[Sample],
    pad_token_id: int = 0,
    pad_to_multiple: int = 64,
    max_len: int | None = None,
) -> MicroBatch:
    """Pad ``samples`` into one :class:`MicroBatch`."""
    longest = max(len(s.input_ids) for s in samples)
    length = math.ceil(longest / pad_to_multiple) * pad_to_multiple
    if max_len is not None:
        length = min(length, max_len)
    has_inf = all(s.inference_logprobs is not None for s in samples)
    has_ref = all(s.ref_logprobs is not None for s in samples)
    return MicroBatch(
        input_ids=_pad([s.input_ids for s in samples], length, pad_token_id, torch.long),
        attention_mask=_pad([[1] * len(s.input_ids) for s in samples], length, 0, torch.long),
        labels=_pad([s.labels for s in samples], length, IGNORE_INDEX, torch.long),
        advantages=_pad([s.advantages for s in samples], length, 0.0, torch.float32),
        temperatures=torch.tensor([s.temperature for s in samples], dtype=torch.float32),
        inference_logprobs=_pad([s.inference_logprobs for s in samples], length, 1.0, torch.float32)
        if has_inf
        else None,
        ref_logprobs=_pad([s.ref_logprobs for s in samples], length, 0.0, torch.float32)
        if has_ref
        else None,
    )


def pad_data_to_good_offset(
    batch: Sequence[Mapping[str, Any]],
    batch_size: int,
    pad_token_id: int = 0,
    pad_to_multiple: int = 64,
    max_len: int | None = None,
) -> List[MicroBatch]:
    """Split an API batch into padded micro-batches of at most ``batch_size`` sequences.

    Example::

        micro = pad_data_to_good_offset(api_batch, batch_size=4, pad_token_id=tok.pad_token_id)
    """
    samples: List[Sample] = []
    for group in batch:
        samples.extend(group_to_samples(group))
    return [
        collate(samples[i : i + batch_size], pad_token_id, pad_to_multiple, max_len)
        for i in range(0, len(samples), batch_size)
    ]


def batch_scores(batch: Sequence[Mapping[str, Any]]) -> List[float]:
    """All raw scores of a batch, in order (for logging the mean reward)."""
    return [float(s) for g in batch for s in g.get("scores", [])]


def summarize_batch(batch: Sequence[Mapping[str, Any]]) -> Dict[str, float]:
    """Score statistics of a batch for logs and the progress bar."""
    scores = batch_scores(batch)
    if not scores:
        return {"mean_score": 0.0, "num_sequences": 0.0}
    return {"mean_score": float(np.mean(scores)), "num_sequences": float(len(scores))}
