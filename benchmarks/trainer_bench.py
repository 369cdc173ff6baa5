"""Trainer benchmarks: step throughput vs bare HF, and weight-sync time per mode.

1. Tokens/s of ``GRPOTrainer.train_on_batch`` (data prep + GRPO loss + clipping +
   AdamW step) versus a bare HF forward + backward + AdamW step on the same padded
   batch, both under the trainer's precision policy (bf16-mixed on CUDA, fp32 on the
   CPU unless ``--precision`` says otherwise). The two alternate, so background load
   hits both alike; the ratio is reported per pair (median and range).
   Targets: >= 0.9x on a GPU, >= 0.95x on the CPU.
2. Time of one weight sync with ``http_reload`` (save + ``POST /update_weights``
   to a running ``atropos-serve-model``) versus ``none`` (save + restart the
   server and wait for health).

Usage::

    python benchmarks/trainer_bench.py [--hidden 256 --layers 4 --seqs 64 --len 256 --repeats 5]
    python benchmarks/trainer_bench.py --device cuda      # on a GPU box (bf16-mixed)
    python benchmarks/trainer_bench.py --device cuda --hidden 896 --layers 24 --len 512 --skip-sync
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from example_trainer.config import TrainingConfig
from example_trainer.data import pad_data_to_good_offset
from example_trainer.trainers import GRPOTrainer

ROOT = Path(__file__).resolve().parents[1]


def synthetic_batch(
    n_seqs: int, length: int, vocab: int, group_size: int = 8, seed: int = 0
) -> list:
    """Groups of random token sequences with a 25% prompt and random scores."""
    rng = random.Random(seed)
    groups = []
    for _ in range(n_seqs // group_size):
        tokens, masks, scores, lps = [], [], [], []
        prompt = [rng.randrange(3, vocab) for _ in range(length // 4)]
        for _ in range(group_size):
            comp = [rng.randrange(3, vocab) for _ in range(length - len(prompt))]
            tokens.append(prompt + comp)
            masks.append([-100] * len(prompt) + comp)
            scores.append(rng.random())
            lps.append([1.0] * len(prompt) + [-rng.uniform(0.5, 5) for _ in comp])
        groups.append(
            {"tokens": tokens, "masks": masks, "scores": scores, "inference_logprobs": lps}
        )
    return groups


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def bench_step(model_dir: str, args: argparse.Namespace) -> None:
    cfg = TrainingConfig(
        model_name=model_dir,
        device=args.device,
        optimizer="adamw",
        lr=1e-5,
        batch_size=args.micro,
        gradient_accumulation_steps=max(1, args.seqs // args.micro),
        save_path=tempfile.mkdtemp(),
        progress=False,
        pad_to_multiple=64,
        precision=args.precision,
    )
    trainer = GRPOTrainer(cfg)
    policy = trainer.policy
    vocab = trainer.model.config.vocab_size
    batch = synthetic_batch(args.seqs, args.len, vocab)
    micro = pad_data_to_good_offset(
        batch, cfg.batch_size, trainer.pad_id, cfg.pad_to_multiple, cfg.seq_len
    )
    n_tokens = sum(int(mb.attention_mask.sum()) for mb in micro)

    bare_model = trainer.model  # same weights and layout; separate optimizer
    bare_opt = torch.optim.AdamW([p for p in bare_model.parameters() if p.requires_grad], lr=1e-5)

    def bare_step() -> None:
        for mb in micro:
            labels = mb.labels.to(args.device)
            with policy.autocast():
                out = bare_model(
                    input_ids=mb.input_ids.to(args.device),
                    attention_mask=mb.attention_mask.to(args.device),
                    use_cache=False,
                )
            logits = out.logits.float()
            loss = torch.nn.functional.cross_entropy(
                logits.view(-1, logits.size(-1)), labels.view(-1), ignore_index=-100
            )
            (loss / len(micro)).backward()
        bare_opt.step()
        bare_opt.zero_grad(set_to_none=True)

    def trainer_step() -> None:
        trainer.train_on_batch(batch)

    # Interleave the two so that background load hits both alike.
    bare_step()
    trainer_step()
    times: dict = {"bare_hf": [], "trainer": []}
    for _ in range(args.repeats):
        for name, fn in (("bare_hf", bare_step), ("trainer", trainer_step)):
            _sync(args.device)
            t = time.perf_counter()
            fn()
            _sync(args.device)
            times[name].append(time.perf_counter() - t)
    ratios = sorted(b / t for b, t in zip(times["bare_hf"], times["trainer"], strict=True))
    med = {name: n_tokens / statistics.median(ts) for name, ts in times.items()}
    ratio = statistics.median(ratios)
    target = 0.9 if args.device.startswith("cuda") else 0.95
    print(
        f"step throughput ({args.seqs} seqs x {args.len} tokens, micro {args.micro}, "
        f"{args.device}, {policy.name}, {args.repeats} alternating pairs):"
    )
    print(f"  bare HF fwd+bwd+AdamW : {med['bare_hf']:10.0f} tokens/s (median)")
    print(f"  GRPO trainer step     : {med['trainer']:10.0f} tokens/s (median)")
    print(
        f"  trainer / bare        : {ratio:.3f}x median, range {ratios[0]:.3f}-{ratios[-1]:.3f}x "
        f"(target >= {target}x)"
    )


def bench_sync(model_dir: str, args: argparse.Namespace) -> None:
    from atroposlib.testing.launch import serve_model_cmd
    from atroposlib.testing.ports import free_port
    from atroposlib.testing.processes import running_process
    from example_trainer.weight_sync import HttpReloadSync, RestartSync

    port = free_port()
    base = dict(
        model_name=model_dir,
        device="cpu",
        save_path=tempfile.mkdtemp(),
        progress=False,
        vllm_port=port,
        inference_url=f"http://127.0.0.1:{port}",
        inference_backend="serve_model",
    )
    trainer = GRPOTrainer(TrainingConfig(**base, weight_bridge_mode="http_reload"))
    cmd = serve_model_cmd(
        model_dir,
        port,
        "--log-level",
        "warning",
        "--weights-root",  # /update_weights loads only from allowed directories
        base["save_path"],
    )
    with running_process(cmd, health_url=f"http://127.0.0.1:{port}/health", timeout=180):
        sync = HttpReloadSync(trainer.config, trainer.model, trainer.tokenizer)
        sync.start()
        reload_times = [sync.sync(i + 1) for i in range(args.repeats)]
    restart = RestartSync(
        TrainingConfig(**base, weight_bridge_mode="none"), trainer.model, trainer.tokenizer
    )
    try:
        restart.start()
        restart_times = [restart.sync(i + 1) for i in range(max(2, args.repeats // 2))]
    finally:
        restart.close()
    r, n = statistics.median(reload_times), statistics.median(restart_times)
    print(f"weight sync ({sum(p.numel() for p in trainer.model.parameters()) / 1e6:.2f}M params):")
    print(f"  http_reload (save + POST /update_weights): {r * 1000:8.0f} ms median")
    print(
        f"  none (save + restart atropos-serve-model): {n * 1000:8.0f} ms median  ({n / r:.0f}x slower)"
    )


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seqs", type=int, default=32)
    p.add_argument("--len", type=int, default=256)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--precision",
        default="auto",
        choices=["auto", "fp32", "bf16-mixed", "fp16-mixed", "bf16-pure"],
        help="Trainer precision policy (auto: bf16-mixed on CUDA, fp32 on the CPU).",
    )
    p.add_argument("--skip-sync", action="store_true")
    args = p.parse_args()
    torch.manual_seed(0)
    from atroposlib.tiny_model import build_tiny_model, ensure_tiny_model

    model_dir = str(ROOT / ".cache" / f"bench-model-{args.hidden}x{args.layers}")
    if not (Path(model_dir) / "config.json").exists():
        build_tiny_model(
            model_dir,
            seed=0,
            hidden_size=args.hidden,
            intermediate_size=4 * args.hidden,
            num_hidden_layers=args.layers,
            num_attention_heads=max(4, args.hidden // 64),
            num_key_value_heads=max(2, args.hidden // 128),
        )
    bench_step(model_dir, args)
    if not args.skip_sync:
        bench_sync(ensure_tiny_model(), args)


if __name__ == "__main__":
    main()
