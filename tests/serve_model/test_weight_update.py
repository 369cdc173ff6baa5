"""Hot weight updates under load, and API-key protection (the server with --api-key)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from atroposlib.tiny_model import build_tiny_model
from tests.serve_model.support import AUTH, direct_logprobs



@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    new = build_tiny_model(root / "step_1", seed=1)
    other = build_tiny_model(root / "other", seed=1, hidden_size=32, num_attention_heads=2,
                             num_key_value_heads=1)
    return new, other


def test_every_endpoint_but_health_needs_the_key(keyed):
    assert httpx.get(f"{keyed}/health", timeout=10).status_code == 200
    for method, route in (("GET", "/v1/models"), ("POST", "/v1/completions"),
                          ("POST", "/generate"), ("POST", "/update_weights")):
        r = httpx.request(method, f"{keyed}{route}", json={}, timeout=10)
        assert r.status_code == 401, route
        assert r.json()["error"]["type"] == "authentication_error"
        wrong = httpx.request(method, f"{keyed}{route}", json={}, timeout=10,
                              headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
    assert httpx.get(f"{keyed}/v1/models", headers=AUTH, timeout=10).status_code == 200


def test_incompatible_checkpoint_is_rejected_and_version_kept(keyed, checkpoints):
    _, other = checkpoints
    r = httpx.post(f"{keyed}/update_weights", json={"path": other}, headers=AUTH, timeout=60)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "path"
    assert httpx.get(f"{keyed}/health", timeout=10).json()["version"] == 0


async def test_weight_update_under_load_never_mixes_versions(keyed, checkpoints, tokenizer,
                                                              local_model):
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
                r = await client.post(f"{keyed}/generate", json={
                    "prompt": {"prompt_token_ids": prompt_ids}, "max_tokens": 12,
                    "logprobs": 0, "seed": i, "ignore_eos": True})
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
