"""A demo's "before", fresh: its warm-up computed into an empty directory, then its eval.

A demo's held-out accuracy before RL is the accuracy of its cached supervised warm-up, which
the first run on a machine computes. This script computes that warm-up again, from the run
config's ``warmup:`` section, into a temporary directory (the cache under ``.cache/`` is left
alone), serves it with ``atropos-serve-model`` and scores it with the config's ``eval:``
function, as the launcher's first eval does. It prints the score and the warm-up's CPU time.

Usage::

    python benchmarks/demo_before.py                       # the CPU demo (demo_cpu.yaml)
    python benchmarks/demo_before.py --config example_trainer/configs/reasoning_gym_cpu.yaml
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DEMO = ROOT / "example_trainer" / "configs" / "demo_cpu.yaml"


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"atropos-serve-model exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"atropos-serve-model did not answer at {url} within {timeout:.0f} s")


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--config", type=Path, default=DEMO, help="the run config (default: the CPU demo)"
    )
    args = p.parse_args()

    import torch
    import yaml
    from transformers import AutoTokenizer

    from atroposlib.utils.ports import free_port
    from example_trainer.launch.launcher import resolve_model
    from example_trainer.launch.run_config import RunConfig
    from example_trainer.launch.warmup import sft_warmup
    from example_trainer.plugins import load_function

    cfg = RunConfig(**(yaml.safe_load(args.config.read_text()) or {}))
    if cfg.warmup is None or cfg.eval is None:
        raise SystemExit(f"{args.config}: needs a warmup: and an eval: section")
    threads = cfg.cpu_threads or 1
    torch.set_num_threads(threads)
    w = cfg.warmup
    model = resolve_model(cfg.model, cfg.tiny_model_size)
    examples = load_function(w.examples)(w.n_examples, w.seed)
    with tempfile.TemporaryDirectory(prefix="demo-before-") as tmp:
        cpu0, wall0 = time.process_time(), time.monotonic()
        warm = sft_warmup(
            model,
            examples,
            Path(tmp) / "warmup",
            steps=w.steps,
            lr=w.lr,
            batch_size=w.batch_size,
            seed=w.seed,
            score_fn=load_function(w.score_function) if w.score_function else None,
            stop_at_score=w.stop_at_score,
            check_every=w.check_every,
        )
        cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
        port = free_port()
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        cmd = [sys.executable, "-m", "atroposlib.cli.serve_model", warm, "--port", str(port)]
        server = subprocess.Popen(cmd, env=env)
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_healthy(url, server)
            score = float(
                load_function(cfg.eval.function)(url, AutoTokenizer.from_pretrained(warm))
            )
        finally:
            server.terminate()
            server.wait(30)
    print(
        f"warm-up: {w.steps} steps in {cpu:.0f} s CPU ({wall:.0f} s wall, load {os.getloadavg()[0]:.1f})"
    )
    print(f"before ({cfg.eval.function}): {score:.3f}")


if __name__ == "__main__":
    main()
