"""On-policy distillation: the teacher's top-k at every trained position (``--distill-enabled``).

A group from :class:`~atroposlib.envs.teacher_distillation_env.TeacherDistillationEnv`
carries ``distill_token_ids``/``distill_logprobs`` (``[seq][pos][k]``): row ``p`` is the
teacher's distribution over token ``p`` given ``tokens[:p]`` (vLLM's prompt log-probs;
row 0 has no context). The trainer's logits at input position ``j`` predict token
``j + 1`` (labels are ``masks[1:]``), so row ``j + 1`` goes with position ``j``: the rows
are shifted by one exactly as the labels are (:func:`distill_rows`).

The term (:func:`distill_divergence`) is the per-token **reverse KL** of on-policy
distillation (Agarwal et al. 2024, GKD, and Thinking Machines' "On-Policy Distillation",
2025), ``KL(π_θ ‖ π_T) = Σ_v π_θ(v) (log π_θ(v) − log π_T(v))``, computed exactly over the
teacher's top-k set ``S``: the teacher's log-probs divided by the temperature ``T`` and
renormalised over ``S`` (``softmax(lp_T / T)``), the student's logits divided by ``T`` and
renormalised over the same ``S``. Duplicate ids in a row (servers pad a short row by
repeating its last entry) count once; a row whose set has one token gives 0 (nothing to
match inside a one-token set). The student's sampled tokens are its own (on-policy), so
this is the distillation loss on the student's trajectories.

Example::

    ids, lps, present = distill_tensors(samples, length=64)
    per_token = distill_divergence(logits, ids, lps, temperature=1.0)  # [B, T]
"""

from __future__ import annotations

import math
from typing import Any, List, Mapping, Sequence, Tuple

import torch

from .conventions import IGNORE_INDEX, GroupError

DISTILL_FIELDS = ("distill_token_ids", "distill_logprobs")


def distill_rows(
    group: Mapping[str, Any], i: int, n: int, labels: Sequence[int]
) -> Tuple[List[List[int]] | None, List[List[float]] | None]:
    """Sequence ``i``'s teacher rows aligned with its ``n`` labels (rows ``1..n``), or
    ``(None, None)`` when the group carries none.

    Raises :class:`GroupError` naming the field when only one of the two fields is
    present, a row's length differs from the sequence's tokens, a position's ids and
    log-probs differ in length, or a log-prob is not a finite number <= 0 (``-inf``
    allowed: a token the teacher rules out).
    """
    ids_all = group.get("distill_token_ids")
    lps_all = group.get("distill_logprobs")
    if ids_all is None and lps_all is None:
        return None, None
    if ids_all is None or lps_all is None:
        missing = "distill_token_ids" if ids_all is None else "distill_logprobs"
        raise GroupError(f"{missing} is missing while the other distill field is present")
    tokens = group["tokens"]
    for name, rows in (("distill_token_ids", ids_all), ("distill_logprobs", lps_all)):
        if len(rows) != len(tokens):
            raise GroupError(f"{name} has {len(rows)} sequences but tokens has {len(tokens)}")
    ids_seq, lps_seq = ids_all[i], lps_all[i]
    if ids_seq is None and lps_seq is None:
        return None, None
    for name, rows in (("distill_token_ids", ids_seq), ("distill_logprobs", lps_seq)):
        if rows is None or len(rows) != len(tokens[i]):
            got = "None" if rows is None else f"{len(rows)} positions"
            raise GroupError(
                f"{name}[{i}] has {got} but tokens[{i}] has {len(tokens[i])}: one row per token"
            )
    ids_out: List[List[int]] = []
    lps_out: List[List[float]] = []
    for p in range(1, n + 1):
        ids_p, lps_p = ids_seq[p], lps_seq[p]
        if len(ids_p) != len(lps_p):
            raise GroupError(
                f"distill_token_ids[{i}][{p}] has {len(ids_p)} entries but "
                f"distill_logprobs[{i}][{p}] has {len(lps_p)}"
            )
        vals = [float(v) for v in lps_p]
        if any(math.isnan(v) or v > 0 for v in vals):
            raise GroupError(f"distill_logprobs[{i}][{p}] holds a value that is not a log-prob")
        ids_out.append([int(t) for t in ids_p])
        lps_out.append(vals)
    return ids_out, lps_out


def distill_tensors(
    rows: Sequence[Tuple[List[List[int]] | None, List[List[float]] | None]],
    labels: Sequence[Sequence[int]],
    length: int,
) -> Tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Pad per-sample teacher rows to ``[B, length, K]`` (``K`` the widest row).

    Returns ``(token_ids, logprobs, present)``; ``present`` (bool ``[B, length]``) marks the
    trained positions (label not −100) that have a teacher row. Missing entries hold id 0
    and log-prob ``-inf`` (no weight). All None when no sample has rows.
    """
    if all(ids is None for ids, _ in rows):
        return None, None, None
    k = max((len(r) for ids, _ in rows if ids for r in ids), default=1) or 1
    b = len(rows)
    ids_t = torch.zeros((b, length, k), dtype=torch.long)
    lps_t = torch.full((b, length, k), -math.inf, dtype=torch.float32)
    present = torch.zeros((b, length), dtype=torch.bool)
    for s, (ids, lps) in enumerate(rows):
        if ids is None or lps is None:
            continue
        for p in range(min(len(ids), length)):
            width = len(ids[p])
            if width == 0:
                continue
            ids_t[s, p, :width] = torch.as_tensor(ids[p], dtype=torch.long)
            lps_t[s, p, :width] = torch.as_tensor(lps[p], dtype=torch.float32)
            present[s, p] = labels[s][p] != IGNORE_INDEX if p < len(labels[s]) else False
    return ids_t, lps_t, present


def distill_divergence(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Per-position reverse KL ``KL(student ‖ teacher)`` over the teacher's top-k, ``[B, T]``.

    ``logits`` ``[B, T, V]`` (position ``j`` predicts token ``j + 1``), ``token_ids`` and
    ``teacher_logprobs`` ``[B, T, K]`` aligned with them (see :func:`distill_rows`). Both
    distributions are tempered by ``temperature`` and renormalised over the row's distinct
    ids with a finite log-prob. Computed in float32.
    """
    if temperature <= 0:
        raise ValueError(f"distill_temperature must be > 0, got {temperature}")
    ids = token_ids.to(logits.device)
    t_lp = teacher_logprobs.to(device=logits.device, dtype=torch.float32)
    # Earlier duplicates of an id are the same token: only the first one counts.
    dup = (ids.unsqueeze(-1) == ids.unsqueeze(-2)).tril(-1).any(-1)
    valid = torch.isfinite(t_lp) & ~dup
    student = torch.gather(logits.float(), -1, ids) / temperature
    neg_inf = torch.tensor(-math.inf, device=logits.device)
    s_log = torch.log_softmax(torch.where(valid, student, neg_inf), dim=-1)
    t_log = torch.log_softmax(torch.where(valid, t_lp / temperature, neg_inf), dim=-1)
    # A row with no valid entry is all -inf: zero it instead of NaN (its position is masked).
    s_log = s_log.masked_fill(~valid, 0.0)
    t_log = t_log.masked_fill(~valid, 0.0)
    weight = torch.exp(s_log) * valid
    return (weight * (s_log - t_log)).sum(-1)
