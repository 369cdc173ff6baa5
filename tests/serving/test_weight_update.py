"""Hot weight updates under load, and API-key protection (the server with --api-key)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from atroposlib.tiny_model import build_tiny_model
from tests.serving.support import AUTH, direct_logprobs


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    new = build_tiny_model(root / "step_1", seed=1)
    other = build_tiny_model(
        root / "other", seed=1, hidden_size=32, num_attention_heads=2, num_key_value_heads=1
    )
    build_tiny_model(root / "step_2", seed=2)
    return new, other


def test_every_endpoint_but_health_needs_the_key(keyed):
    assert httpx.get(f"{keyed}/health", timeout=10).status_code == 200
    for method, route in (
        ("GET", "/v1/models"),
        ("POST", "/v1/completions"),
        ("POST", "/generate"),
        ("POST", "/update_weights"),
    ):
        r = httpx.request(method, f"{keyed}{route}", json={}, timeout=10)
        assert r.status_code == 401, route
        assert r.json()["error"]["type"] == "authentication_error"
        wrong = httpx.request(
            method, f"{keyed}{route}", json={}, timeout=10, headers={"Authorization": "Bearer nope"}
        )
        assert wrong.status_code == 401
    assert httpx.get(f"{keyed}/v1/models", headers=AUTH, timeout=10).status_code == 200


def test_incompatible_checkpoint_is_rejected_and_version_kept(keyed, checkpoints):
    _, other = checkpoints
    r = httpx.post(f"{keyed}/update_weights", json={"path": other}, headers=AUTH, timeout=60)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "path"
    assert httpx.get(f"{keyed}/health", timeout=10).json()["version"] == 0


async def test_weight_update_under_load_never_mixes_versions(
    keyed, checkpoints, tokenizer, local_model
):
    from transformers import AutoModelForCausalLM

    new_path, _ = checkpoints
    new_model = AutoModelForCausalLM.from_pretrained(new_path, dtype=torch.float32).eval()
    prompt_ids = tokenizer.encode("Grace has 12 pencils and buys 5 more.")
    results: list[dict] = []
    statuses: list[int] = []

    async with httpx.AsyncClient(timeout=120, headers=AUTH) as client:
        stop = asyncio.Event()

        async def worker(i: int) -> None:
            while not stop.is_set():
                r = await client.post(
                    f"{keyed}/generate",
                    json={
                        "prompt": {"prompt_token_ids": prompt_ids},
                        "max_tokens": 12,
                        "logprobs": 0,
                        "seed": i,
                        "ignore_eos": True,
                    },
                )
                statuses.append(r.status_code)
                if r.status_code == 200:
                    results.append(r.json())

        workers = [asyncio.create_task(worker(i)) for i in range(6)]
        while len(results) < 6:
            await asyncio.sleep(0.05)
        upd = await client.post(f"{keyed}/update_weights", json={"path": new_path})
        seen = len(results)
        while len(results) < seen + 6:
            await asyncio.sleep(0.05)
        stop.set()
        await asyncio.gather(*workers)
        health = (await client.get(f"{keyed}/health")).json()
        models = (await client.get(f"{keyed}/v1/models")).json()

    assert upd.status_code == 200, upd.text
    assert upd.json()["version"] == 1 and upd.json()["path"] == new_path
    assert health["version"] == 1 and models["data"][0]["version"] == 1
    assert set(statuses) == {200}
    versions = {r["version"] for r in results}
    assert versions == {0, 1}
    # Every response comes wholly from one set of weights: its logprobs match that model.
    for r in results:
        model = local_model if r["version"] == 0 else new_model
        ids = r["token_ids"][0]
        got = [next(iter(e[0].values())) for e in r["logprobs"][0]]
        want = direct_logprobs(model, prompt_ids, ids)
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4, r["version"]


async def test_long_request_is_restarted_on_the_new_weights(keyed, checkpoints, tokenizer):
    """With --swap-drain-timeout 0.5 an update does not wait for a long generation: the
    request is re-run from its prompt on the new weights and says so by its version."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    step_2 = str(Path(checkpoints[0]).parent / "step_2")
    new_model = AutoModelForCausalLM.from_pretrained(step_2, dtype=torch.float32).eval()
    prompt_ids = tokenizer.encode("Henry reads 20 pages a day.")
    async with httpx.AsyncClient(timeout=300, headers=AUTH) as client:
        before = (await client.get(f"{keyed}/health")).json()
        long = asyncio.create_task(
            client.post(
                f"{keyed}/generate",
                json={
                    "prompt": {"prompt_token_ids": prompt_ids},
                    "max_tokens": 1500,
                    "logprobs": 0,
                    "seed": 1,
                    "ignore_eos": True,
                },
            )
        )
        while (await client.get(f"{keyed}/health")).json()["running"] == 0:
            await asyncio.sleep(0.05)
        upd = await client.post(f"{keyed}/update_weights", json={"path": step_2})
        assert upd.status_code == 200, upd.text
        assert not long.done()  # the update did not wait for the 400-token generation
        r = (await long).json()
        after = (await client.get(f"{keyed}/health")).json()
    assert r["version"] == upd.json()["version"] == before["version"] + 1
    assert after["restarted_on_update"] == before["restarted_on_update"] + 1
    ids = r["token_ids"][0]
    assert len(ids) == 1500
    got = [next(iter(e[0].values())) for e in r["logprobs"][0]]
    want = direct_logprobs(new_model, prompt_ids, ids)
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4


async def test_vllm_server_sends_the_key_on_generate_and_health(keyed, tiny_model_dir):
    from atroposlib.envs.server_handling.server_baseline import APIServerConfig
    from atroposlib.envs.server_handling.vllm_server import VLLMServer
    from tests.serving.support import KEY

    cfg = APIServerConfig(
        base_url=f"{keyed}/v1",
        model_name="tiny",
        api_key=KEY,
        timeout=60,
        tokenizer_name=str(tiny_model_dir),
        server_type="vllm",
    )
    server = VLLMServer(cfg)
    try:
        prompt, outs, lps, finish = await server.tokens_and_logprobs_completion(
            input_ids=[5, 6, 7], n=1, max_tokens=3, temperature=1.0
        )
        assert prompt == [5, 6, 7] and len(outs[0]) == len(lps[0]) >= 1
    finally:
        await server.close_http()
