"""``atropos-tiny-model``: build the offline tiny model into a directory."""

from __future__ import annotations

import argparse

from atroposlib.tiny_model.build import DEFAULT_SIZE, build_tiny_model, ensure_tiny_model


def main(argv: list[str] | None = None) -> None:
    """Build a tiny model (``--out DIR``) or print the path of the cached default one."""
    parser = argparse.ArgumentParser(
        prog="atropos-tiny-model",
        description="Build a tiny random-init causal LM with the shipped tokenizer (offline).",
    )
    parser.add_argument(
        "--out", default=None, help="Output directory. Default: the cached default model."
    )
    parser.add_argument("--seed", type=int, default=0, help="Seed of the random weights.")
    parser.add_argument(
        "--arch",
        choices=["qwen2", "llama"],
        default="qwen2",
        help="Model architecture of the config.",
    )
    for name, value in DEFAULT_SIZE.items():
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            type=int,
            default=None,
            help=f"Model size field (default {value}).",
        )
    args = parser.parse_args(argv)
    size = {k: getattr(args, k) for k in DEFAULT_SIZE if getattr(args, k) is not None}
    if args.out is None and args.arch == "qwen2" and not size:
        path = ensure_tiny_model(seed=args.seed)
    elif args.out is None:
        parser.error("--out is required with a non-default --arch or size")
    else:
        path = build_tiny_model(args.out, seed=args.seed, arch=args.arch, **size)
    print(path)


if __name__ == "__main__":
    main()
