"""`hf-backend`: the command line (config, launch, env, checkpoint, plan)."""

from __future__ import annotations

import argparse
import sys

import hf_backend

from ..core.errors import HfBackendError
from . import checkpoint_cmd, config_cmd, env_cmd, launch, plan_cmd
from .worker import end_without_final_collection


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-backend", description="hf_backend command line")
    parser.add_argument("--version", action="version", version=f"hf-backend {hf_backend.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    config_cmd.add_parser(sub)
    launch.add_parser(sub)
    env_cmd.add_parser(sub)
    checkpoint_cmd.add_parser(sub)
    plan_cmd.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    end_without_final_collection()
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return args.func(args)
    except HfBackendError as err:
        print(f"hf-backend {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
