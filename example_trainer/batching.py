"""An API batch cut into optimizer steps and ranks.

The cut is global and does not depend on the number of processes: the batch's
sequences (in batch order) are split into ``--mini-batches`` contiguous parts, one per
optimizer step, exactly as one process would; then each part is split across the ranks
with balanced token budgets. Every rank therefore trains on its share of the same
mini-batch, normalised by that mini-batch's global counts, so N processes compute the
one-process gradient for every ``--mini-batches``.

Example::

    prepared = prepare_batch(batch, world_size=2, micro_size=4, mini_batches=2)
    prepared.rank_minis(0)  # rank 0's part of each mini-batch
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Sequence

from .data import (
    GroupError,
    Sample,
    batch_score_std,
    group_to_samples,
    summarize_batch,
)
from .distributed import balance
from .off_policy import policy_version_summary

logger = logging.getLogger(__name__)


class EmptyBatchError(ValueError):
    """A batch with no sequence that can be trained on (every group rejected, or none long
    enough to predict a token): the trainer acknowledges it and fetches the next one."""

    def __init__(self, message: str, rejected_groups: int = 0, rejected_sequences: int = 0):
        super().__init__(message)
        self.rejected_groups = rejected_groups
        self.rejected_sequences = rejected_sequences


def groups_per_env(batch: Sequence[Mapping[str, Any]]) -> Dict[str, float]:
    """``train/groups_env_<env_id>``: how many of the batch's groups each environment sent
    (which environments a multi-environment run is really training on)."""
    counts: Dict[str, float] = {}
    for group in batch:
        key = f"train/groups_env_{group.get('env_id', 'none')}"
        counts[key] = counts.get(key, 0.0) + 1.0
    return counts


@dataclass
class MiniBatchInfo:
    """One optimizer step's part of a batch, counted over every rank."""

    label_tokens: int
    num_sequences: int
    n_micro: int
    counts: List[int] = field(default_factory=list)  # sequences of each rank


@dataclass
class PreparedBatch:
    """An API batch turned into per-rank samples, with the counts every rank needs.

    ``shares[r]`` is rank r's samples, mini-batch after mini-batch (``minis[k].counts[r]``
    of mini-batch k). ``scores``/``groups``/``from_score`` describe every sequence of the
    batch by its global index (``Sample.index``), for rewards shaped after fetching.
    """

    shares: List[List[Sample]]
    label_tokens: int
    input_tokens: int
    n_micro: int
    summary: Dict[str, float] = field(default_factory=dict)
    fetch_time: float = 0.0
    batch_id: str | None = None
    minis: List[MiniBatchInfo] = field(default_factory=list)
    scores: List[float] = field(default_factory=list)
    groups: List[int] = field(default_factory=list)
    batch_std: float | None = None

    def rank_minis(self, share: Sequence[Sample], rank: int) -> List[List[Sample]]:
        """``share`` (rank ``rank``'s samples) cut into its part of each mini-batch."""
        if not self.minis:
            return [list(share)]
        out, start = [], 0
        for info in self.minis:
            n = info.counts[rank] if info.counts else len(share)
            out.append(list(share[start : start + n]))
            start += n
        return out


def split_mini_batches(share: Sequence[Sample], n: int) -> List[List[Sample]]:
    """``share`` in ``n`` contiguous parts whose sizes differ by at most one."""
    size = len(share)
    return [list(share[size * k // n : size * (k + 1) // n]) for k in range(n)]


def prepare_batch(
    batch: Sequence[Dict[str, Any]],
    world_size: int,
    micro_size: int,
    seq_len: int | None = None,
    scale_rewards: str = "group",
    mask_truncated: bool = False,
    mini_batches: int = 1,
    overlong: tuple[int, int, float] | None = None,
    vocab_size: int | None = None,
) -> PreparedBatch:
    """Shift a batch into samples, cut it into mini-batches, split each across the ranks.

    Sequences are cut to ``seq_len`` inputs before anything is counted. A group that
    cannot be trained on (:class:`~example_trainer.data.GroupError`: a negative
    temperature, inconsistent lengths, a mask entry that is not its token, a token id
    the model cannot take: negative, beyond int64 or ``>= vocab_size``) is skipped, logged
    naming its env and the field, and counted in ``train/rejected_groups`` (its sequences
    in ``train/rejected_sequences``). A batch left with nothing to train on raises
    :class:`EmptyBatchError`.
    """
    batch_std = batch_score_std(batch) if scale_rewards == "batch" else None
    samples: List[Sample] = []
    rejected = rejected_seqs = 0
    for i, group in enumerate(batch):
        try:
            got = group_to_samples(
                group, seq_len, scale_rewards, batch_std, mask_truncated, overlong, vocab_size
            )  # type: ignore[arg-type]
        except GroupError as exc:
            rejected += 1
            tokens = group.get("tokens")
            rejected_seqs += len(tokens) if isinstance(tokens, list) else 0
            logger.error(
                "group %d of the batch (env_id %s) skipped: %s", i, group.get("env_id"), exc
            )
            continue
        for s in got:
            s.group, s.index = i, len(samples)
            samples.append(s)
    if not samples:
        raise EmptyBatchError(
            "batch has no trainable sequences"
            + (f" ({rejected} groups rejected, see the log)" if rejected else ""),
            rejected,
            rejected_seqs,
        )
    shares: List[List[Sample]] = [[] for _ in range(world_size)]
    minis: List[MiniBatchInfo] = []
    for part in split_mini_batches(samples, mini_batches):
        per_rank = balance([len(s.input_ids) for s in part], world_size)
        for r, idx in enumerate(per_rank):
            shares[r].extend(part[i] for i in idx)
        minis.append(
            MiniBatchInfo(
                label_tokens=sum(s.num_label_tokens for s in part),
                num_sequences=len(part),
                n_micro=max(-(-len(idx) // micro_size) for idx in per_rank),
                counts=[len(idx) for idx in per_rank],
            )
        )
    cut = sum(s.cut for s in samples)
    short = sum(s.short_logprobs for s in samples)
    if cut:
        logger.warning("%d sequences longer than --seq-len %s were cut to it", cut, seq_len)
    if short:
        logger.warning(
            "%d sequences have inference_logprobs shorter than their tokens; the tokens past "
            "the row are trained without a sampler log-prob (ratio 1)",
            short,
        )
    return PreparedBatch(
        shares=shares,
        label_tokens=sum(s.num_label_tokens for s in samples),
        input_tokens=sum(len(s.input_ids) for s in samples),
        n_micro=max(-(-len(share) // micro_size) for share in shares),
        summary={
            **{f"train/{k}": v for k, v in summarize_batch(batch).items()},
            **policy_version_summary(batch),
            "train/cut_sequences": float(cut),
            "train/truncated_sequences": float(sum(s.truncated for s in samples)),
            "train/short_inference_logprobs": float(short),
            "train/rejected_groups": float(rejected),
            "train/rejected_sequences": float(rejected_seqs),
            **groups_per_env(batch),
        },
        minis=minis,
        scores=[s.score for s in samples],
        groups=[s.group for s in samples],
        batch_std=batch_std,
    )
