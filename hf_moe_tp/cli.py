"""The ``hf-moe-tp`` command."""

from __future__ import annotations

import argparse
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hf-moe-tp`` console script."""
    parser = argparse.ArgumentParser(
        prog="hf-moe-tp",
        description="Run Hugging Face Mixture-of-Experts models tensor-parallel on PyTorch DTensors.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = commands.add_parser(
        "demo",
        help="shard a built-in Mixtral MoE layer over local ranks and check it against one process",
        description="Start --tp local ranks (gloo, CPU), shard a built-in Mixtral MoE layer over them, run "
        "forward and backward, and compare with transformers' unsharded layer. Needs no download.",
    )
    demo.add_argument("--tp", type=int, default=2, help="number of local ranks (default 2)")
    demo.add_argument("--tokens", type=int, default=512, help="tokens in the batch (default 512)")
    args = parser.parse_args(argv)

    if args.command == "demo":
        from .demo import run_demo

        run_demo(tp=args.tp, tokens=args.tokens)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
