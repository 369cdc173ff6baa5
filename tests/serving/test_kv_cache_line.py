"""The start-up log line about the KV cache says what it costs: on CPU a bound (address space,
RAM used as sequences grow), on CUDA an allocation."""

from __future__ import annotations

import torch

from atroposlib.serving.kv_cache import kv_cache_line


def test_cpu_cache_is_reported_as_a_bound_not_an_allocation():
    line = kv_cache_line(
        256, 32768, 4128 * 2**20, torch.device("cpu"), torch.float32, "--max-num-seqs"
    )
    assert line.startswith("KV cache: 256 sequences x 32768 tokens (sized by --max-num-seqs)")
    assert "up to 4128.0 MiB" in line and "address space only" in line
    assert "--max-model-len" in line and "allocated" not in line


def test_cuda_cache_is_reported_as_allocated():
    line = kv_cache_line(64, 4096, 2**30, torch.device("cuda", 0), torch.bfloat16, "--max-num-seqs")
    assert "= 1024.0 MiB of torch.bfloat16 allocated on cuda:0" in line
