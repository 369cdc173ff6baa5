"""Throughput of ``atropos-serve-model`` at 1 and 16 concurrent chat requests.

Starts the server on the offline tiny model (CPU by default) on a free loopback
port, sends chat completions of exactly ``--new-tokens`` tokens each
(``ignore_eos``) through the OpenAI client, and prints generated tokens per
second per concurrency level and the speed-up of the highest level over 1::

    python benchmarks/serve_model_bench.py
    python benchmarks/serve_model_bench.py --concurrency 1 4 16 64 --device cuda
    python benchmarks/serve_model_bench.py --url http://127.0.0.1:9001/v1 --model NAME
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

QUESTION = "Alice has 3 apples. Bob gives her 4 more. How many apples does Alice have now?"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(url: str, proc: subprocess.Popen, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(url)


async def _run_level(
    client: openai.AsyncOpenAI, model: str, concurrency: int, rounds: int, new_tokens: int
) -> tuple[int, float]:
    async def one(i: int) -> int:
        r = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"{QUESTION} ({i})"}],
            max_tokens=new_tokens,
            temperature=1.0,
            extra_body={"ignore_eos": True},
        )
        return r.usage.completion_tokens

    start = time.perf_counter()
    tokens = 0
    for r in range(rounds):
        tokens += sum(await asyncio.gather(*(one(r * concurrency + i) for i in range(concurrency))))
    return tokens, time.perf_counter() - start


async def _bench(url: str, model: str, levels: list[int], rounds: int, new_tokens: int) -> None:
    async with openai.AsyncOpenAI(
        base_url=url, api_key="bench", timeout=600, max_retries=0
    ) as client:
        await _run_level(client, model, 2, 1, 8)  # warm-up
        rates = {}
        for level in levels:
            tokens, secs = await _run_level(client, model, level, rounds, new_tokens)
            rates[level] = tokens / secs
            print(
                f"concurrency {level:>3}: {tokens:>6} tokens in {secs:7.2f} s = "
                f"{rates[level]:8.1f} tokens/s"
            )
        for level in levels:
            if 1 in rates and level != 1:
                target = " (target >= 4x)" if level == 16 else ""
                print(f"speed-up {level} vs 1: {rates[level] / rates[1]:.2f}x{target}")


def main() -> None:
    """Parse flags, start (or reuse) a server and print the figures."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default=None, help="Existing server's /v1 URL (else start one).")
    p.add_argument("--model", default=None, help="Model dir or name (default: tiny model).")
    p.add_argument("--device", default="cpu", help="Device for a started server.")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--rounds", type=int, default=3, help="Batches per concurrency level.")
    p.add_argument("--new-tokens", type=int, default=64)
    args = p.parse_args()

    proc = None
    model = args.model
    url = args.url
    if url is None:
        if model is None:
            from atroposlib.tiny_model import ensure_tiny_model

            model = ensure_tiny_model()
        port = _free_port()
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "atroposlib.cli.serve_model",
                model,
                "--port",
                str(port),
                "--device",
                args.device,
                "--log-level",
                "warning",
            ],
            cwd=ROOT,
            start_new_session=True,
        )
        url = f"http://127.0.0.1:{port}/v1"
    try:
        if proc is not None:
            _wait(url[: -len("/v1")] + "/health", proc)
        if model is None:
            model = httpx.get(f"{url}/models", timeout=10).json()["data"][0]["id"]
        print(
            f"model {model} at {url}, {args.new_tokens} new tokens per request, "
            f"{args.rounds} rounds per level"
        )
        asyncio.run(_bench(url, model, args.concurrency, args.rounds, args.new_tokens))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)


if __name__ == "__main__":
    main()
