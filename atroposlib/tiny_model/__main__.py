"""``atropos-tiny-model``: build the offline tiny model into a directory."""

from __future__ import annotations

import argparse

from atroposlib.tiny_model.build import DEFAULT_SIZE, build_tiny_model, ensure_tiny_model


def main(argv: list[str] | None = None) -> None:
    """Build a tiny model into ``OUT_DIR`` (or ``--out DIR``); without one, print the cached default.

    Both spellings are accepted because the README and older scripts use the positional
    form while ``--out`` is what the tests and the Makefile pass.
    """
    parser = argparse.ArgumentParser(
        prog="atropos-tiny-model",
        description="Build a tiny random-init causal LM with the shipped tokenizer (offline).",
    )
    parser.add_argument(
        "out_dir",
        nargs="?",
        default=None,
        metavar="OUT_DIR",
        help="Output directory (same as --out). Default: the cached default model.",
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
    if args.out_dir is not None and args.out is not None and args.out_dir != args.out:
        parser.error(f"two output directories given: {args.out_dir!r} and --out {args.out!r}")
    if args.out is None:
        args.out = args.out_dir
    size = {k: getattr(args, k) for k in DEFAULT_SIZE if getattr(args, k) is not None}
    if args.out is None and args.arch == "qwen2" and not size:
        path = ensure_tiny_model(seed=args.seed)
    elif args.out is None:
        parser.error("OUT_DIR (or --out) is required with a non-default --arch or size")
    else:
        path = build_tiny_model(args.out, seed=args.seed, arch=args.arch, **size)
    print(path)


if __name__ == "__main__":
    main()
