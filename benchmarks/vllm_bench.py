"""``atropos-serve-model`` next to vLLM's own OpenAI server, same model, same load.

Starts both servers on free loopback ports (vLLM from ``.venv-vllm``, see
``atroposlib.testing.vllm_server``), then at each concurrency level sends ``--rounds``
batches of ``concurrency`` chat completions of exactly ``--new-tokens`` tokens
(``ignore_eos``, temperature 1) through the OpenAI client to one server, then the same to the
other, ``--repeats`` times, alternating so both see the same machine load. It prints
generated tokens per second and the server's CPU time per generated token (user + system of
the server process and its descendants, vLLM's engine-core process included, from ``/proc``),
median and range over the repeats, and the ratio vLLM / serve-model::

    python benchmarks/vllm_bench.py                                  # tiny model, head_dim 32
    python benchmarks/vllm_bench.py --concurrency 1 16 64 --repeats 3 --json out.json
    python benchmarks/vllm_bench.py --build-qwen2-0.5b /tmp/qwen-0.5b --new-tokens 32
    python benchmarks/vllm_bench.py --build-qwen2-0.5b /tmp/qwen-0.5b --enforce-eager \
        --max-model-len 256 --max-num-seqs 16 --concurrency 1 16

The default model is the offline tiny model shaped for vLLM's CPU attention (2 heads of 32,
``atropos-tiny-model --num-attention-heads 2 --num-key-value-heads 1``); ``--build-qwen2-0.5b``
writes a random-init model of Qwen2.5-0.5B's shape (nothing is downloaded). Both servers run
fp32 on the CPU unless ``--dtype``/``--device`` say otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_model_bench import Server, _http_level, build_qwen2_05b  # noqa: E402

from atroposlib.testing.vllm_server import (  # noqa: E402
    build_vllm_tiny_model,
    find_vllm_python,
    start_vllm_server,
)


def _summary(runs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(runs), "min": min(runs), "max": max(runs)}


def _cell(s: dict[str, float], fmt: str) -> str:
    return f"{s['median']:{fmt}} ({s['min']:{fmt}}-{s['max']:{fmt}})"


def main() -> None:
    """Parse flags, run both servers level by level and print the figures."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="Model directory (default: tiny, head_dim 32).")
    p.add_argument("--build-qwen2-0.5b", dest="build", default=None, metavar="DIR",
                   help="Build a random-init Qwen2.5-0.5B-shaped model in DIR and use it.")  # fmt: skip
    p.add_argument("--device", default="cpu", help="serve-model's device (vLLM: its build's).")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--rounds", type=int, default=2, help="Batches per level and repeat.")
    p.add_argument("--repeats", type=int, default=3, help="Alternating runs per level.")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--enforce-eager", action="store_true",
                   help="vLLM --enforce-eager: no torch.compile/inductor pass at start "
                        "(compilation mode NONE), the bulk of vLLM's CPU start-up.")  # fmt: skip
    p.add_argument("--max-num-seqs", type=int, default=None, help="vLLM --max-num-seqs.")
    p.add_argument("--kv-cache-gib", default="1", help="VLLM_CPU_KVCACHE_SPACE (GiB).")
    p.add_argument("--startup-timeout", type=float, default=900.0,
                   help="Seconds vLLM may take to answer /health.")  # fmt: skip
    p.add_argument("--json", default=None, help="Also write the figures to this file.")
    args = p.parse_args()

    python, problem = find_vllm_python()
    if python is None:
        sys.exit(f"vllm_bench: {problem}")
    work = Path(tempfile.mkdtemp(prefix="vllm-bench-"))
    if args.build:
        model = str(build_qwen2_05b(Path(args.build)))
    else:
        model = args.model or str(build_vllm_tiny_model(work / "tiny"))
    common = ["--max-model-len", str(args.max_model_len), "--dtype", args.dtype]
    print(
        f"model {model}, {args.new_tokens} new tokens per request, {args.rounds} rounds per "
        f"level, {args.repeats} alternating repeats; load average {os.getloadavg()}",
        flush=True,
    )
    vllm_args = list(common)
    if args.enforce_eager:
        vllm_args.append("--enforce-eager")
    if args.max_num_seqs is not None:
        vllm_args += ["--max-num-seqs", str(args.max_num_seqs)]
    serve = Server(ROOT, model, args.device, common)
    vllm = None
    try:
        serve.wait()
        t0 = time.monotonic()
        vllm = start_vllm_server(
            python,
            model,
            work / "vllm.log",
            extra_args=vllm_args,
            env={"VLLM_CPU_KVCACHE_SPACE": args.kv_cache_gib},
            timeout=args.startup_timeout,
        )
        startup_s = time.monotonic() - t0
        print(
            f"vLLM {' '.join(vllm_args)} up in {startup_s:.0f} s (load average {os.getloadavg()})",
            flush=True,
        )
        targets = {
            "atropos-serve-model": (serve.url, serve.proc.pid),
            "vllm": (vllm.base_url, vllm.process.pid),
        }
        rates: dict[str, dict[int, list[float]]] = {n: {} for n in targets}
        cpu: dict[str, dict[int, list[float]]] = {n: {} for n in targets}
        for level in args.concurrency:
            for _ in range(args.repeats):
                for name, (url, pid) in targets.items():
                    rate, ms = asyncio.run(
                        _http_level(url, model, level, args.rounds, args.new_tokens, pid=pid)
                    )
                    rates[name].setdefault(level, []).append(rate)
                    if ms is not None:
                        cpu[name].setdefault(level, []).append(ms)
                    print(f"  {name} c={level}: {rate:.1f} tok/s, {ms} ms CPU/token", flush=True)
    finally:
        serve.close()
        if vllm is not None:
            vllm.stop()
    load = os.getloadavg()
    report: dict[str, object] = {
        "model": model,
        "vllm_args": vllm_args,
        "vllm_startup_s": startup_s,
        "load_average_end": load,
        "levels": {},
    }
    print(f"\nload average at the end {load}")
    print("| concurrency | serve-model tok/s | vLLM tok/s | vLLM/serve-model | "
          "serve-model CPU ms/token | vLLM CPU ms/token |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for level in args.concurrency:
        s, v = _summary(rates["atropos-serve-model"][level]), _summary(rates["vllm"][level])
        cs = _summary(cpu["atropos-serve-model"].get(level) or [float("nan")])
        cv = _summary(cpu["vllm"].get(level) or [float("nan")])
        ratio = v["median"] / s["median"]
        print(
            f"| {level} | {_cell(s, '.0f')} | {_cell(v, '.0f')} | {ratio:.2f}x | "
            f"{_cell(cs, '.2f')} | {_cell(cv, '.2f')} |"
        )
        report["levels"][level] = {  # type: ignore[index]
            "serve_model_tok_s": s,
            "vllm_tok_s": v,
            "ratio": ratio,
            "serve_model_cpu_ms_per_token": cs,
            "vllm_cpu_ms_per_token": cv,
        }
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
