"""The Gradio apps behind ``view-run`` and ``view-run-multimodal``.

Two modes:

* live: acts as the trainer against ``run-api``; "Grab Next Batch" polls
  ``/batch`` once a second and shows the first group of the batch (prefix,
  each output without the prefix, each score) — the original behaviour;
* file (``--file``): browses the groups of ``process`` jsonl files without
  touching any API: navigate, filter by environment, score range and text,
  and see which tokens are trained and their inference logprobs.

Gradio is imported here and only here, so nothing else in the package needs it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import gradio as gr
from starlette.middleware import Middleware

from atroposlib.frontend.api_client import ApiError, TrainerClient
from atroposlib.frontend.rollouts import RolloutIndex, default_group_text
from atroposlib.frontend.viewer import (
    VIEWER_CSS,
    live_outputs,
    make_decode_one,
    render_group_html,
)
from atroposlib.http.answers import detail_error, send_error
from atroposlib.http.server import ServerOptions, server_middleware
from atroposlib.http.transport import http_protocol

logger = logging.getLogger(__name__)

ALL_ENVS = "(all environments)"
SCORE_MODES = ["any", "all", "mean"]


def build_live_app(
    client: TrainerClient,
    tokenizer: Any,
    group_size: int,
    poll_interval: float = 1.0,
    poll_timeout: float | None = None,
    multimodal: bool = False,
) -> gr.Blocks:
    """The original batch inspector: prefix, outputs and scores of the next batch's first group."""
    with gr.Blocks(title="Atropos run viewer", analytics_enabled=False) as demo:
        image = None
        text_prompt = None
        if multimodal:
            with gr.Row():
                image = gr.Image(label="Image", type="pil")
                text_prompt = gr.Textbox(label="Text Prompt", lines=4)
        prefix = gr.Textbox(label="Prefix", lines=4)
        outputs: list[gr.Textbox] = []
        scores: list[gr.Textbox] = []
        for i in range(group_size):
            with gr.Row():
                outputs.append(gr.Textbox(label=f"Output_{i}", lines=4, scale=4))
                scores.append(gr.Textbox(label=f"Score_{i}", scale=1))
        status = gr.Markdown("Press **Grab Next Batch** to pull a batch from the API.")
        button = gr.Button("Grab Next Batch")

        def grab() -> list[Any]:
            try:
                batch = client.wait_for_batch(poll_interval=poll_interval, timeout=poll_timeout)
            except ApiError as e:
                raise gr.Error(str(e)) from None
            return live_outputs(batch, tokenizer, group_size, multimodal, poll_timeout)

        out_components = ([image, text_prompt] if multimodal else []) + [
            prefix,
            *outputs,
            *scores,
            status,
        ]
        button.click(grab, inputs=None, outputs=out_components, api_name="grab_next_batch")
    return demo


def _bound(text: Any, label: str) -> float | None:
    """Parse a score bound typed by the user; empty means unbounded."""
    if text is None or (isinstance(text, str) and not text.strip()):
        return None
    try:
        return float(text)
    except (TypeError, ValueError):
        raise gr.Error(f"{label} must be a number, got {text!r}") from None


@dataclass
class _Search:
    env: str | None
    low: float | None
    high: float | None
    mode: str
    query: str


def build_file_app(
    index: RolloutIndex, tokenizer: Any = None, title: str = "Atropos rollouts"
) -> gr.Blocks:
    """A read-only browser over indexed rollouts files; no API is touched."""
    decode_one = make_decode_one(tokenizer)

    def text_of(group: dict[str, Any]) -> str:
        text = default_group_text(group)
        if not text and tokenizer is not None:
            text = "\n".join(tokenizer.decode(seq) for seq in group.get("tokens") or [])
        return text

    def show(matches: list[int], pos: int) -> tuple[int, str, str]:
        if not matches:
            return 0, f"No group matches (of {len(index)}).", "<p>No group matches the filters.</p>"
        pos = min(max(int(pos), 1), len(matches))
        i = matches[pos - 1]
        ref = index.refs[i]
        where = f"{ref.env} · {ref.source.name} line {ref.line_no}"
        status = f"Group {pos} of {len(matches)} matching ({len(index)} in total) — {where}"
        return pos, status, render_group_html(index.load(i), decode_one, title=where)

    def search(env: str, low: str, high: str, mode: str, query: str) -> tuple:
        s = _Search(
            None if env in (None, "", ALL_ENVS) else env,
            _bound(low, "Min score"),
            _bound(high, "Max score"),
            mode or "any",
            query or "",
        )
        matches = index.filter(s.env, s.low, s.high, s.query, s.mode, text_of=text_of)
        pos, status, body = show(matches, 1)
        return matches, pos, status, body

    initial_matches = list(range(len(index)))
    _, initial_status, initial_html = show(initial_matches, 1)

    with gr.Blocks(title=title, analytics_enabled=False) as demo:
        gr.Markdown(f"## {title}\n{len(index)} groups · environments: {', '.join(index.envs())}")
        matches_state = gr.State(initial_matches)
        with gr.Row():
            env = gr.Dropdown([ALL_ENVS, *index.envs()], value=ALL_ENVS, label="Environment")
            low = gr.Textbox(label="Min score", placeholder="no minimum")
            high = gr.Textbox(label="Max score", placeholder="no maximum")
            mode = gr.Radio(SCORE_MODES, value="any", label="Score range applies to")
            query = gr.Textbox(label="Search text", placeholder="substring, case-insensitive")
            apply = gr.Button("Apply filters", variant="primary")
        with gr.Row():
            prev_btn = gr.Button("◀ Previous")
            pos = gr.Number(value=1, label="Group #", precision=0, minimum=1)
            next_btn = gr.Button("Next ▶")
        status = gr.Markdown(initial_status, elem_id="atropos-status")
        body = gr.HTML(initial_html, elem_id="atropos-group")

        def step(delta: int) -> Callable[[list[int], float], tuple[int, str, str]]:
            def go(matches: list[int], current: float) -> tuple[int, str, str]:
                return show(matches, int(current or 1) + delta)

            return go

        search_inputs = [env, low, high, mode, query]
        apply.click(search, search_inputs, [matches_state, pos, status, body], api_name="search")
        query.submit(search, search_inputs, [matches_state, pos, status, body])
        prev_btn.click(step(-1), [matches_state, pos], [pos, status, body], api_name="previous")
        next_btn.click(step(1), [matches_state, pos], [pos, status, body], api_name="next")
        pos.submit(step(0), [matches_state, pos], [pos, status, body], api_name="goto")
    return demo


MAX_BODY_BYTES = 16 << 20
"""Largest request body the viewer reads: Gradio's calls are small JSON, and it takes no files."""


def viewer_middleware(
    host: str, share: bool, allowed_origins: Iterable[str] = ()
) -> list[Middleware]:
    """The shared server stack (:func:`atroposlib.http.server.server_middleware`) for a
    Gradio app served on ``host``.

    Gradio's own page is same-origin and stays allowed; a foreign ``Origin`` gets 403 and,
    on loopback, so does a non-loopback ``Host`` (DNS rebinding). Bodies are not forced to
    JSON because Gradio's uploads are multipart. A ``--share`` link reaches the app through
    a public tunnel under names and origins we cannot know, so it turns both checks off.
    Bodies are bounded (:data:`MAX_BODY_BYTES`) and dropped when they stall.
    """
    return server_middleware(
        ServerOptions(
            bind_host=host,
            allowed_origins=tuple(allowed_origins),
            allow_any_origin=share,
            require_json=False,
            open_paths=(),
            max_body_bytes=MAX_BODY_BYTES,
            body_hints={"size": "view-run's limit", "timeout": "ATROPOS_BODY_TIMEOUT"},
        )
    )


_UPLOAD_PATHS = frozenset({"/upload", "/gradio_api/upload"})


class NoUploads:
    """Pure-ASGI middleware turning Gradio's upload route off (404).

    Gradio serves ``POST /gradio_api/upload`` on every app, saving multipart files from any
    local client into its temp directory; the viewer has no upload component, so nothing
    it shows needs the route.
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope.get("path", "").rstrip("/") in _UPLOAD_PATHS:
            message = "uploads are turned off: the viewer takes no files"
            await send_error(send, 404, message, shape=detail_error)
            return
        await self.app(scope, receive, send)


class _UvicornWithOurProtocol:
    """The ``uvicorn`` module as Gradio's server code sees it, building every ``Config`` with
    our HTTP protocol (:func:`~atroposlib.http.transport.http_protocol`): Gradio gives no
    other way to choose it, and it bounds what one connection can make the viewer hold."""

    def __init__(self, module: Any) -> None:
        self._module = module

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)

    def Config(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802 (uvicorn's name)
        kwargs.setdefault("http", http_protocol())
        return self._module.Config(*args, **kwargs)


def _serve_with_our_protocol() -> None:
    import gradio.http_server as gradio_server

    if not isinstance(gradio_server.uvicorn, _UvicornWithOurProtocol):
        gradio_server.uvicorn = _UvicornWithOurProtocol(gradio_server.uvicorn)


def launch(
    demo: gr.Blocks, host: str, port: int, share: bool, allowed_origins: Iterable[str] = ()
) -> None:
    """Serve ``demo`` (blocking) on ``host:port`` behind :func:`viewer_middleware`."""
    demo.queue(default_concurrency_limit=4)
    _serve_with_our_protocol()
    shown = f"[{host}]" if ":" in host else host
    print(f"view-run: serving on http://{shown}:{port}/ (Ctrl+C to stop)", flush=True)
    demo.launch(
        app_kwargs={
            "middleware": [*viewer_middleware(host, share, allowed_origins), Middleware(NoUploads)]
        },
        server_name=host,
        server_port=port,
        share=share,
        ssr_mode=False,
        css=VIEWER_CSS,
        show_error=True,
        quiet=not share,  # Gradio prints the share link only when not quiet
    )
