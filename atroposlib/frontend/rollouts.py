"""Reading and taking apart scored groups: the shared core of the inspection tools.

A *group* is one ScoredDataGroup as a dict (docs/design.md, "Data shapes"): ``tokens``, ``masks``,
``scores`` and optionally ``messages``, ``inference_logprobs``, ``env_id`` ...
``process`` writes one group per jsonl line; ``GET /batch`` returns lists of them.

Everything here is pure (no network, no UI) so the CLIs stay thin.

Example::

    for line_no, group in iter_groups("data/gsm8k.jsonl"):
        prefix, completions = split_prefix([tok.decode(t) for t in group["tokens"]])
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import orjson

MASKED = -100


def loads_line(line: str | bytes) -> Any:
    """Parse one JSON line with orjson (several times faster on long token lists).

    Falls back to the standard library for what orjson refuses but Python's
    ``json`` writes (``NaN``, ``Infinity``, integers beyond 64 bits); raises
    ``json.JSONDecodeError`` when the line is not JSON at all.
    """
    try:
        return orjson.loads(line)
    except orjson.JSONDecodeError:
        pass
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        raise
    except RecursionError:
        raise json.JSONDecodeError("nested too deeply", _head(line), 0) from None
    except ValueError as e:  # an integer beyond Python's digit limit
        raise json.JSONDecodeError(str(e).split(";")[0], _head(line), 0) from None


def _head(line: str | bytes) -> str:
    """The start of a line, for an error that keeps its document (not the whole line)."""
    head = line[:80]
    return head.decode("utf-8", "replace") if isinstance(head, bytes) else head


class RolloutFileError(ValueError):
    """A rollouts file is missing, empty or has a malformed line (message names path:line)."""


def check_group(group: Any, where: str) -> dict[str, Any]:
    """Return ``group`` if it looks like a ScoredDataGroup, else raise RolloutFileError.

    Needs a ``scores`` list and at least one of ``tokens`` / ``messages`` (lists).
    """
    if not isinstance(group, dict):
        raise RolloutFileError(
            f"{where}: expected a JSON object (a scored group), got {type(group).__name__}"
        )
    scores = group.get("scores")
    if not isinstance(scores, list):
        raise RolloutFileError(f"{where}: field 'scores' is missing or not a list")
    for i, score in enumerate(scores):
        if isinstance(score, bool) or not isinstance(score, (int, float)):
            raise RolloutFileError(f"{where}: scores[{i}] is not a number: {score!r:.60}")
        if isinstance(score, int) and not -(2**1023) < score < 2**1023:
            raise RolloutFileError(f"{where}: scores[{i}] is an integer too large for a float")
    tokens = group.get("tokens")
    messages = group.get("messages")
    if tokens is None and messages is None:
        raise RolloutFileError(f"{where}: needs 'tokens' or 'messages'")
    for name in ("tokens", "masks", "messages", "inference_logprobs"):
        value = group.get(name)
        if value is not None and not isinstance(value, list):
            raise RolloutFileError(f"{where}: field '{name}' must be a list")
    return group


def iter_groups(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield ``(line_number, group)`` for each non-blank line of a rollouts jsonl.

    Raises RolloutFileError (naming ``path:line``) on the first malformed line,
    and when the file is missing or holds no group at all.
    """
    path = Path(path)
    if not path.is_file():
        raise RolloutFileError(f"{path}: no such file")
    found = False
    with path.open("r", encoding="utf-8", errors="replace") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                group = loads_line(line)
            except json.JSONDecodeError as e:
                raise RolloutFileError(
                    f"{where}: not valid JSON ({e.msg} at column {e.colno})"
                ) from None
            found = True
            yield line_no, check_group(group, where)
    if not found:
        raise RolloutFileError(f"{path}: the file is empty (no scored groups)")


def longest_common_prefix(texts: Sequence[str]) -> str:
    """The longest string every text starts with ("" for no texts)."""
    if not texts:
        return ""
    low, high = min(texts), max(texts)
    n = 0
    for a, b in zip(low, high, strict=False):
        if a != b:
            break
        n += 1
    return low[:n]


def split_prefix(texts: Sequence[str]) -> tuple[str, list[str]]:
    """Split texts into (their common prefix, the remainder of each).

    For a single text the prefix is empty: there is nothing to compare with.
    """
    if len(texts) < 2:
        return "", list(texts)
    prefix = longest_common_prefix(texts)
    return prefix, [t[len(prefix) :] for t in texts]


def content_text(content: Any) -> str:
    """Plain text of a message ``content`` (a string or a list of OpenAI-style parts)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for part in content:
            if isinstance(part, dict):
                if part.get("type") == "text":
                    parts.append(str(part.get("text", "")))
                elif part.get("type") in ("image_url", "image"):
                    parts.append("[image]")
            else:
                parts.append(str(part))
        return "\n".join(parts)
    return str(content)


_RENDERED_TURNS = (
    # ChatML (Qwen, the tiny model): <|im_start|>role\ncontent<|im_end|>
    re.compile(r"<\|im_start\|>([^\n<]*)\n(.*?)(?:<\|im_end\|>|(?=<\|im_start\|>)|\Z)", re.S),
    # Llama 3: <|start_header_id|>role<|end_header_id|>\n\ncontent<|eot_id|>
    re.compile(
        r"<\|start_header_id\|>([^<]*)<\|end_header_id\|>\n\n(.*?)"
        r"(?:<\|eot_id\|>|(?=<\|start_header_id\|>)|\Z)",
        re.S,
    ),
)
_TRAILING_SPECIALS = ("<|endoftext|>", "<|end_of_text|>", "<|eot_id|>", "<|im_end|>")


def rendered_chat_turns(text: str) -> list[dict[str, str]] | None:
    """Split a chat template rendered to text back into ``{"role", "content"}`` turns.

    None when ``text`` is not a ChatML or Llama-3 rendering. Padding and end tokens after
    a turn's content are dropped; the trailing newline the template adds is kept out.
    """
    for pattern in _RENDERED_TURNS:
        found = pattern.findall(text)
        if not found:
            continue
        turns = []
        for role, content in found:
            content = content.rstrip("\n")
            stripped = True
            while stripped:
                stripped = False
                for special in _TRAILING_SPECIALS:
                    if content.endswith(special):
                        content = content[: -len(special)].rstrip("\n")
                        stripped = True
            turns.append({"role": role.strip() or "?", "content": content})
        return turns
    return None


def as_turns(messages: Any) -> Any:
    """One rollout's ``messages``, with a rendered template taken apart into turns.

    ``BaseEnv`` (as in the original) fills missing ``messages`` with a single user
    message holding the whole decoded sequence, template markup included; shown as
    is it reads ``user: <|im_start|>user 8+7=<|im_end|>...``. Anything else is
    returned unchanged.
    """
    if (
        isinstance(messages, list)
        and len(messages) == 1
        and isinstance(messages[0], dict)
        and messages[0].get("role") == "user"
        and isinstance(messages[0].get("content"), str)
    ):
        turns = rendered_chat_turns(messages[0]["content"])
        if turns:
            return turns
    return messages


def messages_text(messages: Any) -> str:
    """A readable transcript of one rollout's ``messages`` entry (list of dicts or a string)."""
    if isinstance(messages, str):
        return messages
    if isinstance(messages, list):
        lines = []
        for m in messages:
            if isinstance(m, dict):
                lines.append(f"{m.get('role', '?')}: {content_text(m.get('content'))}")
            else:
                lines.append(str(m))
        return "\n\n".join(lines)
    return str(messages)


def group_size(group: dict[str, Any]) -> int:
    """Number of rollouts in a group (the number of scores)."""
    return len(group.get("scores") or [])


def group_env(group: dict[str, Any], default: str) -> str:
    """The environment a group came from: ``env`` / ``env_name`` / ``env_id`` fields, else ``default``."""
    for key in ("env", "env_name"):
        if isinstance(group.get(key), str) and group[key]:
            return group[key]
    env_id = group.get("env_id")
    if env_id is not None:
        return f"env_id={env_id}"
    return default


def score_in_range(
    scores: Sequence[float], low: float | None, high: float | None, mode: str = "any"
) -> bool:
    """Whether a group's scores fall in ``[low, high]`` (``None`` = unbounded).

    ``mode`` is ``"any"`` (some rollout in range), ``"all"`` (every rollout) or
    ``"mean"`` (the group mean).
    """

    def inside(x: float) -> bool:
        return (low is None or x >= low) and (high is None or x <= high)

    if not scores:
        return low is None and high is None
    if mode == "any":
        return any(inside(s) for s in scores)
    if mode == "all":
        return all(inside(s) for s in scores)
    if mode == "mean":
        return inside(sum(scores) / len(scores))
    raise ValueError(f"unknown score filter mode {mode!r}; use any, all or mean")


@dataclass(frozen=True)
class TokenSpan:
    """One token of a sequence: its text, whether it is trained on, and its inference logprob."""

    token_id: int
    text: str
    trained: bool
    logprob: float | None


def token_spans(
    tokens: Sequence[int],
    masks: Sequence[int] | None,
    logprobs: Sequence[float] | None,
    decode_one: Callable[[int], str],
) -> list[TokenSpan]:
    """Describe each token: trained when its mask is not -100; logprob from ``inference_logprobs``.

    Logprobs at masked positions are placeholders (1.0 by convention) and are
    reported as ``None``. Missing or short masks/logprobs leave the rest unknown
    (untrained / ``None``) rather than failing.
    """
    spans = []
    for i, tok in enumerate(tokens):
        trained = masks is not None and i < len(masks) and masks[i] != MASKED
        lp = None
        if trained and logprobs is not None and i < len(logprobs):
            lp = float(logprobs[i])
        spans.append(TokenSpan(int(tok), decode_one(int(tok)), trained, lp))
    return spans


@dataclass
class GroupRef:
    """Where one group lives in a file, plus what the filters need without re-reading it."""

    source: Path
    offset: int
    line_no: int
    env: str
    scores: list[float]


@dataclass
class RolloutIndex:
    """An index over one or more rollouts files: groups are re-read from disk on demand.

    Only offsets, environment names and scores stay in memory, so files with
    many thousands of long groups open quickly and cheaply.
    """

    refs: list[GroupRef] = field(default_factory=list)

    @classmethod
    def build(cls, paths: Sequence[str | Path]) -> RolloutIndex:
        """Index every group of ``paths``; raise RolloutFileError on any malformed line."""
        index = cls()
        for raw in paths:
            path = Path(raw)
            if not path.is_file():
                raise RolloutFileError(f"{path}: no such file")
            default_env = path.stem
            found = False
            with path.open("rb") as f:
                line_no = 0
                while True:
                    offset = f.tell()
                    line = f.readline()
                    if not line:
                        break
                    line_no += 1
                    if not line.strip():
                        continue
                    where = f"{path}:{line_no}"
                    try:
                        group = loads_line(line)
                    except (json.JSONDecodeError, UnicodeDecodeError) as e:
                        raise RolloutFileError(f"{where}: not valid JSON ({e})") from None
                    check_group(group, where)
                    found = True
                    index.refs.append(
                        GroupRef(
                            path,
                            offset,
                            line_no,
                            group_env(group, default_env),
                            [float(s) for s in group["scores"]],
                        )
                    )
            if not found:
                raise RolloutFileError(f"{path}: the file is empty (no scored groups)")
        return index

    def __len__(self) -> int:
        return len(self.refs)

    def load(self, i: int) -> dict[str, Any]:
        """Read group ``i`` back from its file."""
        ref = self.refs[i]
        with ref.source.open("rb") as f:
            f.seek(ref.offset)
            return loads_line(f.readline())

    def envs(self) -> list[str]:
        """The environment names present, sorted."""
        return sorted({r.env for r in self.refs})

    def filter(
        self,
        env: str | None = None,
        low: float | None = None,
        high: float | None = None,
        query: str = "",
        mode: str = "any",
        text_of: Callable[[dict[str, Any]], str] | None = None,
    ) -> list[int]:
        """Indices of groups matching environment, score range and a case-insensitive text query.

        ``text_of`` turns a group into searchable text (default: its messages,
        else its raw line); only groups passing the cheap filters are read.
        """
        needle = query.strip().lower()
        out = []
        for i, ref in enumerate(self.refs):
            if env and ref.env != env:
                continue
            if not score_in_range(ref.scores, low, high, mode):
                continue
            if needle:
                group = self.load(i)
                text = text_of(group) if text_of else default_group_text(group)
                if needle not in text.lower():
                    continue
            out.append(i)
        return out


def default_group_text(group: dict[str, Any]) -> str:
    """Searchable text of a group without a tokenizer: its messages transcripts."""
    messages = group.get("messages")
    if isinstance(messages, list):
        return "\n".join(messages_text(as_turns(m)) for m in messages)
    return ""
