"""Environment throughput: groups/s of a trivial env against a 50 ms inference server.

Starts three real processes on loopback: the fake inference server with a fixed
latency, ``run-api``, and an environment whose rollout is one completion request
(``n = group_size``) per group. A trainer registers and starts the run but pulls
nothing, so the API's queue size counts every group the env delivered.

For each worker count it reports groups/s, the ideal ``workers / latency`` and the
ratio, and the env process's CPU time per group.

    python benchmarks/env_bench.py                       # 8, 32 and 64 workers
    python benchmarks/env_bench.py --workers 64 --seconds 20 --latency-ms 50
    python benchmarks/env_bench.py --server-type vllm    # token-level rollouts via /generate
    python benchmarks/env_bench.py --server-type none    # env runtime + API only
    python benchmarks/env_bench.py --fake-server uvicorn # the fake server under uvicorn
    python benchmarks/env_bench.py --workers 64 --original .venv-original --rounds 3

``--original DIR``: the same environment file run by the original atroposlib as well,
alternating with ours round by round against the same kind of fake server and our
``run-api``; ``DIR`` holds the original package, installed with

    .venv/bin/python -m pip install --no-deps --target .venv-original \
        atroposlib==0.4.0 pydantic-cli jsonlines

(its other dependencies are ours, from ``.venv``). Both envs load the same tokenizer, saved
to the log directory (the original loads one at start-up; no hub is asked).

The env's OpenAI-protocol and ``/generate`` requests go through the server layer's one
HTTP client (``server_handling/_transport.py``, an ``aiohttp`` session), its rollout-API
calls through ``httpx``'s interface over the same stack (``atroposlib/http/httpx_transport.py``).
CPU per group is also printed for the fake inference server and the API, to show
which process limits the rate on a small machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any, List, Tuple

ROOT = Path(__file__).resolve().parents[1]
# The env process of an --original run imports the original package instead of ours.
sys.path.insert(0, os.environ.get("ENV_BENCH_ORIGINAL") or str(ROOT))

from atroposlib.envs.base import BaseEnv, BaseEnvConfig, ScoredDataGroup  # noqa: E402
from atroposlib.envs.server_handling.server_baseline import APIServerConfig  # noqa: E402

SLEEP_MS = float(os.environ.get("ENV_BENCH_SLEEP_MS", "0"))


class BenchEnv(BaseEnv):
    """One completion request per group; sequences of 32 fake tokens."""

    name = "bench"

    @classmethod
    def config_init(cls) -> Tuple[BaseEnvConfig, APIServerConfig]:
        return (
            BaseEnvConfig(
                group_size=4,
                use_wandb=False,
                wandb_name="bench",
                total_steps=10**9,
                steps_per_eval=0,
                max_batches_offpolicy=0,
                tokenizer_name="none",
            ),
            APIServerConfig(
                model_name="fake",
                base_url="http://127.0.0.1:9001/v1",
                api_key="x",
                num_max_requests_at_once=4096,
            ),
        )

    async def setup(self) -> None:
        self.counter = 0

    async def get_next_item(self) -> int:
        self.counter += 1
        return self.counter

    async def collect_trajectories(self, item: int) -> Tuple[ScoredDataGroup | None, List[Any]]:
        n = self.config.group_size
        sleep_ms = SLEEP_MS
        if sleep_ms > 0:  # no inference call: measures the env runtime alone
            await asyncio.sleep(sleep_ms / 1000)
            bodies = [[97 + j] * 8 for j in range(n)]
        elif self.server.servers[0].config.server_type == "vllm":
            prompt = list(f"item {item}".encode())
            _, outputs, _, _ = await self.server.tokens_and_logprobs_completion(
                input_ids=prompt, n=n, max_tokens=8
            )
            bodies = [list(o)[:30] for o in outputs] or [[]]
        else:
            completion = await self.server.completion(prompt=f"item {item}", n=n, max_tokens=8)
            bodies = [list(c.text.encode()[:30]) for c in completion.choices] or [[]]
        tokens = [[item, j] + bodies[j % len(bodies)] for j in range(n)]
        masks = [[-100, -100] + t[2:] for t in tokens]
        return ScoredDataGroup(tokens=tokens, masks=masks, scores=[float(j) for j in range(n)]), []

    async def evaluate(self, *args: Any, **kwargs: Any) -> None:
        return None


def _measure(
    workers: int,
    latency_ms: int,
    seconds: float,
    warmup: float,
    log_dir: Path,
    server_type: str,
    fake_mode: str,
    profile: str | None = None,
    original: str | None = None,
) -> dict:
    import httpx
    import psutil

    from atroposlib.testing.launch import fake_server_cmd, run_api_cmd
    from atroposlib.testing.ports import free_port
    from atroposlib.testing.processes import start_process, stop_process, wait_http
    from atroposlib.testing.trainer import register_trainer

    api_port, infer_port = free_port(), free_port()
    procs = []
    try:
        fake = start_process(
            fake_server_cmd(
                infer_port,
                "--latency-ms",
                str(latency_ms),
                *(["--lean"] if fake_mode == "lean" else []),
            ),
            log_path=log_dir / "fake.log",
        )
        api = start_process(
            run_api_cmd(api_port, "--log-level", "warning"), log_path=log_dir / "api.log"
        )
        procs += [fake, api]
        wait_http(f"http://127.0.0.1:{infer_port}/health", proc=fake)
        wait_http(f"http://127.0.0.1:{api_port}/health", proc=api)
        api_url = f"http://127.0.0.1:{api_port}"
        register_trainer(api_url, batch_size=64)
        tokenizer_dir = _saved_tokenizer(log_dir)
        env = start_process(
            [
                sys.executable,
                str(Path(__file__).resolve()),
                "env",
                "serve",
                "--env.rollout_server_url",
                api_url,
                "--env.max_num_workers",
                str(workers),
                "--openai.base_url",
                f"http://127.0.0.1:{infer_port}/v1",
                "--openai.server_type",
                "openai" if server_type == "none" else server_type,
                "--env.tokenizer_name",
                tokenizer_dir,
                # The original starts no worker with 0 (ours reads 0 as "no bound"); the
                # trainer pulls nothing here, so the bound must be far above the run's groups.
                "--env.max_batches_offpolicy",
                "1000000",
            ],
            log_path=log_dir / ("env-original.log" if original else "env.log"),
            env={
                "ENV_BENCH_ORIGINAL": str(Path(original).resolve()) if original else "",
                "PYTHONPATH": os.pathsep.join(
                    p for p in (original and str(Path(original).resolve()), str(ROOT)) if p
                ),
                "ATROPOS_OUTBOX_DIR": str(log_dir / "outbox"),
                **({"ENV_BENCH_PROFILE": str(profile)} if profile else {}),
                "ENV_BENCH_SLEEP_MS": str(latency_ms) if server_type == "none" else "0",
            },
        )
        procs.append(env)

        def queued() -> int:
            return int(httpx.get(f"{api_url}/status", timeout=10).json()["queue_size"])

        deadline = time.monotonic() + 180  # start-up on a loaded machine
        while queued() == 0:
            if env.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("env did not start; see " + str(log_dir / "env.log"))
            time.sleep(0.2)
        time.sleep(warmup)
        watched = {
            "env": psutil.Process(env.pid),
            "infer": psutil.Process(fake.pid),
            "api": psutil.Process(api.pid),
        }

        def cpu() -> dict:
            return {k: sum(p.cpu_times()[:2]) for k, p in watched.items()}

        q0, c0, t0 = queued(), cpu(), time.monotonic()
        time.sleep(seconds)
        q1, c1, t1 = queued(), cpu(), time.monotonic()
        groups = q1 - q0
        rate = groups / (t1 - t0)
        ideal = workers / (latency_ms / 1000)
        per_group = {k: 1000 * (c1[k] - c0[k]) / max(1, groups) for k in watched}
        return {
            "side": "original" if original else "ours",
            "workers": workers,
            "groups": groups,
            "groups_per_s": rate,
            "ideal": ideal,
            "ratio": rate / ideal,
            "cpu_ms_per_group": per_group["env"],
            "infer_cpu_ms_per_group": per_group["infer"],
            "api_cpu_ms_per_group": per_group["api"],
        }
    finally:
        for proc in reversed(procs):
            stop_process(proc)


def _run_original(flags: List[str]) -> None:
    """Serve :class:`BenchEnv` on the original package: its ``env_manager`` loop, on the
    configuration ``config_init`` gives with ``flags`` (``--env.x v``, ``--openai.x v``) set.

    Not through the original's ``cli()``: under it, with the same flags, this env never
    started a worker in our runs (the configuration it printed was the same)."""
    env_config, server_config = BenchEnv.config_init()
    for flag, value in zip(flags[::2], flags[1::2], strict=True):
        scope, _, name = flag.removeprefix("--").partition(".")
        target = env_config if scope == "env" else server_config
        kind = type(getattr(target, name))
        setattr(target, name, kind(value) if kind in (int, float) else value)
    env = BenchEnv(config=env_config, server_configs=[server_config], slurm=False, testing=False)
    asyncio.run(env.env_manager())


def _saved_tokenizer(log_dir: Path) -> str:
    """A small byte-level tokenizer saved under ``log_dir`` (made once)."""
    path = log_dir / "tokenizer"
    if not (path / "tokenizer_config.json").exists():
        from atroposlib.testing.tokenizers import bytes_tokenizer

        bytes_tokenizer().save_pretrained(str(path))
    return str(path)


def _median(values: List[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def main(argv: List[str] | None = None) -> None:
    """Run the benchmark and print one line per worker count."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["env"] and os.environ.get("ENV_BENCH_ORIGINAL"):
        _run_original(argv[2:])
        return
    if argv[:1] == ["env"]:
        sys.argv = [sys.argv[0], *argv[1:]]
        profile_path = os.environ.get("ENV_BENCH_PROFILE")
        if not profile_path:
            BenchEnv.cli()
            return
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
        try:
            BenchEnv.cli()
        finally:
            profiler.disable()
            profiler.dump_stats(profile_path)
        return
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--latency-ms", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--log-dir", default="/tmp/atropos-env-bench")
    parser.add_argument(
        "--server-type",
        choices=["openai", "vllm", "none"],
        default="openai",
        help="openai: completion() through the OpenAI client; "
        "vllm: tokens_and_logprobs_completion() through /generate; "
        "none: no inference call, the rollout just sleeps the latency "
        "(measures the env runtime and API path alone)",
    )
    parser.add_argument(
        "--fake-server",
        choices=["lean", "uvicorn"],
        default="lean",
        help="lean: the fake server on its minimal asyncio HTTP server (so the stand-in "
        "is not the bottleneck); uvicorn: the same app under uvicorn",
    )
    parser.add_argument(
        "--profile",
        default=None,
        help="write a cProfile of the env process to PATH.<workers> (pstats format)",
    )
    parser.add_argument(
        "--original",
        default=None,
        metavar="DIR",
        help="also run the env on the original atroposlib found in DIR (see above), "
        "alternating with ours",
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="measurements per worker count (and side)"
    )
    args = parser.parse_args(argv)
    if args.original and not (Path(args.original) / "atroposlib" / "envs" / "base.py").exists():
        parser.error(f"--original {args.original}: no atroposlib package there (see --help)")
    os.environ.setdefault("WANDB_MODE", "disabled")
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    print(
        f"load: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f} on {os.cpu_count()} cores"
    )
    print(
        f"server type: {args.server_type}, fake server: {args.fake_server}, latency {args.latency_ms} ms"
    )
    print(
        f"{'side':>8} {'workers':>8} {'groups/s':>10} {'ideal':>8} {'ratio':>7} "
        f"{'env CPU ms/group':>17} {'infer CPU ms/grp':>17} {'api CPU ms/grp':>15}"
    )
    sides = [None, args.original] if args.original else [None]
    for workers in args.workers:
        results: dict[str, List[dict]] = {}
        for _ in range(args.rounds):
            for original in sides:
                r = _measure(
                    workers,
                    args.latency_ms,
                    args.seconds,
                    args.warmup,
                    log_dir,
                    args.server_type,
                    args.fake_server,
                    f"{args.profile}.{workers}" if args.profile else None,
                    original,
                )
                results.setdefault(r["side"], []).append(r)
                print(
                    f"{r['side']:>8} {r['workers']:>8} {r['groups_per_s']:>10.1f} "
                    f"{r['ideal']:>8.1f} {r['ratio']:>7.1%} {r['cpu_ms_per_group']:>17.2f} "
                    f"{r['infer_cpu_ms_per_group']:>17.2f} {r['api_cpu_ms_per_group']:>15.2f}",
                    flush=True,
                )
        for side, runs in results.items():
            ratios = [r["ratio"] for r in runs]
            cpus = [r["cpu_ms_per_group"] for r in runs]
            print(
                f"{side}, {workers} workers, {len(runs)} runs: ratio {_median(ratios):.1%} "
                f"({min(ratios):.1%}-{max(ratios):.1%}), env CPU {_median(cpus):.2f} "
                f"({min(cpus):.2f}-{max(cpus):.2f}) ms/group"
            )
        if "original" in results:
            ours = _median([r["cpu_ms_per_group"] for r in results["ours"]])
            theirs = _median([r["cpu_ms_per_group"] for r in results["original"]])
            print(f"env CPU per group, ours / original: {ours / theirs:.2f}x", flush=True)
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
