"""Throughput of ``atropos-serve-model`` next to transformers ``generate`` (static cache).

Starts the server on a model (the offline tiny model by default) on a free loopback
port, sends chat completions of exactly ``--new-tokens`` tokens each (``ignore_eos``)
through the OpenAI client at each concurrency level, then stops it and runs
transformers ``generate`` with ``cache_implementation="static"`` on the same model,
device and dtype over the same prompts (one batch of ``concurrency`` rows), and
prints generated tokens per second for both, with the server process's CPU time per
generated token (user + system, all threads, from ``/proc/PID/stat`` read before and after
each level's timed rounds)::

    python benchmarks/serve_model_bench.py
    python benchmarks/serve_model_bench.py --device cuda --model DIR --concurrency 1 16 64
    python benchmarks/serve_model_bench.py --build-qwen2-0.5b /tmp/qwen-0.5b --device cuda \\
        --concurrency 1 16 64 --new-tokens 128
    python benchmarks/serve_model_bench.py --baseline-root /tmp/old-checkout   # A/B two trees

``--build-qwen2-0.5b DIR`` writes a randomly initialised Qwen2 of Qwen2.5-0.5B's
shape (494M parameters, from a ``Qwen2Config``; nothing is downloaded) with the
tiny model's tokenizer into DIR and benchmarks it. ``--baseline-root`` also runs
the server from another source tree (e.g. a ``git worktree`` of an older commit),
alternating with this one level by level, so both see the same machine load.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

from atroposlib.testing.launch import serve_model_cmd
from atroposlib.testing.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

QUESTION = "Alice has 3 apples. Bob gives her 4 more. How many apples does Alice have now?"


def _wait(url: str, proc: subprocess.Popen, timeout: float = 600.0) -> None:
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


def build_qwen2_05b(out: Path) -> Path:
    """Save a random-init Qwen2 of Qwen2.5-0.5B's shape with the tiny tokenizer to ``out``."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from atroposlib.tiny_model import ensure_tiny_model

    if (out / "config.json").exists():
        return out
    config = Qwen2Config(
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        vocab_size=151936,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        rope_theta=1_000_000.0,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    tok = AutoTokenizer.from_pretrained(ensure_tiny_model())
    model.config.eos_token_id = tok.eos_token_id
    model.config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _messages(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{QUESTION} ({i})"}]


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of ``pid``, its reaped children and its live descendants.

    Read from ``/proc`` so the figure covers every thread of the server (torch's pools
    included); ``None`` where ``/proc`` is not there (not Linux).
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name may hold spaces or parentheses: the fields start after the last ")"
    fields = stat.rsplit(")", 1)[1].split()
    total = sum(int(f) for f in fields[11:15]) / _TICK  # utime, stime, cutime, cstime
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            children = task.read_text().split()
        except OSError:
            continue
        total += sum(process_cpu_seconds(int(c)) or 0.0 for c in children)
    return total


class Server:
    """``atropos-serve-model`` started from a source tree, on a free port."""

    def __init__(self, root: Path, model: str, device: str, extra: list[str]) -> None:
        self.port = free_port()
        env = dict(os.environ, PYTHONPATH=str(root))
        self.proc = subprocess.Popen(
            serve_model_cmd(model, self.port, "--device", device, "--log-level", "warning", *extra),
            cwd=root,
            env=env,
            start_new_session=True,
        )
        self.url = f"http://127.0.0.1:{self.port}/v1"

    def wait(self) -> None:
        _wait(self.url[: -len("/v1")] + "/health", self.proc)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


async def _http_level(
    url: str, model: str, concurrency: int, rounds: int, new: int, pid: int | None = None
) -> tuple[float, float | None]:
    """tokens/s of ``rounds`` batches of ``concurrency`` chats, and the CPU ms per token.

    The CPU figure is ``pid``'s CPU over the timed rounds (the warm-up is left out) divided
    by the tokens they generated; ``None`` without a ``pid`` or without ``/proc``.
    """
    async with openai.AsyncOpenAI(
        base_url=url, api_key="bench", timeout=1800, max_retries=0
    ) as client:

        async def one(i: int) -> int:
            r = await client.chat.completions.create(
                model=model,
                messages=_messages(i),
                max_tokens=new,
                temperature=1.0,
                extra_body={"ignore_eos": True},
            )
            return r.usage.completion_tokens

        await asyncio.gather(*(one(i) for i in range(min(concurrency, 4))))  # warm-up
        cpu0 = process_cpu_seconds(pid) if pid is not None else None
        start = time.perf_counter()
        tokens = 0
        for r in range(rounds):
            tokens += sum(
                await asyncio.gather(*(one(r * concurrency + i) for i in range(concurrency)))
            )
        rate = tokens / (time.perf_counter() - start)
        cpu1 = process_cpu_seconds(pid) if pid is not None else None
        if cpu0 is None or cpu1 is None or not tokens:
            return rate, None
        return rate, 1e3 * (cpu1 - cpu0) / tokens


def _generate(model, batch, pad_id: int, tokens: int) -> None:  # type: ignore[no-untyped-def]
    import torch

    with torch.inference_mode():
        model.generate(
            **batch,
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            cache_implementation="static",
            pad_token_id=pad_id,
        )
    if model.device.type == "cuda":
        torch.cuda.synchronize()


def generate_static(
    model_dir: str, device: str, dtype: str, levels: list[int], rounds: int, new: int
) -> dict[int, float]:
    """tokens/s of ``model.generate`` with a static cache, one batch per level."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from atroposlib.serving.loader import resolve_device, resolve_dtype

    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).to(dev).eval()
    if dev.type == "cpu":
        small = sum(p.numel() for p in model.parameters()) < 100_000_000
        torch.set_num_threads(1 if small else torch.get_num_threads())
    rates = {}
    for level in levels:
        texts = [
            tok.apply_chat_template(_messages(i), add_generation_prompt=True, tokenize=False)
            for i in range(level)
        ]
        batch = tok(texts, return_tensors="pt", padding=True).to(dev)
        _generate(model, batch, tok.pad_token_id, min(new, 8))  # warm-up (allocations)
        start = time.perf_counter()
        for _ in range(rounds):
            _generate(model, batch, tok.pad_token_id, new)
        rates[level] = level * new * rounds / (time.perf_counter() - start)
    return rates


def main() -> None:
    """Parse flags, run both benchmarks and print the figures."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="Model directory (default: the tiny model).")
    p.add_argument("--build-qwen2-0.5b", dest="build", default=None, metavar="DIR",
                   help="Build a random-init Qwen2.5-0.5B-shaped model in DIR and use it.")  # fmt: skip
    p.add_argument("--device", default="cpu", help="cpu or cuda.")
    p.add_argument("--dtype", default="auto", help="Weight dtype (auto: fp32 CPU, bf16 CUDA).")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--rounds", type=int, default=3, help="Batches per concurrency level.")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=2048, help="Server context length.")
    p.add_argument("--baseline-root", default=None, help="Another source tree to A/B against.")
    p.add_argument("--repeats", type=int, default=1, help="Times to run each level (median).")
    p.add_argument("--no-generate", action="store_true", help="Skip the transformers figure.")
    args = p.parse_args()

    from atroposlib.tiny_model import ensure_tiny_model

    model = args.model or ensure_tiny_model()
    if args.build:
        model = str(build_qwen2_05b(Path(args.build)))
    extra = ["--max-model-len", str(args.max_model_len), "--dtype", args.dtype]
    trees = {"atropos-serve-model": ROOT}
    if args.baseline_root:
        trees["baseline"] = Path(args.baseline_root).resolve()
    print(
        f"model {model}, device {args.device}, {args.new_tokens} new tokens per request, "
        f"{args.rounds} rounds per level, {args.repeats} repeat(s)"
    )
    rates: dict[str, dict[int, list[float]]] = {name: {} for name in trees}
    cpu_ms: dict[str, dict[int, list[float]]] = {name: {} for name in trees}
    servers = {name: Server(root, model, args.device, extra) for name, root in trees.items()}
    try:
        for server in servers.values():
            server.wait()
        for level in args.concurrency:
            for _ in range(args.repeats):
                for name, server in servers.items():
                    rate, ms = asyncio.run(
                        _http_level(
                            server.url,
                            model,
                            level,
                            args.rounds,
                            args.new_tokens,
                            pid=server.proc.pid,
                        )
                    )
                    rates[name].setdefault(level, []).append(rate)
                    if ms is not None:
                        cpu_ms[name].setdefault(level, []).append(ms)
    finally:
        for server in servers.values():
            server.close()
    static: dict[int, float] = {}
    if not args.no_generate:
        static = generate_static(
            model, args.device, args.dtype, args.concurrency, args.rounds, args.new_tokens
        )
    for level in args.concurrency:
        cells = []
        for name in trees:
            runs = rates[name][level]
            spread = f" ({min(runs):.0f}-{max(runs):.0f})" if len(runs) > 1 else ""
            cells.append(f"{name} {statistics.median(runs):8.1f}{spread}")
        if static:
            ours = statistics.median(rates["atropos-serve-model"][level])
            cells.append(f"generate(static cache) {static[level]:8.1f}")
            cells.append(f"ratio {ours / static[level]:.2f}x")
        print(f"concurrency {level:>3}: " + " | ".join(cells) + "  tokens/s")
        cpu_cells = []
        for name in trees:
            runs = cpu_ms[name].get(level, [])
            if runs:
                spread = f" ({min(runs):.2f}-{max(runs):.2f})" if len(runs) > 1 else ""
                cpu_cells.append(f"{name} {statistics.median(runs):.3f}{spread}")
        if cpu_cells:
            print(
                f"concurrency {level:>3}: server CPU per generated token: "
                + " | ".join(cpu_cells)
                + "  ms"
            )
    medians = {name: {lv: statistics.median(v) for lv, v in rates[name].items()} for name in trees}
    ours = medians["atropos-serve-model"]
    if 1 in ours:
        for level in args.concurrency:
            if level != 1:
                line = f"speed-up {level} vs 1: {ours[level] / ours[1]:.2f}x"
                if "baseline" in medians:
                    base = medians["baseline"]
                    line += f" (baseline {base[level] / base[1]:.2f}x)"
                print(line)
    if shutil.which("nvidia-smi") and args.device == "cuda":
        subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv"])


if __name__ == "__main__":
    main()
