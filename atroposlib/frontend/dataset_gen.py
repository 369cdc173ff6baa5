"""The machinery shared by ``atropos-sft-gen`` and ``atropos-dpo-gen``.

Both read scored groups, either live from the rollout API (acting as the
trainer: register, then poll ``/batch``) or from a ``process`` jsonl
(``--from-file``), turn each group into output lines with a per-tool function,
optionally drop duplicates, and append them to a jsonl with a progress bar.

Exit codes: 0 wrote at least one line; 1 nothing matched (the message names the
scores seen and the flag that would include them), or the API failed (unreachable,
refused, died); 2 bad input (malformed or empty rollouts file, output exists,
tokenizer cannot be loaded); 130 interrupted. The output file is created with its
first line, so a failed run leaves nothing that blocks the retry.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from atroposlib.frontend.api_client import ApiError, TrainerClient
from atroposlib.frontend.export import Deduper, GroupView, group_view
from atroposlib.frontend.rollouts import RolloutFileError, iter_groups

logger = logging.getLogger(__name__)

DEFAULT_TOKENIZER = "NousResearch/DeepHermes-3-Llama-3-8B-Preview"


class ToolError(RuntimeError):
    """A failure to report to the user as one line, with an exit code."""

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass
class Counters:
    """What happened during a run, for the closing summary."""

    groups: int = 0
    written: int = 0
    duplicates: int = 0
    skipped_groups: dict[str, int] = field(default_factory=dict)
    score_min: float | None = None
    score_max: float | None = None
    positive_scores: int = 0
    #: The widest ``max - min`` inside one group, and the widest gap between a positive
    #: score and its group's minimum: what the ``--minimum-score-diff-max-min`` rule compares.
    widest_gap: float = 0.0
    widest_positive_gap: float = 0.0

    def skip(self, reason: str) -> None:
        """Count a group that produced nothing for ``reason``."""
        self.skipped_groups[reason] = self.skipped_groups.get(reason, 0) + 1

    def saw_scores(self, scores: list[float]) -> None:
        """Remember the range of ``scores`` so an empty result can be explained."""
        if not scores:
            return
        lo, hi = min(scores), max(scores)
        self.score_min = lo if self.score_min is None else min(self.score_min, lo)
        self.score_max = hi if self.score_max is None else max(self.score_max, hi)
        positive = [s for s in scores if s > 0]
        self.positive_scores += len(positive)
        self.widest_gap = max(self.widest_gap, hi - lo)
        if positive:
            self.widest_positive_gap = max(self.widest_positive_gap, max(positive) - lo)


def explain_no_match(counters: Counters, args: argparse.Namespace) -> str:
    """Why no line was written, with the score range seen and the flag that would help.

    The selection rules are the original's: scores <= 0 are dropped unless
    ``--allow-negative-scores``, and when ``--minimum-score-diff-max-min`` is above 0 a
    rollout (SFT) or pair (DPO) needs a score more than that above its group's minimum.
    """
    if counters.groups == 0:
        return "no line matched the selection: no groups were read"
    if sum(counters.skipped_groups.values()) >= counters.groups:
        return "no line matched the selection: every group was skipped (reasons above)"
    if counters.score_min is None:
        return f"no line matched the selection: none of the {counters.groups} groups had scores"
    seen = (
        f"saw {counters.groups} groups with scores from {counters.score_min:g} "
        f"to {counters.score_max:g}"
    )
    min_diff = float(args.minimum_score_diff_max_min)
    if not args.allow_negative_scores and counters.positive_scores == 0:
        return (
            f"no line matched the selection: {seen}, and scores <= 0 are dropped; "
            "pass --allow-negative-scores to keep them"
        )
    gap = counters.widest_gap if args.allow_negative_scores else counters.widest_positive_gap
    if min_diff > 0 and gap <= min_diff:
        return (
            f"no line matched the selection: {seen}; the widest gap above a group's minimum "
            f"was {gap:g}, not above --minimum-score-diff-max-min {min_diff:g}; "
            f"pass a smaller --minimum-score-diff-max-min (e.g. 0) to include them"
            + ("" if args.allow_negative_scores else ", or --allow-negative-scores")
        )
    if counters.duplicates:
        return f"no line matched the selection: {seen}; every line was a duplicate (--dedupe)"
    return (
        f"no line matched the selection: {seen}; no group had a score above another's "
        "(identical scores give no pair), try --allow-negative-scores or "
        "--minimum-score-diff-max-min 0"
    )


def load_tokenizer(name: str) -> Any:
    """Load a tokenizer, turning any failure into a ToolError that says what to do."""
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(name)
    except Exception as e:  # transformers raises OSError, ValueError, HTTP errors ...
        raise ToolError(
            f"cannot load tokenizer {name!r} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). "
            "Pass --tokenizer with a local tokenizer directory, or use --save-messages."
        ) from None


class _DisplayTokenizer:
    """Just enough of a tokenizer to show text: ``decode`` through the ``tokenizers`` library."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(path))

    def decode(self, ids: Any) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)


def load_display_tokenizer(name: str) -> Any:
    """A tokenizer for showing text only (the viewers).

    A local directory with a ``tokenizer.json`` is read with the light
    ``tokenizers`` library, which starts much faster than transformers; anything
    else goes through :func:`load_tokenizer`. Exported datasets always use
    :func:`load_tokenizer`, so their text matches ``transformers`` decoding exactly.
    """
    path = Path(name) / "tokenizer.json"
    if path.is_file():
        try:
            return _DisplayTokenizer(path)
        except Exception as e:  # tokenizers raises its own Exception types on bad files
            logger.warning("could not read %s with tokenizers (%s); trying transformers", path, e)
    return load_tokenizer(name)


def _live_groups(client: TrainerClient, poll_interval: float) -> Iterator[dict[str, Any]]:
    while True:
        batch = client.wait_for_batch(poll_interval=poll_interval)
        yield from batch or []


def _file_groups(path: str) -> Iterator[dict[str, Any]]:
    for _, group in iter_groups(path):
        yield group


def _decode_all(tokenizer: Any, tokens: Any) -> list[str]:
    return [tokenizer.decode(seq) for seq in tokens]


RecordsFn = Callable[[GroupView, bool, random.Random], list[dict[str, Any]]]


def run_generation(
    args: argparse.Namespace,
    records_for: RecordsFn,
    batch_size: int,
    num_steps: int,
    console: Console | None = None,
) -> int:
    """Run one generator; return its exit code. ``records_for(view, use_messages, rng)`` makes lines."""
    console = console or Console(stderr=True, soft_wrap=True)
    try:
        counters = _generate(args, records_for, batch_size, num_steps, console)
    except ToolError as e:
        console.print(f"[bold red]error:[/] {e}", highlight=False)
        return e.exit_code
    except RolloutFileError as e:
        console.print(f"[bold red]error:[/] {e}", highlight=False)
        return 2
    except ApiError as e:
        console.print(f"[bold red]error:[/] {e}", highlight=False)
        return 1
    except KeyboardInterrupt:
        console.print("interrupted")
        return 130
    skipped = ", ".join(f"{n} {why}" for why, n in sorted(counters.skipped_groups.items()))
    console.print(
        f"wrote {counters.written} lines to {args.filepath} from {counters.groups} groups"
        + (f"; {counters.duplicates} duplicates dropped" if counters.duplicates else "")
        + (f"; groups skipped: {skipped}" if skipped else ""),
        highlight=False,
    )
    if counters.written == 0:
        console.print(f"[yellow]{explain_no_match(counters, args)}[/]", highlight=False)
        return 1
    return 0


def _generate(
    args: argparse.Namespace,
    records_for: RecordsFn,
    batch_size: int,
    num_steps: int,
    console: Console,
) -> Counters:
    out_path = Path(args.filepath)
    if out_path.exists() and not args.append_to_previous:
        raise ToolError(f"{out_path} already exists; pass --append-to-previous to add to it")
    if args.num_seqs_to_save <= 0:
        raise ToolError("--num-seqs-to-save must be positive")
    use_messages = bool(args.save_messages)
    with contextlib.ExitStack() as stack:
        # Cheap checks first: a bad rollouts file or an unreachable API is reported
        # before a tokenizer is loaded, and nothing registers before that.
        client: TrainerClient | None = None
        if args.from_file:
            groups = _peeked(_file_groups(args.from_file))
        else:
            client = stack.enter_context(TrainerClient(args.api_url))
            client.check()
        tokenizer = None if use_messages else load_tokenizer(args.tokenizer)
        dedupe = Deduper() if args.dedupe else None
        if dedupe is not None and out_path.exists():
            dedupe.load(out_path)
        if client is not None:
            client.ensure_registered(
                batch_size=batch_size,
                max_token_len=args.max_token_len,
                num_steps=num_steps,
                reset=args.reset_api,
            )
            groups = _live_groups(client, args.poll_interval)
        out = stack.enter_context(_LazyOutput(out_path))
        progress = stack.enter_context(
            Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=console,
                disable=args.no_progress,
            )
        )
        task = progress.add_task("saving", total=args.num_seqs_to_save)
        return _write_records(
            groups,
            out,
            records_for,
            tokenizer,
            use_messages,
            dedupe,
            random.Random(args.seed),
            args.num_seqs_to_save,
            lambda: progress.advance(task),
        )
    raise AssertionError("unreachable")  # pragma: no cover


class _LazyOutput:
    """The output file, created on the first line written.

    A run that fails or matches nothing therefore leaves no empty file behind, which
    would otherwise make the retry stop at "already exists". A rollouts file found
    malformed part way (:class:`RolloutFileError`) takes back what this run wrote: the
    file is removed, or cut back to its size before the run with ``--append-to-previous``.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: TextIO | None = None
        self._size_before: int | None = None

    def write(self, text: str) -> None:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._size_before = self.path.stat().st_size if self.path.exists() else None
            self._file = self.path.open("a", encoding="utf-8")
        self._file.write(text)

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def __enter__(self) -> _LazyOutput:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        if self._file is None:
            return
        self._file.close()
        if kind is not None and issubclass(kind, RolloutFileError):
            if self._size_before is None:
                self.path.unlink(missing_ok=True)
            else:
                os.truncate(self.path, self._size_before)


def _write_records(
    groups: Iterator[dict[str, Any]],
    out: TextIO | _LazyOutput,
    records_for: RecordsFn,
    tokenizer: Any,
    use_messages: bool,
    dedupe: Deduper | None,
    rng: random.Random,
    limit: int,
    advance: Callable[[], None],
) -> Counters:
    """Turn groups into lines until ``limit`` lines are written or the groups run out."""
    counters = Counters()
    for group in groups:
        counters.groups += 1
        n_scores = len(group.get("scores") or [])
        with contextlib.suppress(TypeError, ValueError):
            counters.saw_scores([float(x) for x in group.get("scores") or []])
        decoded = None
        if use_messages:
            if not isinstance(group.get("messages"), list):
                counters.skip("without messages")
                continue
            if len(group["messages"]) < n_scores:
                counters.skip("with fewer messages than scores")
                continue
        else:
            tokens = group.get("tokens")
            if not isinstance(tokens, list) or len(tokens) < n_scores:
                counters.skip("without tokens for every score")
                continue
            decoded = _decode_all(tokenizer, tokens)
        for record in records_for(group_view(group, decoded), use_messages, rng):
            if dedupe is not None and not dedupe.is_new(record):
                counters.duplicates += 1
                continue
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
            counters.written += 1
            advance()
            if counters.written >= limit:
                return counters
        out.flush()
    return counters


def _peeked(groups: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Pull the first group now (so file errors surface early), then yield everything."""
    try:
        first = next(groups)
    except StopIteration:
        return iter(())

    def chain() -> Iterator[dict[str, Any]]:
        yield first
        yield from groups

    return chain()
