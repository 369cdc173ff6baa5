"""``--swap-in-place``: weight updates copied tensor by tensor into the served model.

The loader's memory bound is pinned in-process (a read hook watches every tensor it holds);
the rest runs against a real ``atropos-serve-model --swap-in-place`` process.
"""

from __future__ import annotations

import asyncio
import gc
import weakref

import httpx
import pytest
import torch

from atroposlib.http.openai_protocol import InvalidRequest
from atroposlib.serving.in_place import plan_in_place
from atroposlib.serving.weights_version import write_weights_version
from atroposlib.testing.ports import free_port
from atroposlib.testing.processes import running_process
from atroposlib.tiny_model import build_tiny_model
from tests.serving.support import direct_logprobs, serve_cmd

PROMPT = [5, 6, 7, 8, 9, 10]


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_in_place_loader_holds_one_tensor_at_a_time(tiny_model_dir, tmp_path):
    """Sharded checkpoint: every tensor read is released before the next is read, so the
    extra memory is the largest tensor, never a second state dict; the result equals the
    checkpoint."""
    served = _load(tiny_model_dir)
    source = _load(build_tiny_model(tmp_path / "src", seed=4))
    source.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()

    update = plan_in_place(str(tmp_path / "sharded"), served)
    assert len(update.shards) > 1
    alive: list[weakref.ref] = []
    peak = {"bytes": 0, "reads": 0}

    def read(handle, name):
        gc.collect()
        held = sum(r().nbytes for r in alive if r() is not None)
        tensor = handle.get_tensor(name)
        alive.append(weakref.ref(tensor))
        peak["bytes"] = max(peak["bytes"], held + tensor.nbytes)
        peak["reads"] += 1
        return tensor

    update.apply(read)
    largest = max(t.nbytes for t in source.state_dict().values())
    total = sum(p.nbytes for p in served.parameters())
    assert peak["reads"] == update.tensors == 26
    assert peak["bytes"] == largest < total
    want = source.state_dict()
    for name, tensor in served.state_dict().items():
        assert torch.equal(tensor, want[name]), name


def test_wrong_shape_is_rejected_before_any_copy(tiny_model_dir, tmp_path):
    served = _load(tiny_model_dir)
    before = _snapshot(served)
    bad = build_tiny_model(tmp_path / "bad", seed=1, intermediate_size=128)
    with pytest.raises(InvalidRequest, match="shape") as info:
        plan_in_place(bad, served)
    assert info.value.param == "path"
    for name, tensor in served.state_dict().items():
        assert torch.equal(tensor, before[name]), name


async def test_a_copy_failing_midway_refuses_generation_until_a_good_update(
    tiny_model_dir, tokenizer, tmp_path
):
    """Half-copied weights are never served: generation answers 503 until an update
    succeeds, and the version stays until then."""
    from atroposlib.http.openai_protocol import OpenAIError as ServingError
    from atroposlib.serving.engine import Engine
    from atroposlib.serving.in_place import InPlaceUpdate
    from atroposlib.serving.sampling import SamplingParams

    class FailsAfterThree(InPlaceUpdate):
        def apply(self, read=None):
            count = iter(range(100))

            def failing(handle, name):
                if next(count) == 3:
                    raise OSError("disk went away")
                return handle.get_tensor(name)

            super().apply(failing)

    good = build_tiny_model(tmp_path / "good", seed=6)
    engine = Engine(_load(tiny_model_dir), tokenizer, max_model_len=64, max_num_seqs=2)

    def loader(path):
        update = plan_in_place(path, engine.model)
        return update if path == good else FailsAfterThree(update.path, update.shards)

    engine._loader = loader
    await engine.start()
    try:
        with pytest.raises(OSError, match="disk went away"):
            await engine.update_weights(build_tiny_model(tmp_path / "torn", seed=7))
        assert engine.version == 0 and engine.swap_log == []
        with pytest.raises(ServingError) as info:
            await engine.generate(PROMPT, SamplingParams(max_tokens=2))
        assert info.value.status == 503
        assert (await engine.update_weights(good))["version"] == 1
        res = await engine.generate(PROMPT, SamplingParams(max_tokens=4, seed=0))
    finally:
        await engine.stop()
    want = direct_logprobs(_load(good), PROMPT, res.outputs[0].token_ids)
    assert max(abs(a - b) for a, b in zip(res.outputs[0].logprobs, want, strict=True)) < 1e-4


def test_missing_or_unknown_tensors_and_non_safetensors_are_rejected(tiny_model_dir, tmp_path):
    from safetensors.torch import save_file

    served = _load(tiny_model_dir)
    weights = {k: v.contiguous() for k, v in served.state_dict().items() if k != "lm_head.weight"}
    cases = {
        "missing": {k: v for k, v in weights.items() if "layers.1.mlp.up_proj" not in k},
        "unknown": {**weights, "model.extra.weight": torch.zeros(2)},
    }
    for name, tensors in cases.items():
        (tmp_path / name).mkdir()
        save_file(tensors, str(tmp_path / name / "model.safetensors"))
        with pytest.raises(InvalidRequest, match=name if name == "missing" else "not in"):
            plan_in_place(str(tmp_path / name), served)
    (tmp_path / "bin").mkdir()
    torch.save(weights, tmp_path / "bin" / "pytorch_model.bin")
    with pytest.raises(InvalidRequest, match="safetensors only"):
        plan_in_place(str(tmp_path / "bin"), served)
    # Tied weights may be stored under either name.
    (tmp_path / "tied").mkdir()
    renamed = {k.replace("model.embed_tokens", "lm_head"): v for k, v in weights.items()}
    save_file(renamed, str(tmp_path / "tied" / "model.safetensors"))
    assert plan_in_place(str(tmp_path / "tied"), served).tensors == len(weights)


@pytest.fixture(scope="module")
def in_place_server(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("in_place")
    port = free_port()
    cmd = serve_cmd(
        tiny_model_dir,
        port,
        "--swap-in-place",
        "--weights-root",
        str(root),
        "--swap-drain-timeout",
        "0.5",
    )
    with running_process(
        cmd, health_url=f"http://127.0.0.1:{port}/health", timeout=180, log_path=root / "log"
    ):
        yield f"http://127.0.0.1:{port}", root


def _logprobs(url: str, ids: list[int], max_tokens: int = 8) -> tuple[list[int], list[float]]:
    r = httpx.post(
        f"{url}/generate",
        json={
            "prompt": {"prompt_token_ids": ids},
            "max_tokens": max_tokens,
            "logprobs": 0,
            "seed": 3,
            "ignore_eos": True,
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    return body["token_ids"][0], [next(iter(e[0].values())) for e in body["logprobs"][0]]


def test_wrong_shape_gives_400_and_the_old_weights_serve_identically(in_place_server):
    url, root = in_place_server
    bad = build_tiny_model(root / "wrong_shape", seed=1, intermediate_size=128)
    version = httpx.get(f"{url}/health", timeout=10).json()["version"]
    before = _logprobs(url, PROMPT)
    r = httpx.post(f"{url}/update_weights", json={"path": bad}, timeout=120)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "path" and "shape" in r.json()["error"]["message"]
    assert _logprobs(url, PROMPT) == before
    assert httpx.get(f"{url}/health", timeout=10).json()["version"] == version


def test_update_matches_the_new_checkpoint_and_advances_the_version(in_place_server):
    url, root = in_place_server
    step = build_tiny_model(root / "step_5", seed=5)
    write_weights_version(step, 5)  # adopted: the request names no version
    r = httpx.post(f"{url}/update_weights", json={"path": step}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["version"] == 5
    ids, got = _logprobs(url, PROMPT, 12)
    want = direct_logprobs(_load(step), PROMPT, ids)
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4
    history = httpx.get(f"{url}/weights_history", timeout=10).json()
    assert history["version"] == 5
    assert history["swaps"][-1]["version"] == 5 and history["swaps"][-1]["path"] == step


async def test_running_request_is_restarted_on_the_copied_weights(in_place_server):
    """The drain/restart policy is the default swap's: a long request still running after
    --swap-drain-timeout is re-run on the new weights, and its version says so."""
    url, root = in_place_server
    step = build_tiny_model(root / "step_9", seed=9)
    async with httpx.AsyncClient(timeout=300) as client:
        before = (await client.get(f"{url}/health")).json()
        long = asyncio.create_task(
            client.post(
                f"{url}/generate",
                json={
                    "prompt": {"prompt_token_ids": PROMPT},
                    "max_tokens": 600,
                    "logprobs": 0,
                    "seed": 1,
                    "ignore_eos": True,
                },
            )
        )
        while (await client.get(f"{url}/health")).json()["running"] == 0:
            await asyncio.sleep(0.02)
        upd = await client.post(f"{url}/update_weights", json={"path": step, "version": 9})
        assert upd.status_code == 200, upd.text
        r = (await long).json()
        after = (await client.get(f"{url}/health")).json()
    assert r["version"] == 9
    assert after["restarted_on_update"] == before["restarted_on_update"] + 1
    ids = r["token_ids"][0]
    got = [next(iter(e[0].values())) for e in r["logprobs"][0]]
    want = direct_logprobs(_load(step), PROMPT, ids)
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4
