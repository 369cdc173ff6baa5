"""The contract between the embedded engine and ``transformers``.

The engine's KV cache plugs into ``transformers``' ``Cache`` interface
(``atroposlib.utils.transformers_compat``). A release that changes how attention
layers call a cache, or how a forward pass takes one, must fail here first: a
batched prefill and decode through our cache must give the log-probabilities of a
plain full forward pass of the same sequences, for both architectures the tiny
model is built in.
"""

from __future__ import annotations

import pytest
import torch

from atroposlib.serving.kv_cache import SlotKV
from atroposlib.utils.transformers_compat import (
    TRANSFORMERS_MAJOR,
    CacheAdapter,
    forward_with_cache,
    prefer_sdpa,
)

pytestmark = pytest.mark.smoke


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def model(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from atroposlib.tiny_model import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp(request.param), seed=3, arch=request.param)
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prefer_sdpa(loaded)
    return loaded


def _full_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def _mask(positions: torch.Tensor, length: int) -> torch.Tensor:
    return (torch.arange(length) <= positions.unsqueeze(-1)).unsqueeze(1)


def test_batched_decode_through_our_cache_matches_a_full_forward(model):
    """Three prompts of different lengths are prefilled in one left-padded pass, then
    decoded together for six steps; every step's log-probabilities equal a plain
    forward pass over the whole sequence (fp32, 1e-4)."""
    prompts = [[5, 17, 99, 3, 250, 41, 7], [12, 8, 300], [64, 65, 66, 67, 68]]
    kv = SlotKV.for_model(model, len(prompts), 64)
    width = max(map(len, prompts))
    ids, pos, write_slots, write_pos, source = [], [], [], [], []
    for row, prompt in enumerate(prompts):
        pad = width - len(prompt)
        ids.append([0] * pad + prompt)
        pos.append([0] * pad + list(range(len(prompt))))
        write_slots += [row] * len(prompt)
        write_pos += range(len(prompt))
        source += range(row * width + pad, (row + 1) * width)
    positions = torch.tensor(pos)
    # Left padding: a padded query position attends only to the row's own keys; give
    # it position 0's key so its (discarded) output stays finite.
    mask = _mask(positions, width)
    cache = kv.pass_view(
        slice(0, len(prompts)),
        torch.tensor(write_slots),
        torch.tensor(write_pos),
        width,
        torch.tensor(source),
    )
    with torch.no_grad():
        logits = forward_with_cache(model, torch.tensor(ids), positions, mask, cache, 0)
    seqs = [list(p) for p in prompts]
    for row, prompt in enumerate(prompts):
        got = torch.log_softmax(logits[row, -1].float(), dim=-1)
        assert torch.allclose(got, _full_logprobs(model, prompt)[-1], atol=1e-4)
    for step in range(6):
        nxt = [(row * 37 + step * 11) % 200 + 1 for row in range(len(seqs))]
        lens = torch.tensor([[len(s)] for s in seqs])
        length = int(lens.max()) + 1
        cache = kv.pass_view(slice(0, len(seqs)), torch.arange(len(seqs)), lens[:, 0], length)
        with torch.no_grad():
            logits = forward_with_cache(
                model, torch.tensor([[t] for t in nxt]), lens, _mask(lens, length), cache, 1
            )
        for row, seq in enumerate(seqs):
            seq.append(nxt[row])
            got = torch.log_softmax(logits[row, -1].float(), dim=-1)
            want = _full_logprobs(model, seq)[-1]
            assert (got - want).abs().max().item() < 1e-4, (step, row)


class _Recorder(CacheAdapter):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[int] = []

    def store(self, key_states, value_states, layer_idx):
        self.calls.append(layer_idx)
        return key_states, value_states

    def visible_length(self) -> int:
        return 3

    def capacity(self) -> int:
        return 8


def test_cache_accepts_the_extra_arguments_releases_pass():
    """4.x passes ``cache_kwargs`` positionally, 5.24 passes ``kwargs=``: both reach store()."""
    cache = _Recorder()
    k = torch.zeros(1, 2, 3, 4)
    assert cache.update(k, k, 0, {"sin": None, "cos": None})[0] is k
    assert cache.update(k, k, 1, kwargs={"position_ids": None})[0] is k
    assert cache.update(k, k, 2)[0] is k
    assert cache.calls == [0, 1, 2]
    assert cache.get_seq_length() == cache.get_seq_length(1) == 3
    assert cache.get_mask_sizes(torch.arange(2), 0) == (3, 0)
    assert cache.get_mask_sizes(2, layer_idx=0) == (3, 0)
    assert cache.get_max_cache_shape() == cache.get_max_length() == 8


def test_the_major_version_is_the_installed_one():
    import transformers

    assert int(transformers.__version__.split(".")[0]) == TRANSFORMERS_MAJOR
