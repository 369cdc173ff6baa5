"""HTML for one scored group in the ``view-run --file`` browser (pure functions).

Each rollout shows its score, its chat messages (escaped text) and its tokens,
with the trained tokens (mask != -100) highlighted and their inference logprob
in the tooltip and as a shade: the lower the logprob, the stronger the shade.

Example::

    html = render_group_html(group, decode_one=lambda t: tokenizer.decode([t]), title="gsm8k · line 3")
"""

from __future__ import annotations

import functools
import html
import re
from typing import Any, Callable, Sequence

from atroposlib.frontend.multimodal import extract_text_prompt, group_image
from atroposlib.frontend.rollouts import (
    MASKED,
    TokenSpan,
    as_turns,
    messages_text,
    split_prefix,
    token_spans,
)

_B64 = re.compile(r"^(data:image/(png|jpeg|jpg|gif|webp);base64,)?[A-Za-z0-9+/=\s]+$")

VIEWER_CSS = """
.atropos-group { font-size: 14px; }
.atropos-group .meta { color: #57606a; margin-bottom: 6px; }
.atropos-group .rollout { border-left: 5px solid #8c959f; padding: 4px 10px; margin: 8px 0; background: #fbfbfc; }
.atropos-group .rollout.reward-positive { border-left-color: #1a7f37; }
.atropos-group .rollout.reward-negative { border-left-color: #cf222e; }
.atropos-group .rollout-head { font-weight: 600; }
.atropos-group .messages { white-space: pre-wrap; margin: 4px 0; }
.atropos-group .tokens { white-space: pre-wrap; font-family: ui-monospace, Menlo, Consolas, monospace;
  font-size: 12px; line-height: 1.7; }
.atropos-group .tok.prompt { color: #8c959f; }
.atropos-group .tok.trained { color: #0b3d91; border-bottom: 2px solid #0969da; }
.atropos-group .legend span { margin-right: 12px; }
.atropos-group .shared { border-left: 5px solid #0969da; padding: 4px 10px; margin: 8px 0; background: #f6f8fa; }
.atropos-group img.group-image { max-width: 360px; max-height: 360px; margin: 4px 8px 4px 0; }
"""


def _score_class(score: float) -> str:
    if score > 0:
        return "reward-positive"
    if score < 0:
        return "reward-negative"
    return "reward-zero"


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4g}"


def _token_html(span: TokenSpan) -> str:
    text = html.escape(span.text) if span.text else "&#8203;"
    if not span.trained:
        return f'<span class="tok prompt" title="id {span.token_id} · not trained">{text}</span>'
    # Shade by surprise: logprob 0 -> no shade, <= -5 -> strongest.
    alpha = 0.0 if span.logprob is None else min(max(-span.logprob, 0.0), 5.0) / 5.0 * 0.55
    return (
        f'<span class="tok trained" style="background: rgba(255, 140, 0, {alpha:.2f})" '
        f'title="id {span.token_id} · trained · logprob {_fmt(span.logprob)}">{text}</span>'
    )


def _images_html(images: Any, limit: int = 4) -> str:
    """``<img>`` tags for base64 images of a group (plain base64 is assumed to be PNG/JPEG)."""
    if isinstance(images, str):
        images = [images]
    if not isinstance(images, list):
        return ""
    tags = []
    for value in images[:limit]:
        if not isinstance(value, str) or len(value) < 16 or not _B64.match(value):
            continue
        url = value if value.startswith("data:") else f"data:image/png;base64,{value}"
        tags.append(
            f'<img class="group-image" alt="group image" src="{html.escape(url, quote=True)}">'
        )
    return "".join(tags)


def sequence_stats(spans: Sequence[TokenSpan]) -> dict[str, Any]:
    """Counts for a rollout header: tokens, trained tokens, mean inference logprob of trained tokens."""
    trained = [s for s in spans if s.trained]
    lps = [s.logprob for s in trained if s.logprob is not None]
    return {
        "tokens": len(spans),
        "trained": len(trained),
        "mean_logprob": (sum(lps) / len(lps)) if lps else None,
    }


def shared_turns(messages: Sequence[Any]) -> int:
    """How many leading chat turns every rollout's ``messages`` has in common (0 for strings)."""
    convs = [m for m in messages if isinstance(m, list)]
    if len(convs) < 2 or len(convs) != len(messages):
        return 0
    n = 0
    for turns in zip(*convs, strict=False):
        if any(t != turns[0] for t in turns[1:]):
            break
        n += 1
    # Leave at least one turn to each rollout.
    return min(n, min(len(c) for c in convs) - 1)


def shared_masked_prefix(tokens: Sequence[Any], masks: Sequence[Any]) -> int:
    """Length of the leading tokens all sequences share and none trains on."""
    seqs = [t for t in tokens if isinstance(t, list)]
    if len(seqs) < 2 or len(seqs) != len(tokens) or len(masks) != len(tokens):
        return 0
    n = 0
    for column in zip(*seqs, strict=False):
        if any(c != column[0] for c in column[1:]) or any(
            not isinstance(m, list) or n >= len(m) or m[n] != MASKED for m in masks
        ):
            break
        n += 1
    return n


def policy_version_label(group: dict[str, Any], index: int) -> str:
    """`` · policy v3`` (or ``v3-4`` when the rollout spanned a weight swap); empty when
    the group carries no versions."""
    low = group.get("policy_version") or []
    high = group.get("policy_version_max") or []
    lo = low[index] if isinstance(low, list) and index < len(low) else None
    hi = high[index] if isinstance(high, list) and index < len(high) else None
    if lo is None:
        return ""
    return f" · policy v{lo}" + (f"-{hi}" if hi is not None and hi != lo else "")


def render_group_html(
    group: dict[str, Any], decode_one: Callable[[int], str] | None, title: str = ""
) -> str:
    """The whole group as an HTML fragment (all rollout text escaped).

    ``decode_one`` turns a token id into text; without it tokens show as ``[id]``.
    The chat turns all rollouts share are shown once, above the rollouts; so are
    the untrained prompt tokens (in full for rollout 0, folded for the others).
    """
    decode = decode_one or (lambda t: f"[{t}]")
    scores = [float(s) for s in group.get("scores") or []]
    tokens = group.get("tokens") or []
    masks = group.get("masks") or []
    logprobs = group.get("inference_logprobs") or []
    messages = [as_turns(m) for m in group.get("messages") or []]
    n_shared = shared_turns(messages[: len(scores)]) if len(messages) >= len(scores) else 0
    n_prompt = shared_masked_prefix(tokens[: len(scores)], masks[: len(scores)])
    parts = [
        '<div class="atropos-group">',
        f'<div class="meta">{html.escape(title)} · {len(scores)} rollouts · scores: '
        f"{html.escape(', '.join(_fmt(s) for s in scores))}</div>",
        '<div class="legend"><span class="tok prompt">prompt / not trained</span>'
        '<span class="tok trained">trained (shade = lower inference logprob)</span></div>',
        _images_html(group.get("images")),
    ]
    if n_shared:
        parts.append(
            '<div class="shared"><div class="rollout-head">Shared by all rollouts</div>'
            f'<div class="messages">{html.escape(messages_text(messages[0][:n_shared]))}</div></div>'
        )
    for i, score in enumerate(scores):
        spans = []
        if i < len(tokens) and isinstance(tokens[i], list):
            spans = token_spans(
                tokens[i],
                masks[i] if i < len(masks) else None,
                logprobs[i] if i < len(logprobs) else None,
                decode,
            )
        stats = sequence_stats(spans)
        parts.append(f'<div class="rollout {_score_class(score)}">')
        parts.append(
            f'<div class="rollout-head">Rollout {i} · score {_fmt(score)} · '
            f"{stats['trained']}/{stats['tokens']} tokens trained · "
            f"mean logprob {_fmt(stats['mean_logprob'])}"
            f"{html.escape(policy_version_label(group, i))}</div>"
        )
        if i < len(messages):
            own = messages[i][n_shared:] if n_shared else messages[i]
            parts.append(f'<div class="messages">{html.escape(messages_text(own))}</div>')
        if spans:
            folded = n_prompt if i > 0 else 0
            body = "".join(_token_html(s) for s in spans[folded:])
            if folded:
                body = (
                    f'<span class="tok prompt">[{folded} prompt tokens as in rollout 0]</span>'
                    + body
                )
            parts.append(
                f'<details open><summary>Tokens</summary><div class="tokens">{body}</div></details>'
            )
        parts.append("</div>")
    parts.append("</div>")
    return "".join(parts)


def make_decode_one(tokenizer: Any) -> Callable[[int], str] | None:
    """A cached single-token decoder, or None without a tokenizer."""
    if tokenizer is None:
        return None

    @functools.lru_cache(maxsize=65536)
    def decode_one(token_id: int) -> str:
        return tokenizer.decode([token_id])

    return decode_one


def live_group_fields(
    group: dict[str, Any], tokenizer: Any, n_boxes: int
) -> tuple[str, list[str], list[str]]:
    """(prefix, outputs, scores) for the first ``n_boxes`` sequences of a group, padded with ""."""
    texts = [tokenizer.decode(seq) for seq in group.get("tokens") or []]
    prefix, outputs = split_prefix(texts) if len(texts) > 1 else ("", texts)
    scores = [str(s) for s in group.get("scores") or []]
    outputs = (outputs + [""] * n_boxes)[:n_boxes]
    scores = (scores + [""] * n_boxes)[:n_boxes]
    return prefix, outputs, scores


def live_outputs(
    batch: list[dict[str, Any]] | None,
    tokenizer: Any,
    n_boxes: int,
    multimodal: bool = False,
    poll_timeout: float | None = None,
) -> list[Any]:
    """Values for the live viewer's components, in order:
    ``[image, text prompt]`` (multimodal only), prefix, ``n_boxes`` outputs, ``n_boxes`` scores, status.
    """
    if not batch:
        waited = f" within {poll_timeout:g} s" if poll_timeout is not None else ""
        empty = [
            "",
            *[""] * n_boxes,
            *[""] * n_boxes,
            f"No batch arrived{waited}; press again to keep waiting.",
        ]
        return ([None, ""] if multimodal else []) + empty
    group = batch[0]
    prefix, outs, scores = live_group_fields(group, tokenizer, n_boxes)
    status = (
        f"Batch of {len(batch)} groups; showing the first "
        f"({len(group.get('scores') or [])} rollouts, env_id={group.get('env_id')})."
    )
    extra: list[Any] = []
    if multimodal:
        full = tokenizer.decode(group["tokens"][0]) if group.get("tokens") else ""
        extra = [group_image(group, full), extract_text_prompt(full)]
    return extra + [prefix, *outs, *scores, status]
