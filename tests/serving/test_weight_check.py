"""``/update_weights`` checks the checkpoint's tensors against the served model, in both modes.

A checkpoint with a tensor missing (loading would initialise it afresh), an extra tensor
(loading would drop it) or a tensor of another shape is refused with a 400 naming that
tensor (``param: path``); the old weights keep serving, token for token, and the version
stays. Real ``atropos-serve-model`` processes, with and without ``--swap-in-place``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from atroposlib.testing.ports import free_port
from atroposlib.testing.processes import running_process
from tests.serving.support import serve_cmd

PROMPT = [5, 6, 7, 8, 9, 10]
TARGET = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture(scope="module", params=["load-and-swap", "swap-in-place"])
def server(request, tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"weights-{request.param}")
    port = free_port()
    extra = ["--swap-in-place"] if request.param == "swap-in-place" else []
    cmd = serve_cmd(tiny_model_dir, port, *extra, "--weights-root", str(root))
    with running_process(
        cmd, health_url=f"http://127.0.0.1:{port}/health", timeout=180, log_path=root / "log"
    ):
        yield f"http://127.0.0.1:{port}", root


def _checkpoint(model_dir: Path, dest: Path, change) -> str:
    """A copy of the served model whose tensors went through ``change``."""
    shutil.copytree(model_dir, dest)
    tensors = load_file(str(dest / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return str(dest)


def _generate(url: str) -> tuple[list[int], list[float]]:
    r = httpx.post(
        f"{url}/generate",
        json={
            "prompt": {"prompt_token_ids": PROMPT},
            "max_tokens": 8,
            "logprobs": 0,
            "seed": 3,
            "ignore_eos": True,
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    return body["token_ids"][0], [next(iter(e[0].values())) for e in body["logprobs"][0]]


def _version(url: str) -> int:
    return httpx.get(f"{url}/health", timeout=10).json()["version"]


CASES = {
    "missing": (lambda t: t.pop(TARGET), f"{TARGET} is missing"),
    "extra": (
        lambda t: t.__setitem__("extra.weight", torch.zeros(3)),
        "extra.weight is not in the served model",
    ),
    "mis-shaped": (
        lambda t: t.__setitem__(TARGET, torch.zeros(8, t[TARGET].shape[1])),
        f"{TARGET} has shape [8, 64], the served model [64, 64]",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_checkpoint_that_does_not_fit_is_refused_and_the_old_weights_serve(
    server, tiny_model_dir, case
):
    url, root = server
    change, named = CASES[case]
    path = _checkpoint(tiny_model_dir, root / case, change)
    version, before = _version(url), _generate(url)
    r = httpx.post(f"{url}/update_weights", json={"path": path}, timeout=120)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "path"
    assert named in error["message"], error["message"]
    assert _version(url) == version
    assert _generate(url) == before


def test_a_checkpoint_that_fits_is_taken(server, tiny_model_dir):
    """The check passes what it should: the same tensors, other values, a new version."""
    url, root = server

    def nudge(tensors):
        tensors[TARGET] = tensors[TARGET] + 0.5

    path = _checkpoint(tiny_model_dir, root / "good", nudge)
    version, before = _version(url), _generate(url)
    r = httpx.post(f"{url}/update_weights", json={"path": path}, timeout=120)
    assert r.status_code == 200, r.text
    assert _version(url) == r.json()["version"] > version
    assert _generate(url) != before
