"""Real model: the GRPO trainer step versus a bare HF step, and weight sync to
``atropos-serve-model``, on SmolLM2-135M-Instruct (134.5M parameters, fp32 on the CPU).

The measurements of ``benchmarks/trainer_bench.py`` (``bench_step``: trainer step and bare
HF forward + backward + AdamW on the same padded batch, alternating, ratio per pair, median
and range; ``bench_sync``: ``http_reload`` = save + ``POST /update_weights`` to a running
``atropos-serve-model``, versus ``none`` = save + restart it) on the real pretrained model
converted by ``atropos-real-model``, with a batch shaped like the CPU demo's
(``example_trainer/configs/smollm2_cpu.yaml``: 16 sequences of 64 tokens)::

    python benchmarks/real_model_trainer.py [--seqs 16 --len 64 --micro 16 --repeats 3]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    """Convert (once) the real model, then time the trainer step and the weight sync on it."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", type=int, default=16)
    p.add_argument("--len", type=int, default=64)
    p.add_argument("--micro", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--precision", default="auto")
    p.add_argument("--skip-step", action="store_true")
    p.add_argument("--skip-sync", action="store_true")
    args = p.parse_args()

    from atroposlib.tiny_model.real_model import RealModelUnavailable, ensure_real_model

    try:
        model = ensure_real_model()
    except RealModelUnavailable as exc:
        sys.exit(f"real_model_trainer: {exc}")
    import torch
    from trainer_bench import bench_step, bench_sync

    torch.manual_seed(0)
    print(
        f"real model: SmolLM2-135M-Instruct ({model}); torch threads {torch.get_num_threads()}; "
        f"load average {os.getloadavg()}",
        flush=True,
    )
    if not args.skip_step:
        bench_step(model, args)
    if not args.skip_sync:
        bench_sync(model, args)
    print(f"load average at the end {os.getloadavg()}")


if __name__ == "__main__":
    main()
