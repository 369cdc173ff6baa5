"""view-run: the API-free file browser (in headless chromium and via gradio_client) and the live mode."""

from __future__ import annotations

import html
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from atroposlib.testing.pipelining import assert_flood_grows_server_little
from atroposlib.testing.ports import free_port
from atroposlib.testing.processes import PYTHON, start_process, stop_process, wait_http

CHROMIUM = shutil.which("chromium") or (
    "/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None
)
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--virtual-time-budget=15000",
    "--window-size=1280,1400",
]


def _visible_text(dom: str) -> str:
    """Text of a DOM dump without scripts/styles (the app config embeds values in a script)."""
    dom = re.sub(r"<(script|style)\b.*?</\1>", " ", dom, flags=re.S | re.I)
    return html.unescape(re.sub(r"<[^>]+>", " ", dom))


def _tokenized(tokenizer, prompt: str, completions: list[str], scores: list[float]) -> dict:
    p = tokenizer.encode(prompt, add_special_tokens=False)
    toks = [p + tokenizer.encode(c, add_special_tokens=False) for c in completions]
    return {
        "tokens": toks,
        "masks": [[-100] * len(p) + t[len(p) :] for t in toks],
        "scores": scores,
    }


@pytest.fixture(scope="module")
def viewers(
    tmp_path_factory, make_group, write_jsonl, tokenizer, tokenizer_dir, keyed_api, api_key
):
    """Two view-run processes started side by side (their Gradio start-up overlaps):
    ``--file`` over two rollouts files, and live mode against a keyed run-api that
    already holds one queued group.
    """
    d = tmp_path_factory.mktemp("viewrun")
    math = write_jsonl(
        d / "math.jsonl",
        [
            make_group(
                "Q: two plus two? A: ", ["the answer is four", "five <b>bold</b>"], [0.75, -1.0]
            ),
            make_group("Q: three plus three? A: ", ["six", "seven"], [1.0, 0.0]),
        ],
    )
    code = write_jsonl(
        d / "code.jsonl", [make_group("Write hello: ", ["print('hello')", "echo"], [0.5, 0.25])]
    )
    file_port, live_port, mm_port = free_port(), free_port(), free_port()
    with httpx.Client(
        base_url=keyed_api, timeout=10, headers={"Authorization": f"Bearer {api_key}"}
    ) as h:
        h.get("/reset_data").raise_for_status()
        h.post(
            "/register",
            json={
                "wandb_group": "g",
                "wandb_project": "p",
                "batch_size": 4,
                "max_token_len": 512,
                "checkpoint_dir": "c",
                "save_checkpoint_interval": 1,
                "starting_step": 0,
                "num_steps": 10,
            },
        ).raise_for_status()
        h.post(
            "/scored_data", json=_tokenized(tokenizer, "Q: 1+1? A: ", ["2", "3"], [1.0, -1.0])
        ).raise_for_status()
    procs = [
        start_process(
            [
                PYTHON,
                "-m",
                "atroposlib.cli.view_run",
                "--file",
                str(math),
                "--file",
                str(code),
                "--tokenizer",
                str(tokenizer_dir),
                "--port",
                str(file_port),
            ],
            log_path=d / "file.log",
        ),
        start_process(
            [
                PYTHON,
                "-m",
                "atroposlib.cli.view_run",
                "--api-url",
                keyed_api,
                "--tokenizer",
                str(tokenizer_dir),
                "--port",
                str(live_port),
                "--poll-timeout",
                "20",
            ],
            log_path=d / "live.log",
            env={"ATROPOS_API_KEY": api_key},
        ),
        start_process(
            [
                PYTHON,
                "-m",
                "atroposlib.cli.view_run_multimodal",
                "--api-url",
                keyed_api,
                "--tokenizer",
                str(tokenizer_dir),
                "--port",
                str(mm_port),
                "--poll-timeout",
                "20",
            ],
            log_path=d / "multimodal.log",
            env={"ATROPOS_API_KEY": api_key},
        ),
    ]
    try:
        ports, logs = (file_port, live_port, mm_port), ("file.log", "live.log", "multimodal.log")
        for proc, port, log in zip(procs, ports, logs, strict=True):
            try:
                wait_http(f"http://127.0.0.1:{port}/", timeout=120, proc=proc)
            except (TimeoutError, RuntimeError):
                print((d / log).read_text(errors="replace")[-4000:])
                raise
        yield {
            "file": f"http://127.0.0.1:{file_port}/",
            "live": f"http://127.0.0.1:{live_port}/",
            "multimodal": f"http://127.0.0.1:{mm_port}/",
            "dir": d,
            "file_pid": procs[0].pid,
        }
    finally:
        for proc in procs:
            stop_process(proc)


@pytest.mark.skipif(
    CHROMIUM is None, reason="chromium not installed (the Makefile / .ci/run installs it with apt)"
)
def test_file_mode_page_shows_group_text_and_score_in_chromium(viewers) -> None:
    url, d = viewers["file"], viewers["dir"]
    shot = d / "view.png"
    # One headless run writes both the screenshot and the DOM after scripts ran.
    dom = subprocess.run(
        [
            CHROMIUM,
            *CHROMIUM_FLAGS,
            f"--user-data-dir={d / 'chrome'}",
            f"--screenshot={shot}",
            "--dump-dom",
            url,
        ],
        capture_output=True,
        text=True,
        timeout=90,
    ).stdout
    text = _visible_text(dom)
    assert "user: Q: two plus two? A:" in text
    assert "assistant: the answer is four" in text
    assert "score 0.75" in text and "score -1" in text
    assert "five <b>bold</b>" in text  # shown as text, not rendered as markup
    assert re.search(r"18/38 tokens trained · mean logprob -0.5\b", text)
    assert re.search(r'class="tok trained"[^>]*title="id \d+ · trained · logprob -0.5"', dom)
    from PIL import Image

    with Image.open(shot) as img:
        assert img.format == "PNG" and img.size == (1280, 1400)
        colours = img.convert("RGB").getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 50  # a rendered page, not a blank frame


@pytest.mark.smoke
def test_file_mode_filters_and_navigation_via_gradio_client(viewers) -> None:
    from gradio_client import Client

    url = viewers["file"]
    client = Client(url, verbose=False)
    pos, status, body = client.predict("code", "", "", "any", "", api_name="/search")
    assert pos == 1 and "Group 1 of 1 matching (3 in total) — code · code.jsonl line 1" in status
    assert "print(&#x27;hello&#x27;)" in body
    _, status, body = client.predict("(all environments)", "0.9", "", "any", "", api_name="/search")
    assert "Group 1 of 1 matching" in status and "three plus three" in body
    _, status, body = client.predict(
        "(all environments)", "", "", "any", "FOUR", api_name="/search"
    )
    assert "Group 1 of 1 matching" in status and "the answer is four" in body
    _, status, _ = client.predict("(all environments)", "0.3", "0.6", "all", "", api_name="/search")
    assert "No group matches" in status
    _, status, _ = client.predict("math", "", "", "mean", "", api_name="/search")
    assert "Group 1 of 2 matching" in status
    # navigation works on the session's last search (held in gr.State)
    pos, status, body = client.predict(1, api_name="/next")
    assert pos == 2 and "math.jsonl line 2" in status and "three plus three" in body
    pos, status, _ = client.predict(2, api_name="/next")
    assert pos == 2  # clamped at the last match
    pos, _, body = client.predict(2, api_name="/previous")
    assert pos == 1 and "two plus two" in body
    with pytest.raises(Exception, match="Min score must be a number"):
        client.predict("(all environments)", "abc", "", "any", "", api_name="/search")


def test_bad_file_input_and_unreachable_api_exit_with_a_message(
    tmp_path: Path, write_jsonl, port: int, tokenizer_dir: Path, capsys
) -> None:
    from atroposlib.cli import view_run

    bad = write_jsonl(
        tmp_path / "bad.jsonl", [{"scores": [1.0], "messages": ["ok"]}, '["not", "a group"]']
    )
    assert view_run.main(["--file", str(bad), "--port", str(port)]) == 2
    assert "bad.jsonl:2: expected a JSON object" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    assert view_run.main(["--file", str(empty), "--port", str(port)]) == 2
    assert "the file is empty" in capsys.readouterr().err
    assert view_run.main(["--file", str(tmp_path / "missing.jsonl")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert view_run.main(["--tokenizer", str(tmp_path), "--port", str(port)]) == 2
    assert "cannot load tokenizer" in capsys.readouterr().err
    unreachable = f"http://127.0.0.1:{free_port()}"
    assert (
        view_run.main(
            ["--api-url", unreachable, "--tokenizer", str(tokenizer_dir), "--port", str(port)]
        )
        == 1
    )
    assert f"cannot reach the rollout API at {unreachable}" in capsys.readouterr().err


def test_live_mode_shows_first_group_of_next_batch_without_resetting_the_api(
    viewers, tokenizer, keyed_api: str, api_key: str
) -> None:
    from gradio_client import Client

    with httpx.Client(
        base_url=keyed_api, timeout=10, headers={"Authorization": f"Bearer {api_key}"}
    ) as h:
        assert h.get("/status").json()["queue_size"] == 1  # view-run did not wipe the queue
        h.post(
            "/scored_data", json=_tokenized(tokenizer, "Q: 1+1? A: ", ["two", "11"], [0.5, 0.0])
        ).raise_for_status()
    client = Client(viewers["live"], verbose=False)
    prefix, out0, out1, score0, score1, status = client.predict(api_name="/grab_next_batch")
    assert prefix == "Q: 1+1? A: "
    assert (out0, out1) == ("2", "3")
    assert (float(score0), float(score1)) == (1.0, -1.0)
    assert "Batch of 2 groups" in status


def test_multimodal_live_mode_shows_image_and_text_prompt(
    viewers, tokenizer, keyed_api: str, api_key: str
) -> None:
    import base64
    import io

    from gradio_client import Client
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (5, 4), (0, 128, 255)).save(buf, format="PNG")
    image = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    prompt = '[{"type": "text", "text": "How many squares?"}] '
    groups = [
        dict(_tokenized(tokenizer, prompt, ["one", "three"], [1.0, -1.0]), images=[image])
    ] * 3
    with httpx.Client(
        base_url=keyed_api, timeout=10, headers={"Authorization": f"Bearer {api_key}"}
    ) as h:
        h.post("/scored_data_list", json=groups).raise_for_status()
    client = Client(viewers["multimodal"], verbose=False)
    # A group left queued by the live-mode test (when run alone) may come first.
    for _ in range(2):
        picture, text, prefix, out0, out1, score0, score1, status = client.predict(
            api_name="/grab_next_batch"
        )
        if picture is not None:
            break
    assert picture is not None, status
    with Image.open(picture) as shown:
        assert shown.size == (5, 4)
    assert text == "How many squares?"
    assert prefix == prompt and (out0, out1) == ("one", "three")
    assert (float(score0), float(score1)) == (1.0, -1.0)


def test_default_port_is_gradios_not_the_inference_servers() -> None:
    """view-run must not collide with ``atropos-serve-model --port 9001`` in the README."""
    from atroposlib.cli import view_run

    assert view_run.build_parser().parse_args([]).port == 7860
    assert view_run.build_parser(prog="view-run-multimodal").parse_args([]).port == 7860


def test_taken_port_is_reported_with_the_port_flag(tmp_path: Path, write_jsonl, capsys) -> None:
    import socket

    from atroposlib.cli import view_run

    rollouts = write_jsonl(tmp_path / "r.jsonl", [{"scores": [1.0], "messages": ["ok"]}])
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        assert view_run.main(["--file", str(rollouts), "--port", str(port)]) == 1
    err = capsys.readouterr().err
    assert f"port {port} on 127.0.0.1 is already in use" in err and "--port" in err
    assert "GRADIO_SERVER_PORT" not in err and "Traceback" not in err
    assert view_run.main(["--file", str(rollouts), "--port", "70000"]) == 1
    assert "not a TCP port" in capsys.readouterr().err


def test_viewer_refuses_foreign_pages_but_serves_its_own(viewers) -> None:
    """A foreign ``Origin`` (403) and a rebinding ``Host`` (403) are refused on every path,
    uploads included; the viewer's own origin and plain clients keep working, and Gradio's
    upload route is turned off (the viewer takes no files)."""
    base = viewers["file"].rstrip("/")
    own = base
    upload = f"{base}/gradio_api/upload"
    files = {"files": ("x.txt", b"hello", "text/plain")}
    with httpx.Client(timeout=20) as c:
        assert c.get(base + "/").status_code == 200
        foreign = c.get(base + "/", headers={"Origin": "http://evil.example"})
        assert foreign.status_code == 403 and "--cors-origin" in foreign.json()["detail"]
        rebound = c.get(
            base + "/config", headers={"Host": f"evil.example:{base.rsplit(':', 1)[1]}"}
        )
        assert rebound.status_code == 403 and "loopback" in rebound.json()["detail"]
        r = c.post(upload, files=files, headers={"Origin": "http://evil.example"})
        assert r.status_code == 403
        r = c.post(
            f"{base}/gradio_api/queue/join",
            content=b'{"fn_index": 0}',
            headers={"Origin": "http://evil.example", "Content-Type": "text/plain"},
        )
        assert r.status_code == 403
        # The viewer has no upload component: Gradio's upload route is off, even same-origin.
        for path in (upload, f"{base}/upload"):
            same_origin = c.post(path, files=files, headers={"Origin": own})
            assert same_origin.status_code == 404, same_origin.text
            assert "uploads are turned off" in same_origin.json()["detail"]
        assert c.get(base + "/config", headers={"Origin": own}).status_code == 200


def test_viewer_stops_reading_a_connection_whose_answers_are_not_taken(viewers) -> None:
    """A client pipelining requests and never reading the answers cannot grow the viewer
    (it is served through the same bounded HTTP protocol as run-api)."""
    port = int(viewers["file"].rstrip("/").rsplit(":", 1)[1])
    assert_flood_grows_server_little(port, viewers["file_pid"], "/config", health="/config")


def test_live_mode_closes_its_client_when_the_api_refuses(monkeypatch, tokenizer_dir) -> None:
    from atroposlib.cli import view_run
    from atroposlib.frontend.api_client import ApiError

    events: list[str] = []

    class Refused:
        def __init__(self, url):
            events.append(url)

        def check(self):
            raise ApiError("cannot reach the rollout API")

        def close(self):
            events.append("closed")

    monkeypatch.setattr(view_run, "TrainerClient", Refused)
    argv = ["--tokenizer", str(tokenizer_dir), "--api-url", "http://api.invalid:1"]
    assert view_run.main([*argv, "--port", str(free_port())]) == 1
    assert events == ["http://api.invalid:1", "closed"]
