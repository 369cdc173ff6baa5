"""The original's module-level helpers of the dataset and viewer tools, against a real
run-api where they talk to one."""

from __future__ import annotations

import asyncio
import base64
import io
import json
from pathlib import Path

import httpx
import pytest

from atroposlib.cli import dpo, inference_node_wandb_watcher, sft, view_run, view_run_multimodal
from atroposlib.frontend import jsonl2html
from tests.api.conftest import start_api


@pytest.fixture(scope="module")
def api_url(tmp_path_factory):
    ctx, url = start_api(tmp_path_factory.mktemp("helpers-api"))
    with ctx:
        yield url


def _post(url: str, group: dict) -> None:
    r = httpx.post(f"{url}/scored_data", json=group, timeout=10)
    assert r.status_code == 200, r.text


def test_find_common_prefix_everywhere():
    for module in (sft, dpo, view_run, view_run_multimodal):
        assert module.find_common_prefix(["Q: 1 A: x", "Q: 1 A: y"]) == "Q: 1 A: "
        assert module.find_common_prefix([]) == ""


def test_grab_group_data(tokenizer, make_group):
    group = make_group("Q: 2+2? A: ", ["4", "5", "22"], [1.0, -1.0, 0.5])
    rows = sft.grab_group_data(tokenizer, group, False, 2)
    assert rows == [
        {"prefix": "Q: 2+2? A: ", "completion": "4", "score": 1.0},
        {"prefix": "Q: 2+2? A: ", "completion": "22", "score": 0.5},
    ]
    with_messages = sft.grab_group_data(tokenizer, group, True, 1)
    assert with_messages[0]["messages"][-1]["content"] == "4"
    pairs = dpo.grab_group_data(tokenizer, group, False, 3, minimum_score_diff_max_min=0.0)
    assert pairs and all(p["score"] > 0 for p in pairs)
    assert {p["pos"] for p in pairs} <= {"4", "22"}


async def test_register_check_for_batch_and_grabbers(
    api_url, tokenizer, tokenizer_dir, make_group, tmp_path
):
    httpx.get(f"{api_url}/reset_data", timeout=10)
    answer = await sft.register_to_api(2, 512, api_url, num_steps=10, tasks_per_step=1)
    assert "uuid" in answer
    _post(api_url, make_group("Q: a? A: ", ["yes", "no"], [1.0, -1.0]))
    batch = await asyncio.wait_for(sft.check_for_batch(api_url), 30)
    assert len(batch) == 1 and batch[0]["scores"] == [1.0, -1.0]

    for i in range(3):
        _post(api_url, make_group(f"Q: {i}? A: ", ["good", "bad"], [1.0, -1.0]))
    out = tmp_path / "sft.jsonl"
    code = await asyncio.wait_for(
        sft.sft_data_grabber(
            str(out), api_url, 2, 512, str(tokenizer_dir), False, 1, 2, False, 0.0, False, 1
        ),
        60,
    )
    assert code == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 2 and all(r["completion"] == "good" for r in rows)

    httpx.get(f"{api_url}/reset_data", timeout=10)
    await dpo.register_to_api(1, 512, api_url)  # batches of 8 sequences: 4 groups of 2
    for i in range(8):
        _post(api_url, make_group(f"Q: d{i}? A: ", ["right", "wrong"], [1.0, -1.0]))
    out_dpo = tmp_path / "dpo.jsonl"
    code = await asyncio.wait_for(
        dpo.dpo_data_grabber(
            str(out_dpo), api_url, 1, 512, str(tokenizer_dir), False, 1, 2, False, 0.5, False
        ),
        60,
    )
    assert code == 0
    pairs = [json.loads(line) for line in out_dpo.read_text().splitlines()]
    assert len(pairs) == 2 and all((p["pos"], p["neg"]) == ("right", "wrong") for p in pairs)


async def test_view_run_helpers_use_the_default_api(monkeypatch, tokenizer):
    seen: list[str] = []

    class Recorder:
        def __init__(self, url):
            seen.append(url)

        def check(self):
            seen.append("check")

        def ensure_registered(self, batch_size, max_token_len, num_steps, reset=False):
            assert reset is False  # the original helper never wipes the API
            seen.append(f"register {batch_size} {max_token_len}")

        def close(self):
            seen.append("closed")

    launched: list[tuple] = []
    monkeypatch.setattr(view_run, "TrainerClient", Recorder)
    import atroposlib.frontend.viewer_app as viewer_app

    monkeypatch.setattr(
        viewer_app,
        "launch",
        lambda demo, host, port, share: launched.append((type(demo).__name__, host, port, share)),
    )
    await view_run.build_interface(2, 256, tokenizer, 7999)
    await view_run_multimodal.build_interface(2, 256, tokenizer, 7998)
    assert seen[:4] == ["http://localhost:8000", "check", "register 16 256", "closed"]
    assert launched == [("Blocks", "127.0.0.1", 7999, False), ("Blocks", "127.0.0.1", 7998, False)]


def test_multimodal_chat_extraction():
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (2, 2), "red").save(buf, format="PNG")
    data = base64.b64encode(buf.getvalue()).decode()
    chat = f'[{{"type": "image_url", "image_url": {{"url": "data:image/png;base64,{data}"}}}}, {{"type": "text", "text": "What color?"}}]'
    image = view_run_multimodal.extract_image_from_chat(chat)
    assert image is not None and image.size == (2, 2)
    assert view_run_multimodal.extract_text_from_chat(chat) == "What color?"
    assert view_run_multimodal.extract_image_from_chat("no image") is None


def test_watcher_run_and_update_wandb(api_url, monkeypatch):
    httpx.get(f"{api_url}/reset_data", timeout=10)
    httpx.post(
        f"{api_url}/register",
        json={
            "wandb_group": "g",
            "wandb_project": "p",
            "batch_size": 2,
            "max_token_len": 64,
            "checkpoint_dir": "c",
            "save_checkpoint_interval": 1,
            "starting_step": 0,
            "num_steps": 2,
        },
        timeout=10,
    ).raise_for_status()
    logged: list[tuple] = []
    import wandb

    monkeypatch.setattr(wandb, "init", lambda **kw: logged.append(("init", kw["project"])))
    monkeypatch.setattr(wandb, "log", lambda metrics, step=None: logged.append((metrics, step)))
    code = inference_node_wandb_watcher.run(
        api_url, 8, 3, interval=0.01, base_port=1, max_iterations=1
    )
    assert code == 0 and logged[0] == ("init", "p")
    inference_node_wandb_watcher.update_wandb({"server/server_health_3_0": 0.0}, step=4)
    assert logged[-1] == ({"server/server_health_3_0": 0.0}, 4)


def test_jsonl2html_names():
    assert jsonl2html.TEMPLATE_FILE == jsonl2html.SCRIPT_DIR / "template.html"
    assert Path(jsonl2html.TEMPLATE_FILE).is_file()
    assert [jsonl2html.get_score_class(s) for s in (1, -0.5, 0, "x")] == [
        "reward-positive",
        "reward-negative",
        "reward-zero",
        "reward-zero",
    ]
