"""Pure selection and formatting for SFT and DPO datasets built from scored groups.

Selection follows the original tools (docs/design.md, "Export tools"). Two output formats:

* ``atropos`` (default, the original's lines):
  SFT ``{"prefix","completion","score"}`` or ``{"messages","score"}``;
  DPO ``{"prefix","pos","score","neg"}`` or ``{"pos","score","neg"}`` (messages).
* ``trl``: what TRL's trainers load as is.
  SFT ``{"messages": [...]}`` (conversational) or ``{"prompt","completion"}`` (text);
  DPO ``{"prompt","chosen","rejected"}``: lists of messages (conversational,
  the shared leading turns are the prompt) or strings.

Example::

    keep = select_sft([1.0, 0.0, 0.5], top_n=3, allow_negative=False, min_diff=0.0)  # [0, 2]
    pairs = pair_dpo([1.0, 0.0, 0.5, -1.0], n_pairs=3, allow_negative=False, min_diff=0.5,
                     rng=random.Random(0))
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Literal, Sequence

from atroposlib.frontend.rollouts import split_prefix

OutputFormat = Literal["atropos", "trl"]
FORMATS: tuple[str, ...] = ("atropos", "trl")


def _order_by_score(scores: Sequence[float]) -> list[int]:
    # Stable: equal scores keep their rollout order.
    return sorted(range(len(scores)), key=lambda i: -scores[i])


def select_sft(
    scores: Sequence[float], top_n: int, allow_negative: bool, min_diff: float
) -> list[int]:
    """Indices of the rollouts to keep for SFT, best first.

    Sort by score descending; drop scores <= 0 unless ``allow_negative``; when
    ``min_diff > 0`` keep only scores with ``score - min(scores) > min_diff``;
    keep the first ``top_n``.
    """
    if not scores:
        return []
    group_min = min(scores)
    keep = []
    for i in _order_by_score(scores):
        if scores[i] <= 0 and not allow_negative:
            continue
        if min_diff > 0 and not scores[i] - group_min > min_diff:
            continue
        keep.append(i)
    return keep[: max(top_n, 0)]


def pair_dpo(
    scores: Sequence[float], n_pairs: int, allow_negative: bool, min_diff: float, rng: random.Random
) -> list[tuple[int, int]]:
    """``(chosen, rejected)`` index pairs for DPO.

    Positives: rollouts by score descending, scores <= 0 dropped unless
    ``allow_negative``. Negative pool: the ``n_pairs`` lowest-scoring rollouts.
    For each of the top ``n_pairs`` positives, a random negative with
    ``score < positive - min_diff`` is drawn and removed from the pool;
    a positive with no such negative gets no pair.
    """
    if not scores or n_pairs <= 0:
        return []
    order = _order_by_score(scores)
    positives = [i for i in order if scores[i] > 0 or allow_negative]
    pool = order[-n_pairs:]
    pairs = []
    for pos in positives[:n_pairs]:
        candidates = [neg for neg in pool if neg != pos and scores[neg] < scores[pos] - min_diff]
        if not candidates:
            continue
        neg = rng.choice(candidates)
        pool.remove(neg)
        pairs.append((pos, neg))
    return pairs


def clean_messages(messages: Any) -> list[dict[str, Any]]:
    """Messages reduced to ``role``/``content`` (what chat templates and TRL expect)."""
    if isinstance(messages, str):
        return [{"role": "assistant", "content": messages}]
    out = []
    for m in messages or []:
        if isinstance(m, dict):
            out.append({"role": m.get("role"), "content": m.get("content")})
    return out


def _shared_turns(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def split_conversation_pair(chosen: Any, rejected: Any) -> tuple[list, list, list] | None:
    """(prompt turns, chosen turns, rejected turns) of two conversations.

    The prompt is the leading turns both share; it never swallows a whole
    conversation (at least one turn stays on each side). None when the two
    conversations are identical.
    """
    a, b = clean_messages(chosen), clean_messages(rejected)
    if a == b or not a or not b:
        return None
    shared = min(_shared_turns(a, b), len(a) - 1, len(b) - 1)
    return a[:shared], a[shared:], b[shared:]


@dataclass(frozen=True)
class GroupView:
    """A group reduced to what the exporters need: texts (prefix split) and/or messages."""

    scores: list[float]
    prefix: str
    completions: list[str] | None
    messages: list[Any] | None


def group_view(group: dict[str, Any], decoded: Sequence[str] | None) -> GroupView:
    """Build a GroupView from a group and its decoded sequences (None when not decoded)."""
    scores = [float(s) for s in group.get("scores") or []]
    prefix, completions = ("", None)
    if decoded is not None:
        prefix, completions = split_prefix(list(decoded))
    messages = group.get("messages")
    return GroupView(scores, prefix, completions, messages if isinstance(messages, list) else None)


def sft_records(
    view: GroupView, keep: Iterable[int], use_messages: bool, fmt: OutputFormat
) -> list[dict[str, Any]]:
    """Output lines for the kept rollouts of one group."""
    records = []
    for i in keep:
        if use_messages:
            msgs = view.messages[i]
            if fmt == "trl":
                records.append({"messages": clean_messages(msgs)})
            else:
                records.append({"messages": msgs, "score": view.scores[i]})
        else:
            if fmt == "trl":
                records.append({"prompt": view.prefix, "completion": view.completions[i]})
            else:
                records.append(
                    {
                        "prefix": view.prefix,
                        "completion": view.completions[i],
                        "score": view.scores[i],
                    }
                )
    return records


def dpo_records(
    view: GroupView, pairs: Iterable[tuple[int, int]], use_messages: bool, fmt: OutputFormat
) -> list[dict[str, Any]]:
    """Output lines for the chosen/rejected pairs of one group."""
    records = []
    for pos, neg in pairs:
        score = view.scores[pos]
        if use_messages:
            if fmt == "trl":
                split = split_conversation_pair(view.messages[pos], view.messages[neg])
                if split is None:
                    continue
                prompt, chosen, rejected = split
                records.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
            else:
                records.append(
                    {"pos": view.messages[pos], "score": score, "neg": view.messages[neg]}
                )
        else:
            if fmt == "trl":
                records.append(
                    {
                        "prompt": view.prefix,
                        "chosen": view.completions[pos],
                        "rejected": view.completions[neg],
                    }
                )
            else:
                records.append(
                    {
                        "prefix": view.prefix,
                        "pos": view.completions[pos],
                        "score": score,
                        "neg": view.completions[neg],
                    }
                )
    return records


ExportKind = Literal["sft", "dpo"]


@dataclass(frozen=True)
class Selection:
    """The rule that turns one group into output lines.

    ``sft`` keeps up to ``count`` of the best rollouts (:func:`select_sft`), ``dpo`` makes up
    to ``count`` chosen/rejected pairs (:func:`pair_dpo`); both format with ``fmt``.
    """

    kind: ExportKind
    count: int
    allow_negative: bool = False
    min_diff: float = 0.0
    fmt: OutputFormat = "atropos"

    def records(
        self, view: GroupView, use_messages: bool, rng: random.Random
    ) -> list[dict[str, Any]]:
        """The output lines of one group (``rng`` draws the DPO negatives)."""
        if self.kind == "sft":
            keep = select_sft(view.scores, self.count, self.allow_negative, self.min_diff)
            return sft_records(view, keep, use_messages, self.fmt)
        pairs = pair_dpo(view.scores, self.count, self.allow_negative, self.min_diff, rng)
        return dpo_records(view, pairs, use_messages, self.fmt)


def record_key(record: dict[str, Any]) -> str:
    """Identity of a record for ``--dedupe``: its content without the score."""
    return json.dumps(
        {k: v for k, v in record.items() if k != "score"}, sort_keys=True, ensure_ascii=False
    )


class Deduper:
    """Remembers record keys; ``is_new`` is False for a record already seen."""

    def __init__(self) -> None:
        self._seen: set[str] = set()

    def is_new(self, record: dict[str, Any]) -> bool:
        """Register ``record``; return whether it was unseen."""
        key = record_key(record)
        if key in self._seen:
            return False
        self._seen.add(key)
        return True

    def load(self, path: Path) -> int:
        """Remember every record of an existing output file; return how many lines were read."""
        n = 0
        with path.open("r", encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    try:
                        self._seen.add(record_key(json.loads(line)))
                    except (json.JSONDecodeError, AttributeError):
                        continue
                    n += 1
        return n
