"""`hf-backend`: the command line. Subcommands (config, launch, env) register here."""

from __future__ import annotations

import argparse
import sys

import hf_backend


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-backend", description="hf_backend command line")
    parser.add_argument("--version", action="version", version=f"hf-backend {hf_backend.__version__}")
    parser.add_subparsers(dest="command", metavar="COMMAND")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
