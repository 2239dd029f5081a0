"""`hf-backend checkpoint`: inspect a checkpoint, consolidate its weights for `from_pretrained`,
convert its form.

    hf-backend checkpoint inspect DIR [--json]
    hf-backend checkpoint consolidate DIR OUT [--config CONFIG] [--max-shard-size 5GB] [--base BASE_MODEL]
    hf-backend checkpoint convert DIR OUT --to full|sharded

Everything runs in this one process, without a process group, and reads no file in a way that could
run code from it (hf_backend.checkpoint.safe_load).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..core.errors import HfBackendError


def add_parser(sub: Any) -> None:
    p = sub.add_parser("checkpoint", help="inspect, consolidate or convert a checkpoint directory")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    inspect = actions.add_parser("inspect", help="what a checkpoint holds, who wrote it, whether it verifies "
                                                 "(exit 0 only when it does)")
    inspect.add_argument("directory", help="a save_state checkpoint or a Trainer's checkpoint-N directory")
    inspect.add_argument("--json", action="store_true", help="one JSON object instead of lines")
    inspect.set_defaults(func=run_inspect)
    cons = actions.add_parser("consolidate", help="the model's full weights as a safetensors directory that "
                                                  "from_pretrained loads")
    cons.add_argument("directory", help="the checkpoint (DCP shards, full weights, or DeepSpeed's own files)")
    cons.add_argument("out", help="a new directory for model.safetensors (or its shards and index) and config.json")
    cons.add_argument("--config", default=None, help="the model's config.json (or a directory holding it); "
                                                     "default: the checkpoint's own, when it has one")
    cons.add_argument("--max-shard-size", default="5GB", help="split the weights into files of at most this size, "
                                                              "with an index (default 5GB)")
    cons.add_argument("--base", default=None, help="for a PEFT adapter's checkpoint: the base model's directory to "
                                                   "merge it into (default: the adapter's base_model_name_or_path)")
    cons.add_argument("--json", action="store_true", help="one JSON object instead of lines")
    cons.set_defaults(func=run_consolidate)
    conv = actions.add_parser("convert", help="a save_state checkpoint with its models and optimizers as full files "
                                              "or as DCP shards")
    conv.add_argument("directory", help="a save_state checkpoint")
    conv.add_argument("out", help="a new directory for the converted checkpoint")
    conv.add_argument("--to", required=True, choices=("full", "sharded"),
                      help="full: model.safetensors + optimizer.bin; "
                           "sharded: model_dcp/ + optimizer_dcp/")
    conv.add_argument("--json", action="store_true", help="one JSON object instead of lines")
    conv.set_defaults(func=run_convert)


def run_inspect(args: argparse.Namespace) -> int:
    from ..checkpoint.inspect import describe, inspect_checkpoint

    report = inspect_checkpoint(args.directory)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0 if report["verified"] else 1
    if not report["verified"]:
        raise HfBackendError(f"inspect: {report['problem']}")
    print("\n".join(describe(report)))
    return 0


def _size(text: str) -> int | str:
    return int(text) if text.isdigit() else text


def run_consolidate(args: argparse.Namespace) -> int:
    from ..checkpoint.consolidate import consolidate

    done = consolidate(args.directory, args.out, max_shard_size=_size(args.max_shard_size), config=args.config,
                       base=args.base)
    if args.json:
        print(json.dumps(done, indent=2))
        return 0
    merged = f" (adapter {done['merged_adapter']} merged into {done['base']})" if "merged_adapter" in done else ""
    print(f"wrote {done['out']}{merged}: {done['tensors']} tensors, {done['parameters']:,} "
          f"parameters in {', '.join(done['files'])}")
    if done["config"] is None:
        print("no config.json (the checkpoint has none and --config was not given): only the "
              "weights were written; from_pretrained needs the model's config.json beside them")
    return 0


def run_convert(args: argparse.Namespace) -> int:
    from ..checkpoint.consolidate import convert

    done = convert(args.directory, args.out, args.to)
    if args.json:
        print(json.dumps(done, indent=2))
        return 0
    print(f"wrote {done['out']} ({done['form']}, {len(done['files'])} files, with a new manifest)")
    return 0
