"""`hf-backend launch`: start a script on N processes (and M machines) through torch elastic
(`torch.distributed.run`).

The effective config is built once, in this order of precedence (highest first): command-line flags,
HF_BACKEND_* variables already in the environment, the config file, built-in defaults. It reaches
every process as HF_BACKEND_* variables, which `Accelerator()` reads (an explicit `Accelerator(...)`
argument in the script wins over them).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from typing import Any

from ..config import environment as env
from ..config.loader import default_config_path, read_mapping, validate
from ..config.schema import (
    DeepSpeedSection,
    FaultToleranceSection,
    FsdpSection,
    LaunchConfig,
    ParallelismSection,
    fields_of,
)
from ..core.errors import ConfigError
from ..launch import hang_watch
from ..launch.worker_failures import describe_failure

_TOP_FLAGS = ("num_processes", "num_machines", "machine_rank", "main_process_ip", "main_process_port",
              "rdzv_backend", "mixed_precision", "gradient_accumulation_steps", "distributed_type", "gpu_ids",
              "dynamo_backend")
_ENV_KEYS = {"mixed_precision": env.MIXED_PRECISION, "gradient_accumulation_steps": env.GRADIENT_ACCUMULATION_STEPS,
             "use_cpu": env.USE_CPU, "dynamo_backend": env.DYNAMO_BACKEND}


def add_parser(sub: Any) -> None:
    p = sub.add_parser("launch", help="run a training script on several processes or machines",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                       # else the script's own --deepspeed reads as an abbreviated launch flag
                       allow_abbrev=False)
    p.add_argument("--config_file", help="config file (default: the one `hf-backend config` wrote, if any)")
    top = fields_of(LaunchConfig)
    for name in _TOP_FLAGS:
        meta = top[name].metadata
        p.add_argument(f"--{name}", default=None, help=meta["help"],
                       choices=meta["choices"] if name != "num_processes" else None)
    p.add_argument("--cpu", action="store_true", default=None, help="train on the CPU (gloo) even with GPUs")
    p.add_argument("--max_restarts", type=int, default=None,
                   help="restart the workers this many times after a failure (default 0; 3 with --fault_tolerance)")
    p.add_argument("--nnodes", default=None, metavar="MIN:MAX",
                   help="an elastic job of MIN to MAX machines (c10d rendezvous; --num_processes "
                        "counts MAX machines)")
    p.add_argument("--rdzv_conf", default=None, metavar="K=V,...",
                   help="rendezvous options (c10d: join_timeout, last_call_timeout, close_timeout)")
    p.add_argument("--monitor_interval", type=float, default=0.1, help="seconds between the agent's worker checks")
    p.add_argument("--num_cpu_threads_per_process", type=int, default=None,
                   help="OMP threads per process (default: the cores "
                        "divided by the processes on this machine)")
    p.add_argument("--debug", action="store_true", default=None,
                   help="TORCH_DISTRIBUTED_DEBUG=DETAIL: a collective that differs across ranks "
                        "fails at once, in one line naming each rank's operation and call site")
    p.add_argument("--hang_timeout", type=float, default=None, metavar="SECONDS",
                   help="when no rank makes progress for this long, print every rank's stacks and "
                        f"stop, naming where each waits (default: ${hang_watch.TIMEOUT_VARIABLE}, "
                        f"else {hang_watch.DEFAULT_TIMEOUT:g}; 0: off)")
    p.add_argument("--use_fsdp", action="store_true", help="distributed_type FSDP; --fsdp_* flags set its options")
    for name, f in fields_of(FsdpSection).items():
        p.add_argument(f"--{name}", default=None, metavar="VALUE", help=f.metadata["help"])
    p.add_argument("--use_deepspeed", action="store_true", help="distributed_type DEEPSPEED; the flags below set it")
    for name, f in fields_of(DeepSpeedSection).items():
        if name != "gradient_accumulation_steps" and not f.metadata["unused"]:
            p.add_argument(f"--{name}", default=None, metavar="VALUE", help=f.metadata["help"])
    p.add_argument("--use_parallelism_config", action="store_true",
                   help="lay the processes out by the --parallelism_config_* sizes (Accelerate's "
                        "flag; any of them given implies it)")
    for name, f in fields_of(ParallelismSection).items():
        if not f.metadata["unused"]:
            p.add_argument(f"--{name}", default=None, metavar="VALUE", help=f.metadata["help"])
    p.add_argument("--fault_tolerance", action="store_true", default=None,
                   help="this launch is one replica group of a torchft run (docs/fault_tolerance.md); the flags "
                        "below set it (any of them given implies it)")
    for name, f in fields_of(FaultToleranceSection).items():
        p.add_argument(f"--{name}", default=None, metavar="VALUE", help=f.metadata["help"])
    p.add_argument("-m", "--module", action="store_true", help="run training_script as a module (python -m)")
    p.add_argument("training_script", help="the script (or module, with -m) to run in every process")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER, help="its arguments")
    p.set_defaults(func=run_launch)


def effective_config(args: argparse.Namespace) -> tuple[LaunchConfig, str | None]:
    """Flags over environment over config file over defaults."""
    path = args.config_file
    if path is None and default_config_path().is_file():
        path = str(default_config_path())
    raw: dict[str, Any] = read_mapping(path) if path else {}
    for key, var in _ENV_KEYS.items():
        if env.launcher_setting(var) is not None:
            raw[key] = env.launcher_setting(var)
    flags = vars(args)
    for name in _TOP_FLAGS:
        if flags.get(name) is not None:
            raw[name] = flags[name]
    if args.cpu:
        raw["use_cpu"] = True
    if args.nnodes is not None:
        raw["num_machines"] = elastic_range(args.nnodes)[1]
    if args.debug:
        raw["debug"] = True
    for section, model in (("fsdp_config", FsdpSection), ("deepspeed_config", DeepSpeedSection),
                           ("parallelism_config", ParallelismSection),
                           ("fault_tolerance_config", FaultToleranceSection)):
        given = {name: flags[name] for name in fields_of(model) if flags.get(name) is not None}
        if given:
            raw[section] = {**(raw.get(section) or {}), **given}
    if args.fault_tolerance or any(flags.get(name) is not None for name in fields_of(FaultToleranceSection)):
        raw["fault_tolerance"] = True
    if args.use_fsdp and args.use_deepspeed:
        raise ConfigError("launch: --use_fsdp and --use_deepspeed exclude each other; pick one")
    if args.use_fsdp:
        raw["distributed_type"] = "FSDP"
    elif args.use_deepspeed:
        raw["distributed_type"] = "DEEPSPEED"
    source = " + ".join(filter(None, [path, "command line"]))
    config = validate(raw, source=source)
    return _settle_distributed_type(config), path


def _settle_distributed_type(config: LaunchConfig) -> LaunchConfig:
    """More than one process without FSDP/DeepSpeed means DDP: over gloo on the CPU, NCCL on GPUs.
    """
    import torch

    on_cpu = config.use_cpu or not torch.cuda.is_available()
    if config.distributed_type in ("NO", "MULTI_CPU", "MULTI_GPU") and config.num_processes > 1:
        config.distributed_type = "MULTI_CPU" if on_cpu else "MULTI_GPU"
    if on_cpu:
        config.use_cpu = True
    return config


def elastic_range(text: str) -> tuple[int, int]:
    """`--nnodes MIN:MAX` (or N) as two whole numbers, 1 <= MIN <= MAX."""
    low, _, high = text.partition(":")
    try:
        bounds = int(low), int(high or low)
    except ValueError:
        bounds = (0, 0)
    if not 1 <= bounds[0] <= bounds[1]:
        raise ConfigError(f"launch: --nnodes {text!r} is not MIN:MAX "
                          "with 1 <= MIN <= MAX; e.g. --nnodes 1:2")
    return bounds


def torchrun_arguments(config: LaunchConfig, args: argparse.Namespace) -> list[str]:
    """A rendezvous that restarts can re-enter: c10d (a static one is set up once, so a restarted
    worker group cannot form); `static` only when asked for with several machines."""
    per_machine = config.num_processes // config.num_machines
    nodes = getattr(args, "nnodes", None) or str(config.num_machines)
    static = config.rdzv_backend == "static" and config.num_machines > 1 and ":" not in nodes
    if config.rdzv_backend == "static" and (":" in nodes or (static and args.max_restarts)):
        raise ConfigError("launch: rdzv_backend static cannot be entered again, "
                          "so restarts and --nnodes MIN:MAX cannot re-form the "
                          "group; use --rdzv_backend c10d (the default)")
    out = [f"--nproc_per_node={per_machine}", f"--nnodes={nodes}", f"--max_restarts={args.max_restarts or 0}",
           f"--monitor_interval={getattr(args, 'monitor_interval', 0.1)}"]
    conf = [getattr(args, "rdzv_conf", None)]
    if config.num_machines == 1 and config.main_process_port is not None:
        # its store here: a taken port fails instead of being joined as a client
        conf.insert(0, "is_host=1")
    if any(conf):
        out.append(f"--rdzv_conf={','.join(filter(None, conf))}")
    if config.num_machines == 1 and config.main_process_port is None:
        out.append("--standalone")  # c10d on a free port
    elif static:
        address, port = config.main_process_ip or "127.0.0.1", config.main_process_port or 29500
        out += [f"--node_rank={config.machine_rank}", f"--master_addr={address}", f"--master_port={port}"]
    else:  # torch elastic assigns the node ranks itself
        address, port = config.main_process_ip or "127.0.0.1", config.main_process_port or 29500
        backend = "c10d" if config.rdzv_backend == "static" else config.rdzv_backend
        out += [f"--rdzv_backend={backend}", f"--rdzv_endpoint={address}:{port}", "--rdzv_id=hf-backend"]
    target = ["--module", args.training_script] if args.module else [args.training_script]
    # The agent runs in this process, so it is every worker's parent: the worker dies with it
    # (worker.py).
    return [*out, "-m", "hf_backend.cli.worker", "--parent", str(os.getpid()), *target, *args.training_script_args]


def process_environment(config: LaunchConfig, args: argparse.Namespace, path: str | None) -> dict[str, str]:
    out = env.to_environment(config, path)
    per_machine = config.num_processes // config.num_machines
    if args.num_cpu_threads_per_process is not None:
        out["OMP_NUM_THREADS"] = str(args.num_cpu_threads_per_process)
    elif "OMP_NUM_THREADS" not in os.environ:
        out["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // per_machine))
    if config.debug:
        out["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    if args.hang_timeout is not None:
        if not args.hang_timeout >= 0:
            raise ConfigError(f"launch: --hang_timeout {args.hang_timeout:g} is negative; give "
                              "seconds, or 0 to turn the hang watchdog off")
        out[hang_watch.TIMEOUT_VARIABLE] = f"{args.hang_timeout:g}"
    elif os.environ.get(hang_watch.TIMEOUT_VARIABLE, "").strip():
        # one inherited from the environment is checked here, not in every worker
        hang_watch.hang_timeout()
    elif config.fault_tolerance:
        # torchft's timeouts bound every wait between groups; the watch's report from a failed group's surviving
        # process delayed that group's restart by about 30 s (docs/fault_tolerance.md)
        out[hang_watch.TIMEOUT_VARIABLE] = "0"
    else:  # the launcher watches for hangs unless told otherwise
        out[hang_watch.TIMEOUT_VARIABLE] = f"{hang_watch.DEFAULT_TIMEOUT:g}"
    # A job that can restart (or change members) gets a store per rendezvous round: on the store
    # torch elastic shares across rounds (the default), a restarted group can read its peers'
    # addresses of the round before and fail ("connectFullMesh failed"). Without restarts the shared
    # store stays: it lives in the launcher, so it outlives a rank that exits first (the hang
    # watchdog's and --debug's exchange of call sites runs through it).
    if getattr(args, "max_restarts", 0) or ":" in str(getattr(args, "nnodes", None) or ""):
        out["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if config.gpu_ids and config.gpu_ids != "all":
        out["CUDA_VISIBLE_DEVICES"] = config.gpu_ids
    return out


def run_launch(args: argparse.Namespace) -> int:
    config, path = effective_config(args)
    if not args.module and not os.path.isfile(args.training_script):
        raise ConfigError(f"launch: no script at {args.training_script}; "
                          "pass a path, or -m for a module")
    if args.max_restarts is None:  # a replica group that fails is restarted by its own agent
        args.max_restarts = 3 if config.fault_tolerance else 0
    with contextlib.ExitStack() as stack:
        if config.fault_tolerance:
            from ..fault_tolerance import settings as fault_tolerance  # torch and torchft: only for a replica group
            # torchft logs several lines per step in every process (the lighthouse's and the workers' inherit this)
            os.environ.setdefault("RUST_LOG", "warn")
            config.fault_tolerance_config["lighthouse"] = _lighthouse(config, stack)
            fault_tolerance.FaultTolerance.of_section(config.fault_tolerance_config)  # checked before any start
        os.environ.update(process_environment(config, args, path))
        return _run_agent(config, args)


def _lighthouse(config: LaunchConfig, stack: contextlib.ExitStack) -> str:
    """The lighthouse's address: the one given, else one this launcher serves (replica group 0's first machine) for
    as long as it runs."""
    group = config.replica_group
    if group.lighthouse:
        return group.lighthouse
    if group.replica_id != 0:
        raise ConfigError(f"launch: replica group {group.replica_id} needs --lighthouse http://HOST:PORT, the address "
                          "replica group 0's launcher printed (or a lighthouse of your own)")
    if config.machine_rank != 0:
        if not group.lighthouse_port:
            raise ConfigError("launch: replica group 0's other machines find the lighthouse on main_process_ip at "
                              "lighthouse_port, which is 0 (a free port); give --lighthouse_port or --lighthouse")
        return f"http://{config.main_process_ip}:{group.lighthouse_port}"
    from ..fault_tolerance.settings import serve_lighthouse

    server = serve_lighthouse(group.lighthouse_port, group.min_replicas)
    stack.callback(server.shutdown)
    print(f"hf-backend launch: torchft lighthouse at {server.address()}; the other replica groups join with "
          f"--lighthouse {server.address()}", file=sys.stderr, flush=True)
    return server.address()


def _run_agent(config: LaunchConfig, args: argparse.Namespace) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    quiet = _QuietStop()
    for name in _STOP_LOGGERS:
        logging.getLogger(name).addFilter(quiet)
    try:
        run(get_args_parser().parse_args(torchrun_arguments(config, args)))
    except ChildFailedError as err:
        print(f"hf-backend launch: {describe_failure(err)}", file=sys.stderr)
        return 1
    except SignalException as stop:
        # The agent has already stopped the workers (SIGTERM, then SIGKILL after its shutdown
        # timeout).
        print(f"hf-backend launch: stopped by {stop.sigval.name}; workers stopped", file=sys.stderr)
        return 128 + int(stop.sigval)
    finally:
        for name in _STOP_LOGGERS:
            logging.getLogger(name).removeFilter(quiet)
    return 0


# torch elastic logs a stop by a signal in several lines; the launcher says it in one.
_STOP_LOGGERS = ("torch.distributed.elastic.agent.server.api", "torch.distributed.elastic.multiprocessing.api")


class _QuietStop(logging.Filter):
    """Drops the agent's "Received SIGTERM death signal" and, after it, its "Sending process N closing
    signal" lines; anything else (a worker that would not stop, an error) still shows."""

    def __init__(self) -> None:
        super().__init__()
        self.stopping = False

    def filter(self, record: logging.LogRecord) -> bool:
        if str(record.msg).startswith("Received %s death signal"):
            self.stopping = True
            return False
        return not (self.stopping and str(record.msg).startswith("Sending process %s "
                                                                 "closing signal"))
