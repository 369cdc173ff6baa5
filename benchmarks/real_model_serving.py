"""Real model: ``atropos-serve-model`` next to vLLM's own server on SmolLM2-135M-Instruct.

The measurement of ``benchmarks/vllm_bench.py`` (both servers started on free ports, the same
chat completions of exactly ``--new-tokens`` tokens at each concurrency, alternating repeats,
tokens/s and server CPU time per generated token from ``/proc``), on the real pretrained model
converted by ``atropos-real-model`` (30 layers, hidden 576, 9 heads of 64, 49k vocabulary)
instead of the tiny one. Every other flag goes to ``vllm_bench.py``::

    python benchmarks/real_model_serving.py                       # 1 / 16 / 64 concurrent
    python benchmarks/real_model_serving.py --concurrency 1 16 --repeats 3 --json out.json
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    """Convert (once) the real model, then run vllm_bench on it with the remaining flags."""
    from atroposlib.tiny_model.real_model import RealModelUnavailable, ensure_real_model

    try:
        model = ensure_real_model()
    except RealModelUnavailable as exc:
        sys.exit(f"real_model_serving: {exc}")
    import vllm_bench

    print(
        f"real model: SmolLM2-135M-Instruct ({model}); load average {os.getloadavg()}",
        flush=True,
    )
    rest = sys.argv[1:]
    if "--max-model-len" not in rest:
        rest = ["--max-model-len", "512", *rest]
    sys.argv = [sys.argv[0], "--model", model, *rest]
    vllm_bench.main()


if __name__ == "__main__":
    main()
