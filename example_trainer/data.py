"""Turn an API batch (a list of scored groups) into padded training tensors.

Pure functions of their inputs, except :func:`get_data` (the original's fetch-and-pad, which
waits on the API). Conventions (docs/design.md, "Trainer data conventions"):

- inputs are ``tokens[:-1]``, labels are ``masks[1:]`` (−100 = no loss), padded with
  −100; the causal shift is done here, so the model never sees the last token as input;
- advantages come from the group's ``scores``, centred per group and scaled by
  ``scale_rewards``: ``group`` divides by the group's sample standard deviation plus
  ``1e-4`` (as TRL), ``batch`` by the standard deviation of every score of the batch
  plus ``1e-4``, ``none`` not at all (Dr. GRPO); a group of one sequence keeps its raw
  score (as the original); ``overrides[i]["set_advantage_to_zero"]`` forces 0; an
  env-supplied per-token ``advantages`` field wins over the scores (shifted like the
  labels);
- sampling temperature per sequence: ``overrides[i].temperature`` >
  ``generation_params.temperature`` > ``group_overrides.temperature`` > 1.0; a
  temperature of 0 (greedy) is scored at 1, a negative or non-finite one rejects the
  group (:class:`GroupError`), as does a non-finite score or env-supplied advantage;
- ``inference_logprobs`` are shifted by one to align with the labels; a token without a
  sampler log-prob (a sequence without a row, a row shorter than the sequence, or the
  ``1.0`` "not generated" marker on a trained token) is marked as such per token
  (``MicroBatch.inference_mask``), so the loss treats a sequence the same whichever
  micro-batch it lands in; ``ref_logprobs`` likewise (``MicroBatch.ref_mask``);
- a sequence longer than ``max_len`` is cut to ``max_len`` inputs here, before any token
  is counted, and flagged (``Sample.cut``); ``mask_truncated`` removes the labels of cut
  sequences and of those the environment reports as ``finish_reason: "length"`` (in
  ``overrides[i]``).

Unlike the original, a remainder smaller than the micro-batch size becomes a
smaller last micro-batch instead of being dropped, and each micro-batch is
padded to its own longest sequence (rounded up to ``pad_to_multiple``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Literal, Mapping, Sequence, Tuple

import numpy as np
import torch

from .api import get_batch
from .conventions import IGNORE_INDEX, GroupError
from .distill import distill_rows, distill_tensors

DEFAULT_ATROPOS_URL = "http://localhost:8000"
ADVANTAGE_EPS = 1e-4
"""Added to the standard deviation that scales advantages (TRL's value): a group whose
scores differ by rounding noise gets advantages near 0, not ±1."""

ScaleRewards = Literal["group", "batch", "none"]


@dataclass
class Sample:
    """One sequence of a batch, shifted (and cut to the trainer's length) and ready to pad.

    ``inference_logprobs``/``ref_logprobs`` hold NaN where the sequence has no value for
    a token (the whole row when it has none).
    """

    input_ids: List[int]
    labels: List[int]
    advantages: List[float]
    temperature: float
    score: float
    inference_logprobs: List[float] | None
    ref_logprobs: List[float] | None
    cut: bool = False
    truncated: bool = False
    short_logprobs: bool = False
    group: int = -1  # index of its group in the batch (for rewards shaped after fetching)
    index: int = -1  # index of the sequence in the batch
    from_score: bool = True  # its advantage comes from the group's scores
    # Teacher top-k rows aligned with the labels ([pos][k]; see example_trainer.distill).
    distill_token_ids: List[List[int]] | None = None
    distill_logprobs: List[List[float]] | None = None

    @property
    def num_label_tokens(self) -> int:
        """Positions of this sequence that carry a loss."""
        return sum(1 for x in self.labels if x != IGNORE_INDEX)


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
    inference_mask: torch.Tensor | None = None  # bool: the token has a sampler log-prob
    ref_mask: torch.Tensor | None = None  # bool: the token has an env-supplied ref log-prob
    distill_token_ids: torch.Tensor | None = None  # [B, T, K] teacher top-k ids
    distill_logprobs: torch.Tensor | None = None  # [B, T, K] (-inf: no entry)
    distill_mask: torch.Tensor | None = None  # bool [B, T]: a trained token with a teacher row

    @property
    def num_label_tokens(self) -> int:
        """Number of positions that carry a loss."""
        return int((self.labels != IGNORE_INDEX).sum())


def group_advantages(
    scores: Sequence[float], scale: ScaleRewards = "group", batch_std: float | None = None
) -> List[float]:
    """Advantages of one group's scores: ``s − mean``, divided by ``std + 1e-4``.

    ``scale="group"``: the group's sample standard deviation (Bessel-corrected, as TRL
    and verl); ``"batch"``: ``batch_std`` (the standard deviation of all the batch's
    scores); ``"none"``: not divided (Dr. GRPO). A group of one keeps its raw score.

    Example::

        group_advantages([1.0, 0.0])  # [0.7070..., -0.7070...]
    """
    arr = np.asarray(scores, dtype=np.float64)
    if arr.size > 1:
        arr = arr - arr.mean()
        if scale == "group":
            arr = arr / (float(arr.std(ddof=1)) + ADVANTAGE_EPS)
        elif scale == "batch":
            if batch_std is None:
                raise ValueError("scale='batch' needs batch_std")
            arr = arr / (batch_std + ADVANTAGE_EPS)
    return arr.tolist()


def batch_score_std(batch: Sequence[Mapping[str, Any]]) -> float:
    """Sample standard deviation of every score of a batch (0 with fewer than two)."""
    scores = np.asarray(batch_scores(batch), dtype=np.float64)
    return float(scores.std(ddof=1)) if scores.size > 1 else 0.0


def _check_temperature(value: Any, where: str) -> float:
    try:
        t = float(value)
    except (TypeError, ValueError):
        raise GroupError(f"{where}: temperature {value!r} is not a number") from None
    if not math.isfinite(t) or t < 0:
        raise GroupError(f"{where}: temperature {value!r} must be a finite number >= 0")
    # 0 means greedy decoding: the sampler took the argmax, and (as our server and the
    # original do) the tokens are scored at temperature 1 instead of dividing by 0.
    return t if t > 0 else 1.0


def sequence_temperature(
    index: int,
    overrides: Sequence[Mapping[str, Any] | None] | None,
    generation_params: Mapping[str, Any] | None,
    group_overrides: Mapping[str, Any] | None,
) -> float:
    """Temperature of sequence ``index``: overrides > generation_params > group_overrides > 1.0.

    0 (greedy) gives 1.0; a negative, non-finite or non-numeric value raises
    :class:`GroupError` naming the field.
    """
    if (
        overrides
        and index < len(overrides)
        and overrides[index]
        and overrides[index].get("temperature") is not None
    ):
        return _check_temperature(overrides[index]["temperature"], f"overrides[{index}]")
    if generation_params and generation_params.get("temperature") is not None:
        return _check_temperature(generation_params["temperature"], "generation_params")
    if group_overrides and group_overrides.get("temperature") is not None:
        return _check_temperature(group_overrides["temperature"], "group_overrides")
    return 1.0


def _finite(value: Any) -> bool:
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def _override(index: int, overrides: Sequence[Mapping[str, Any] | None] | None, key: str) -> Any:
    if overrides and index < len(overrides) and overrides[index]:
        return overrides[index].get(key)
    return None


def check_masks(tokens: Sequence[Sequence[int]], masks: Sequence[Sequence[int]]) -> None:
    """Raise :class:`GroupError` naming the first position whose mask is neither −100 nor
    its token: masks become the labels, so such a group would train on wrong labels."""
    for i, (toks, mask) in enumerate(zip(tokens, masks, strict=False)):
        for p, (t, m) in enumerate(zip(toks, mask, strict=False)):
            if m != IGNORE_INDEX and m != t:
                raise GroupError(
                    f"masks[{i}][{p}] is {m!r} but tokens[{i}][{p}] is {t!r}: a mask entry must "
                    "be -100 or the token itself"
                )


_MAX_ID = 2**63 - 1
"""The largest id a ``torch.long`` tensor holds; a larger one fails the whole batch's padding."""


def _id_rows(group: Mapping[str, Any]) -> Iterator[tuple[str, Sequence[Any]]]:
    """Every row of ids of a group, named for an error message: ``tokens[i]``, then
    ``distill_token_ids[i][j]``."""
    for i, row in enumerate(group.get("tokens") or ()):
        yield f"tokens[{i}]", row
    for i, seq in enumerate(group.get("distill_token_ids") or ()):
        for j, pos in enumerate(seq or ()):
            yield f"distill_token_ids[{i}][{j}]", pos or ()


def check_token_ids(group: Mapping[str, Any], vocab_size: int | None = None) -> None:
    """Raise :class:`GroupError` naming the first id of ``tokens`` or ``distill_token_ids``
    that the model cannot take: not an integer, negative, beyond int64 or (with
    ``vocab_size``, the model's embedding rows) ``>= vocab_size``. Such an id would fail
    the embedding lookup, the teacher gather or the tensor itself, for the whole batch and
    again each time the batch is served; masks need no check (:func:`check_masks` holds
    them to their tokens).
    """
    top = _MAX_ID if vocab_size is None else min(vocab_size - 1, _MAX_ID)
    for where, row in _id_rows(group):
        if not row:
            continue
        try:  # min and max run in C; only a failing row is walked id by id
            if 0 <= min(row) and max(row) <= top:
                continue
        except TypeError:
            pass
        for p, tok in enumerate(row):
            try:
                fits = 0 <= tok <= top
            except TypeError:
                raise GroupError(f"{where}[{p}] is {tok!r}, not an integer token id") from None
            if not fits:
                bound = f"the model's vocab_size {vocab_size}" if vocab_size else "2^63"
                raise GroupError(
                    f"{where}[{p}] is {tok!r}: a token id must be >= 0 and below {bound}"
                )


def overlong_penalty(length: int, max_len: int, buffer_len: int, factor: float) -> float:
    """DAPO's soft overlong punishment (as verl's ``overlong_buffer``): 0 up to
    ``max_len − buffer_len`` trained tokens, then falling linearly to ``−factor`` at
    ``max_len`` (and below it past ``max_len``): ``min(0, −(length − (max_len −
    buffer_len)) / buffer_len · factor)``.

    Example::

        overlong_penalty(90, max_len=100, buffer_len=20, factor=1.0)  # -0.5
    """
    exceed = length - (max_len - buffer_len)
    return min(0.0, -exceed / buffer_len * factor)


def group_to_samples(
    group: Mapping[str, Any],
    max_len: int | None = None,
    scale_rewards: ScaleRewards = "group",
    batch_std: float | None = None,
    mask_truncated: bool = False,
    overlong: tuple[int, int, float] | None = None,
    vocab_size: int | None = None,
) -> List[Sample]:
    """Shift one scored group into per-sequence :class:`Sample` records.

    ``max_len`` cuts longer sequences to that many inputs (flagged ``cut``);
    ``mask_truncated`` drops the labels of cut sequences and of those whose
    ``overrides[i]["finish_reason"]`` is ``"length"``. ``overlong`` =
    ``(max_len, buffer_len, factor)`` adds :func:`overlong_penalty` of each sequence's
    trained-token count (its response length) to its score before the advantages are
    computed. Raises :class:`GroupError` (a ``ValueError``) naming the field when the
    group is inconsistent, including a mask entry that is not its token (see
    :func:`check_masks`) and a token id the model cannot take (see
    :func:`check_token_ids`; ``vocab_size``: the model's embedding rows).
    """
    tokens: List[List[int]] = group["tokens"]
    masks: List[List[int]] = group["masks"]
    scores: List[float] = group["scores"]
    if not (len(tokens) == len(masks) == len(scores)):
        raise GroupError(
            f"group has {len(tokens)} tokens, {len(masks)} masks and {len(scores)} scores; they must match"
        )
    overrides = group.get("overrides")
    token_adv = group.get("advantages")
    inf_lp = group.get("inference_logprobs")
    ref_lp = group.get("ref_logprobs")
    bad = [i for i, x in enumerate(scores) if not _finite(x)]
    if bad:
        raise GroupError(f"scores[{bad[0]}] is {scores[bad[0]]!r}, not a finite number")
    check_token_ids(group, vocab_size)
    check_masks(tokens, masks)
    if overlong is not None:
        scores = [
            float(s) + overlong_penalty(sum(1 for m in mask if m != IGNORE_INDEX), *overlong)
            for s, mask in zip(scores, masks, strict=False)
        ]
    seq_adv = group_advantages(scores, scale_rewards, batch_std)
    samples: List[Sample] = []
    for i, (toks, mask) in enumerate(zip(tokens, masks, strict=False)):
        if len(toks) != len(mask):
            raise GroupError(f"sequence {i}: {len(toks)} tokens but {len(mask)} mask entries")
        if len(toks) < 2:
            continue  # nothing to predict
        n = len(toks) - 1
        from_score = False
        if _override(i, overrides, "set_advantage_to_zero"):
            adv = [0.0] * n
        elif token_adv is not None and i < len(token_adv) and token_adv[i] is not None:
            adv = [float(a) for a in token_adv[i][1:]]
            if not all(math.isfinite(a) for a in adv):
                raise GroupError(f"advantages[{i}] holds a value that is not finite")
            adv += [0.0] * (n - len(adv))
        else:
            adv = [seq_adv[i]] * n
            from_score = True
        labels = list(mask[1:])
        inference, short = _shift(inf_lp, i, n, labels)
        ref, _ = _shift(ref_lp, i, n, labels)
        d_ids, d_lps = distill_rows(group, i, n, labels)
        keep = n if max_len is None else min(n, max_len)
        cut = keep < n
        truncated = cut or _override(i, overrides, "finish_reason") == "length"
        labels = labels[:keep]
        if mask_truncated and truncated:
            labels = [IGNORE_INDEX] * keep
        samples.append(
            Sample(
                input_ids=list(toks[:keep]),
                labels=labels,
                advantages=adv[:keep],
                temperature=sequence_temperature(
                    i, overrides, group.get("generation_params"), group.get("group_overrides")
                ),
                score=float(scores[i]),
                inference_logprobs=inference[:keep] if inference is not None else None,
                ref_logprobs=ref[:keep] if ref is not None else None,
                cut=cut,
                truncated=truncated,
                short_logprobs=short,
                from_score=from_score,
                distill_token_ids=d_ids[:keep] if d_ids is not None else None,
                distill_logprobs=d_lps[:keep] if d_lps is not None else None,
            )
        )
    return samples


def _shift(
    values: Sequence[Sequence[float]] | None, i: int, n: int, labels: Sequence[int]
) -> tuple[List[float] | None, bool]:
    """Row ``i`` of a per-token field aligned with the labels, NaN where a trained token
    has no value; and whether the row was too short for a trained token."""
    if values is None or i >= len(values) or values[i] is None:
        return None, False
    row = [float(v) for v in values[i][1 : n + 1]]
    short = any(lab != IGNORE_INDEX for lab in labels[len(row) :])
    row += [math.nan] * (n - len(row))
    # A log-prob is <= 0: the 1.0 "not generated" marker (or NaN/inf) on a trained
    # token means the sampler gave none, not a ratio of exp(logp - 1).
    return [v if math.isfinite(v) and v <= 0 else math.nan for v in row], short


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
    """Pad ``samples`` into one :class:`MicroBatch`.

    ``inference_logprobs`` (and ``ref_logprobs``) are present when any sample has them;
    ``inference_mask`` says which tokens do. Tokens without one hold ``1.0``.
    """
    longest = max(len(s.input_ids) for s in samples)
    length = math.ceil(longest / pad_to_multiple) * pad_to_multiple
    if max_len is not None:
        length = min(length, max_len)
    inference, inference_mask = _pad_optional([s.inference_logprobs for s in samples], length)
    ref, ref_mask = _pad_optional([s.ref_logprobs for s in samples], length)
    d_ids, d_lps, d_mask = distill_tensors(
        [(s.distill_token_ids, s.distill_logprobs) for s in samples],
        [s.labels for s in samples],
        length,
    )
    return MicroBatch(
        input_ids=_pad([s.input_ids for s in samples], length, pad_token_id, torch.long),
        attention_mask=_pad([[1] * len(s.input_ids) for s in samples], length, 0, torch.long),
        labels=_pad([s.labels for s in samples], length, IGNORE_INDEX, torch.long),
        advantages=_pad([s.advantages for s in samples], length, 0.0, torch.float32),
        temperatures=torch.tensor([s.temperature for s in samples], dtype=torch.float32),
        inference_logprobs=inference,
        ref_logprobs=ref,
        inference_mask=inference_mask,
        ref_mask=ref_mask,
        distill_token_ids=d_ids,
        distill_logprobs=d_lps,
        distill_mask=d_mask,
    )


def _pad_optional(
    rows: Sequence[List[float] | None], length: int
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    if all(r is None for r in rows):
        return None, None
    values = _pad([r if r is not None else [] for r in rows], length, math.nan, torch.float32)
    present = ~torch.isnan(values)
    return values.masked_fill(~present, 1.0), present


Batches = Tuple[
    List[torch.Tensor],
    List[torch.Tensor],
    List[torch.Tensor],
    List[torch.Tensor],
    List[torch.Tensor] | None,
]
"""The original's padded batch: lists (one tensor per micro-batch) of tokens, labels,
advantages, temperatures and inference log-probs (None when there are none)."""


def pad_groups(
    groups: Sequence[Mapping[str, Any]],
    batch_size: int,
    pad_token_id: int = 0,
    pad_to_multiple: int = 64,
    max_len: int | None = None,
) -> List[MicroBatch]:
    """Split scored groups into padded :class:`MicroBatch` es of at most ``batch_size``
    sequences, each padded to its own longest sequence (rounded up to ``pad_to_multiple``)."""
    samples: List[Sample] = []
    for group in groups:
        samples.extend(group_to_samples(group, max_len=max_len))
    return [
        collate(samples[i : i + batch_size], pad_token_id, pad_to_multiple, max_len)
        for i in range(0, len(samples), batch_size)
    ]


def pad_batches(
    data: Any,
    batch_size: int,
    extract_inference_logprobs: bool = True,
    max_len: int | None = None,
) -> Batches:
    """The original's ``pad_data_to_good_offset``: ``data`` (the ``/batch`` answer, or its
    list of groups) as micro-batches of at most ``batch_size`` sequences:
    ``(tokens, labels, advantages, temperatures, inference_logprobs)`` lists of tensors
    (the last None unless ``extract_inference_logprobs`` and some sequence has them).

    Labels are the next tokens (-100 where no loss is taken), advantages per token,
    temperatures one per sequence; a token without a sampler log-prob holds 1.0.
    """
    groups = data.get("batch") if isinstance(data, Mapping) else data
    tokens, labels, advantages, temperatures, logprobs = [], [], [], [], []
    any_logprobs = False
    for mb in pad_groups(groups or [], batch_size, max_len=max_len):
        tokens.append(mb.input_ids)
        labels.append(mb.labels)
        advantages.append(mb.advantages)
        temperatures.append(mb.temperatures)
        if mb.inference_logprobs is not None:
            any_logprobs = True
            logprobs.append(mb.inference_logprobs)
        else:
            logprobs.append(torch.ones_like(mb.labels, dtype=torch.float32))
    return (
        tokens,
        labels,
        advantages,
        temperatures,
        logprobs if extract_inference_logprobs and any_logprobs else None,
    )


def pad_data_to_good_offset(
    data: Any,
    batch_size: int,
    extract_inference_logprobs: Any = True,
    pad_to_multiple: int = 64,
    max_len: int | None = None,
    *,
    pad_token_id: int = 0,
) -> Any:
    """Split an API batch into padded micro-batches of at most ``batch_size`` sequences.

    The original's form, ``data`` the ``/batch`` answer (a dict with ``batch``), is
    :func:`pad_batches` (``extract_inference_logprobs`` says whether the last entry is
    filled); a list of groups is :func:`pad_groups` (an int third argument is the pad
    token id).

    Example::

        micro = pad_data_to_good_offset(api_batch, batch_size=4, pad_token_id=tok.pad_token_id)
    """
    if isinstance(data, Mapping):
        return pad_batches(data, batch_size, bool(extract_inference_logprobs), max_len=max_len)
    if not isinstance(extract_inference_logprobs, bool):
        pad_token_id = int(extract_inference_logprobs)
    return pad_groups(data, batch_size, pad_token_id, pad_to_multiple, max_len)


def get_data(
    batch_size: int,
    seq_len: int,
    atropos_url: str = DEFAULT_ATROPOS_URL,
    extract_inference_logprobs: bool = True,
) -> Tuple[List[Batches], None]:
    """The original's fetch: wait for the next batch from the API (polling once a second)
    and return it padded by :func:`pad_batches` (``[batches]``, None), sequences cut to
    ``seq_len``."""
    while True:
        batch = get_batch(atropos_url)
        if batch:
            break
        time.sleep(1.0)
    return [pad_batches(batch, batch_size, extract_inference_logprobs, max_len=seq_len)], None


def batch_scores(batch: Sequence[Mapping[str, Any]]) -> List[float]:
    """All raw scores of a batch, in order (for logging the mean reward)."""
    return [float(s) for g in batch for s in g.get("scores", [])]


def summarize_batch(batch: Sequence[Mapping[str, Any]]) -> Dict[str, float]:
    """Score statistics of a batch for logs and the progress bar."""
    scores = batch_scores(batch)
    if not scores:
        return {"mean_score": 0.0, "num_sequences": 0.0}
    return {"mean_score": float(np.mean(scores)), "num_sequences": float(len(scores))}
