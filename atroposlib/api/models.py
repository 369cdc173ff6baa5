"""Wire models of the rollout API (request bodies), with the original's field names.

``ScoredData`` is what environments post: one group of rollouts. Type-level
validation is pydantic's; :func:`check_lengths` adds the cross-field checks the
original skipped (counts and per-sequence lengths must agree; docs/design.md, "Per-token fields").
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Dict, Iterator, List, Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator

from atroposlib.api.errors import GroupInconsistentError

__all__ = [
    "EnvIdentifier",
    "Info",
    "RegisterEnv",
    "Registration",
    "ScoredData",
    "PER_TOKEN_OPTIONAL",
    "ScoredDataList",
    "Status",
    "check_group_consistency",
    "check_lengths",
    "check_token_ids",
]

# Strict: the stored JSON is the posted JSON, so `1.0` or `"1"` where an int belongs must be
# rejected rather than coerced. Infinity/NaN round-trip as they did through the original's json module.
# Bounds keep the status arithmetic (int * float) finite; far above any real value.
_MAX_INT = 2**53

_WIRE_CONFIG = ConfigDict(strict=True, ser_json_inf_nan="constants", extra="ignore")


class Registration(BaseModel):
    """The trainer's registration (``POST /register``); every field but ``vocab_size`` is
    required (the original's trainers do not send it)."""

    wandb_group: str = Field(..., description="W&B group the environments should join.")
    wandb_project: str = Field(..., description="W&B project the environments should join.")
    batch_size: int = Field(
        ..., le=_MAX_INT, description="Sequences per training batch served by /batch."
    )
    max_token_len: int = Field(
        ..., le=_MAX_INT, description="Maximum sequence length the trainer accepts."
    )
    checkpoint_dir: str = Field(..., description="Where the trainer writes checkpoints.")
    save_checkpoint_interval: int = Field(
        ..., le=_MAX_INT, description="Trainer steps between checkpoints."
    )
    starting_step: int = Field(
        ..., ge=-_MAX_INT, le=_MAX_INT, description="Step counter value to start from."
    )
    num_steps: int = Field(..., le=_MAX_INT, description="Total number of trainer steps planned.")
    vocab_size: int | None = Field(
        None,
        ge=1,
        le=2**63,
        description="Rows of the trainer's embedding table: token ids (and distill_token_ids) "
        ">= it are refused at ingest with a 422 naming the field and index (None: not checked).",
    )


class RegisterEnv(BaseModel):
    """An environment's registration (``POST /register-env``)."""

    max_token_length: int = Field(
        ..., ge=0, le=_MAX_INT, description="The env's maximum context length."
    )
    desired_name: str = Field(
        ..., description="Base name; the API appends `_<n>` to make it unique."
    )
    weight: float = Field(
        ...,
        le=1e6,
        allow_inf_nan=False,
        description="Relative inference weight of this env: finite, > 0 and <= 1e6, or -1 "
        "(BaseEnv's `inference_weight=-1`, which counts as 0 in the weight shares).",
    )
    group_size: int = Field(
        ..., ge=1, le=_MAX_INT, description="Sequences per group this env sends."
    )
    min_batch_allocation: float | None = Field(
        None, ge=0.0, le=1.0, description="Minimum fraction of every batch reserved for this env."
    )

    @field_validator("weight")
    @classmethod
    def _positive_or_ignored(cls, weight: float) -> float:
        if weight > 0 or weight == -1:
            return weight
        raise ValueError("weight must be > 0 (or -1 to leave the inference weight alone)")


class EnvIdentifier(BaseModel):
    """Names one registered environment."""

    env_id: int = Field(..., description="The id returned by /register-env.")


# Token ids index an embedding table and masks hold ids or -100: both must fit the
# trainer's int64 tensors, and a token id is never negative. The original took any
# integer; one outside these ranges could only crash the trainer later.
TokenId = Annotated[int, Field(ge=0, le=2**63 - 1)]
MaskValue = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]


class ScoredData(BaseModel):
    """One scored group of rollouts, as posted to ``/scored_data``."""

    model_config = _WIRE_CONFIG

    tokens: List[List[TokenId]] = Field(
        ..., min_length=1, description="Token ids (0 to 2^63-1), one list per sequence."
    )
    masks: List[List[MaskValue]] = Field(
        ..., description="-100 where no loss is taken, the token id elsewhere."
    )
    scores: List[float] = Field(..., description="One score per sequence.")
    advantages: List[List[float]] | None = Field(None, description="Optional per-token advantages.")
    ref_logprobs: List[List[float]] | None = Field(None, description="Optional reference logprobs.")
    messages: List[List[Dict[str, Any]]] | None = Field(
        None, description="Optional chat messages per sequence; each needs `role` and `content`."
    )
    generation_params: Dict[str, Any] | None = Field(None, description="e.g. {'temperature': 0.8}.")
    inference_logprobs: List[List[float]] | None = Field(
        None, description="Per-token logprobs from inference, 1.0 at prompt positions."
    )
    overrides: List[dict] | None = Field(None, description="Per-sequence overrides.")
    group_overrides: dict | None = Field(None, description="Group-level overrides.")
    images: Any | None = Field(None, description="Optional images (e.g. base64 strings).")
    env_id: int | None = Field(None, description="Set by BaseEnv: the sender's env id.")
    distill_token_ids: List[List[List[TokenId]]] | None = Field(
        None, description="Teacher top-k token ids (0 to 2^63-1), [seq][pos][k]."
    )
    distill_logprobs: List[List[List[float]]] | None = Field(
        None, description="Teacher top-k logprobs, [seq][pos][k]."
    )

    @field_validator("messages")
    @classmethod
    def validate_messages(
        cls, v: List[List[Dict[str, Any]]] | None
    ) -> List[List[Dict[str, Any]]] | None:
        """Every message of every conversation has ``role`` and ``content``."""
        if v is None:
            return v
        for i, conversation in enumerate(v):
            for j, message in enumerate(conversation):
                missing = [k for k in ("role", "content") if k not in message]
                if missing:
                    raise ValueError(f"messages[{i}][{j}] lacks {' and '.join(missing)}")
        return v


class Status(BaseModel):
    """The answer of ``GET /status``."""

    current_step: int = Field(..., description="Batches served so far (the trainer's step).")
    queue_size: int = Field(..., description="Groups waiting in the queue.")


class Info(BaseModel):
    """The answer of ``GET /info`` (``batch_size`` -1 before the trainer registers)."""

    batch_size: int = Field(-1, description="The trainer's batch size.")
    max_token_len: int = Field(-1, description="The trainer's maximum sequence length.")


ScoredDataList = TypeAdapter(List[ScoredData])

# Per-token fields that, when present, must match `tokens` sequence by sequence; the
# optional ones only with `run-api --strict-groups` (the original accepts any length; docs/design.md, "Per-token fields").
PER_TOKEN_OPTIONAL = ("advantages", "ref_logprobs", "inference_logprobs")
_PER_TOKEN_FIELDS = ("masks", *PER_TOKEN_OPTIONAL)


def check_lengths(
    rows: Mapping[str, Sequence[int]],
    scores: int,
    loc_prefix: tuple = (),
    strict: bool = True,
) -> List[str]:
    """Check a group's counts and row lengths; the optional fields that disagree.

    ``rows`` maps ``tokens`` and each present per-token field to its row
    lengths; ``scores`` is the number of scores. ``scores`` and ``masks`` must
    agree with ``tokens`` (:class:`GroupInconsistentError` naming the field and
    index otherwise). An optional per-token field that disagrees raises too
    when ``strict``; otherwise its name is returned, for the caller to warn
    about and count.
    """
    tokens = tuple(rows["tokens"])
    n = len(tokens)
    if scores != n:
        raise GroupInconsistentError(
            loc_prefix + ("scores",),
            f"scores has {scores} entries but tokens has {n} sequences",
        )
    lenient: List[str] = []
    for name in _PER_TOKEN_FIELDS:
        lengths = rows.get(name)
        if lengths is None or tuple(lengths) == tokens:
            continue
        error: GroupInconsistentError | None = None
        if len(lengths) != n:
            error = GroupInconsistentError(
                loc_prefix + (name,), f"{name} has {len(lengths)} sequences but tokens has {n}"
            )
        else:
            for i, (got, want) in enumerate(zip(lengths, tokens, strict=True)):
                if got != want:
                    error = GroupInconsistentError(
                        loc_prefix + (name, i),
                        f"{name}[{i}] has {got} entries but tokens[{i}] has {want}",
                    )
                    break
        if error is None:
            continue
        if strict or name == "masks":
            raise error
        lenient.append(name)
    return lenient


def check_group_consistency(
    group: ScoredData, loc_prefix: tuple = (), strict: bool = True
) -> List[str]:
    """:func:`check_lengths` of a validated group."""
    rows = {
        name: [len(r) for r in value]
        for name in ("tokens", *_PER_TOKEN_FIELDS)
        if (value := getattr(group, name)) is not None
    }
    return check_lengths(rows, len(group.scores), loc_prefix, strict)


def _ids_at(doc: Mapping[str, Any]) -> Iterator[tuple[tuple, int]]:
    """Every token id of a group with its location: ``tokens[i][j]`` then
    ``distill_token_ids[i][j][k]``."""
    for i, row in enumerate(doc.get("tokens") or ()):
        for j, tok in enumerate(row):
            yield ("tokens", i, j), tok
    for i, seq in enumerate(doc.get("distill_token_ids") or ()):
        for j, pos in enumerate(seq or ()):
            for k, tok in enumerate(pos or ()):
                yield ("distill_token_ids", i, j, k), tok


def check_token_ids(
    max_id: int, vocab_size: int | None, body: bytes, loc_prefix: tuple = ()
) -> None:
    """Refuse a group with a token id the trainer's embedding table has no row for.

    ``max_id`` is the group's largest id (``tokens`` and ``distill_token_ids``, from the
    one decoding pass); ``vocab_size`` the trainer's (``/register``; None: no check).
    Only a group that fails is read again (``body``, its posted JSON), to name the first
    id out of range: :class:`GroupInconsistentError` with its field and index. Such a group
    would crash every trainer served it, again after each restart.
    """
    if vocab_size is None or max_id < vocab_size:
        return
    for loc, tok in _ids_at(json.loads(body)):
        if tok >= vocab_size:
            where = f"{loc[0]}{''.join(f'[{i}]' for i in loc[1:])}"
            raise GroupInconsistentError(
                loc_prefix + loc,
                f"{where} is {tok}, not below the trainer's vocab_size {vocab_size}",
            )
    raise GroupInconsistentError(  # pragma: no cover - max_id came from these very ids
        loc_prefix + ("tokens",), f"a token id is not below the trainer's vocab_size {vocab_size}"
    )
