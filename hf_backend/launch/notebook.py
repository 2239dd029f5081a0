"""`notebook_launcher` and `debug_launcher`: run a function on N processes started from a running
interpreter.

A notebook's training function lives in `__main__`, which a fresh interpreter cannot import, so the
workers are forked from this one, through torch elastic's launcher (as `hf-backend launch` runs
scripts through torchrun). They get the environment `hf-backend launch` gives its workers: torch
elastic's RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, and the
HF_BACKEND_* variables `Accelerator()` reads.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import traceback
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from ..config import environment as env
from ..core.environ import patched
from ..core.errors import HfBackendError

_PRECISIONS = ("no", "fp16", "bf16")
_RDZV_BACKENDS = ("static", "c10d", "etcd", "etcd-v2")
# torch elastic's agent sets handlers for these
_AGENT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")


def notebook_launcher(function: Callable[..., Any], args: Iterable[Any] = (), num_processes: int | None = None,
                      mixed_precision: str = "no", use_port: str | int = "29500", master_addr: str = "127.0.0.1",
                      node_rank: int = 0, num_nodes: int = 1, rdzv_backend: str = "static", rdzv_endpoint: str = "",
                      rdzv_conf: dict[str, Any] | None = None, rdzv_id: str = "none", max_restarts: int = 0,
                      monitor_interval: float = 0.1, log_line_prefix_template: str | None = None) -> None:
    """Run `function(*args)` in `num_processes` processes on this machine (each of `num_nodes` machines
    runs the same call with its `node_rank`), or in this process when `num_processes` is None or 1.

    `use_port` 0 lets torch elastic pick a free port (one machine only). A worker that fails stops
    the others and raises HfBackendError naming the rank that failed first and its error; its
    traceback is printed above.
    """
    _launch("notebook_launcher", function, args, num_processes, mixed_precision, cpu=False, port=use_port,
            master_addr=master_addr, node_rank=node_rank, num_nodes=num_nodes, rdzv_backend=rdzv_backend,
            rdzv_endpoint=rdzv_endpoint, rdzv_conf=rdzv_conf, rdzv_id=rdzv_id, max_restarts=max_restarts,
            monitor_interval=monitor_interval, log_line_prefix_template=log_line_prefix_template)


def debug_launcher(function: Callable[..., Any], args: Iterable[Any] = (), num_processes: int = 2) -> None:
    """Run `function(*args)` in `num_processes` CPU processes (gloo) on this machine, on a free port:
    for trying distributed code where there is no GPU, or several processes share one."""
    _launch("debug_launcher", function, args, num_processes, "no", cpu=True, port=0, master_addr="127.0.0.1",
            node_rank=0, num_nodes=1, rdzv_backend="static", rdzv_endpoint="", rdzv_conf=None, rdzv_id="none",
            max_restarts=0, monitor_interval=0.1, log_line_prefix_template=None)


def _launch(name: str, function: Callable[..., Any], args: Iterable[Any], num_processes: int | None,
            mixed_precision: Any, *, cpu: bool, port: str | int, master_addr: str, node_rank: int, num_nodes: int,
            rdzv_backend: str, rdzv_endpoint: str, rdzv_conf: dict[str, Any] | None, rdzv_id: str,
            max_restarts: int, monitor_interval: float, log_line_prefix_template: str | None) -> None:
    if not callable(function):
        raise HfBackendError(f"{name}: function must be callable, got {type(function).__name__}")
    args = tuple(args)
    nproc = 1 if num_processes is None else _integer(name, "num_processes", num_processes, minimum=1)
    # Accelerate's PrecisionType too
    precision = str(getattr(mixed_precision, "value", mixed_precision)).lower()
    if precision not in _PRECISIONS:
        raise HfBackendError(f"{name}: mixed_precision={mixed_precision!r} is not one of "
                             f"{', '.join(_PRECISIONS)}")
    nodes = _integer(name, "num_nodes", num_nodes, minimum=1)
    node = _integer(name, "node_rank", node_rank, minimum=0)
    if node >= nodes:
        raise HfBackendError(f"{name}: node_rank={node_rank} must be below num_nodes={num_nodes}")
    port_number = _integer(name, "use_port", port, minimum=0)
    if port_number > 65535:
        raise HfBackendError(f"{name}: use_port={port!r} is not a port (0-65535)")
    if port_number == 0 and nodes > 1:
        raise HfBackendError(f"{name}: use_port=0 (a free port) works on one machine only; with "
                             "num_nodes > 1 pass the port every machine reaches machine 0 on")
    if rdzv_backend not in _RDZV_BACKENDS:
        raise HfBackendError(f"{name}: rdzv_backend={rdzv_backend!r} is not one of "
                             f"{', '.join(_RDZV_BACKENDS)}")
    restarts = _integer(name, "max_restarts", max_restarts, minimum=0)
    if not isinstance(monitor_interval, (int, float)) or monitor_interval <= 0:
        raise HfBackendError(f"{name}: monitor_interval={monitor_interval!r} "
                             "must be a number of seconds above 0")

    cuda = not cpu and _cuda_present()
    world = nproc * nodes
    settings = {env.MIXED_PRECISION: precision, env.USE_CPU: "false" if cuda else "true",
                env.DISTRIBUTED_TYPE: "NO" if world == 1 else ("MULTI_GPU" if cuda else "MULTI_CPU"),
                env.FSDP_CONFIG: None, env.DEEPSPEED_CONFIG: None, env.CONFIG_FILE: None}
    if world == 1:
        with patched(settings):
            function(*args)
        return

    _check_can_fork(name, cuda, nproc)
    threads = None
    if "OMP_NUM_THREADS" not in os.environ:
        threads = max(1, (os.cpu_count() or 1) // nproc)
        settings["OMP_NUM_THREADS"] = str(threads)
    # torch elastic's own CUDA checks must not initialize CUDA here
    settings["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    # a store per rendezvous round, so that restarts re-form the group
    # (cli/launch.process_environment)
    if restarts:
        settings["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    conf = dict(rdzv_conf or {})
    if port_number == 0:  # torchrun --standalone: a c10d rendezvous on a port the store picks
        rdzv_backend, endpoint, run_id = "c10d", f"{master_addr}:0", uuid.uuid4().hex
    else:
        endpoint, run_id = rdzv_endpoint or f"{master_addr}:{port_number}", str(rdzv_id)
        # one machine: c10d, which restarts can enter again, its store
        if rdzv_backend == "static" and nodes == 1:
            # here (a taken port must fail, not be joined as a client)
            rdzv_backend, conf["is_host"] = "c10d", True
        if rdzv_backend == "static":
            conf["rank"] = node
    with patched(settings, restore_all=True), _signal_handlers_kept():
        _run_elastic(name, function, args, threads, nproc=nproc, nodes=nodes, backend=rdzv_backend,
                     endpoint=endpoint, conf=conf, run_id=run_id, restarts=restarts, interval=float(monitor_interval),
                     prefix=log_line_prefix_template)


def _run_elastic(name: str, function: Callable[..., Any], args: tuple, threads: int | None, *, nproc: int, nodes: int,
                 backend: str, endpoint: str, conf: dict[str, Any], run_id: str, restarts: int, interval: float,
                 prefix: str | None) -> None:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from .worker_failures import describe_failure

    config = LaunchConfig(min_nodes=nodes, max_nodes=nodes, nproc_per_node=nproc, run_id=run_id,
                          rdzv_endpoint=endpoint, rdzv_backend=backend, rdzv_configs=conf, max_restarts=restarts,
                          monitor_interval=interval, start_method="fork", log_line_prefix_template=prefix)
    config.numa_options = None  # hf_backend pins nothing to NUMA nodes (as `hf-backend launch`)
    try:
        elastic_launch(config, _worker)(function, args, threads)
    except ChildFailedError as err:
        raise HfBackendError(f"{name}: {describe_failure(err)}") from None
    except SignalException as err:
        if err.sigval == signal.SIGINT:
            # an interrupted notebook cell, with the workers already stopped
            raise KeyboardInterrupt from None
        raise
    # the rendezvous, before any worker started: a taken port, machine 0 unreachable
    except Exception as err:
        text = str(err)
        if "EADDRINUSE" in text or "EADDRINUSE" in str(err.__cause__):
            raise HfBackendError(f"{name}: {endpoint} is in use (another job, or a "
                                 "worker left from an earlier launch); pass another "
                                 "use_port, or use_port=0 for a free one") from None
        if type(err).__module__.startswith("torch.distributed"):
            first = next((line.strip() for line in text.splitlines() if line.strip()), type(err).__name__)
            raise HfBackendError(f"{name}: the {backend} rendezvous at {endpoint} failed: {first}; "
                                 "check that machine 0 is reachable there") from None
        raise


def _worker(function: Callable[..., Any], args: tuple, threads: int | None) -> None:
    """What each forked process runs: a fresh hf_backend state, then the function; its error is
    recorded with the exact time, so the launcher names the rank that failed first, not one that
    only lost its peer."""
    from ..accelerator.states import forget_accelerator_state
    from ..runtime.process import reset_process_state, shutdown_process_group
    from .hang_watch import HangWatch, explain
    from .worker_failures import record_error

    # die at once when stopped, even inside a collective (the agent's handlers defer)
    for sig in _AGENT_SIGNALS:
        with contextlib.suppress(AttributeError, ValueError):
            signal.signal(getattr(signal, sig), signal.SIG_DFL)
    if threads is not None:
        import torch

        # the forked interpreter set its thread count before OMP_NUM_THREADS changed
        torch.set_num_threads(threads)
    # an Accelerator built in the notebook before describes the notebook's single process
    reset_process_state()
    forget_accelerator_state()
    HangWatch.install_from_environment()
    try:
        function(*args)
    except SystemExit as stop:
        if stop.code not in (0, None):
            record_error(stop, explain(stop))
            raise
    except BaseException as error:
        traceback.print_exc()
        record_error(error, explain(error))
        sys.stderr.flush()
        raise SystemExit(1) from None
    finally:
        shutdown_process_group()
    # The return value stays here: torch elastic would pickle it back, and a model need not be
    # picklable.


def _integer(name: str, what: str, value: Any, minimum: int) -> int:
    try:
        number = int(value)
        if isinstance(value, (bool, float)) or number < minimum:
            raise ValueError
    except (TypeError, ValueError):
        raise HfBackendError(f"{name}: {what}={value!r} must be an integer >= {minimum}") from None
    return number


def _cuda_present() -> bool:
    """Whether there is a GPU, asked without initializing CUDA here (NVML), so that forking stays safe.
    """
    import torch

    if not torch.backends.cuda.is_built():
        return False
    with patched({"PYTORCH_NVML_BASED_CUDA_CHECK": "1"}):
        return torch.cuda.is_available()


def _check_can_fork(name: str, cuda: bool, nproc: int) -> None:
    import multiprocessing

    import torch
    import torch.distributed as dist

    if "fork" not in multiprocessing.get_all_start_methods():
        raise HfBackendError(f"{name}: this platform cannot fork; put the function in a script and "
                             "run it with `hf-backend launch`")
    if dist.is_available() and dist.is_initialized():
        raise HfBackendError(f"{name}: this interpreter already joined a torch.distributed process "
                             "group, which forked workers would share; call "
                             "destroy_process_group() or restart the kernel first")
    if cuda and torch.cuda.is_initialized():
        raise HfBackendError(f"{name}: CUDA is already initialized in this interpreter and forked "
                             "workers cannot use it; restart the kernel and touch no GPU before "
                             "the launch (build the Accelerator inside the function)")
    # NVML's count (see _cuda_present): CUDA stays uninitialized
    if cuda and nproc > torch.cuda.device_count():
        raise HfBackendError(f"{name}: num_processes={nproc} but this machine has "
                             f"{torch.cuda.device_count()} GPU(s), one per process; use fewer "
                             "processes, or debug_launcher for CPU processes")


@contextlib.contextmanager
def _signal_handlers_kept() -> Iterator[None]:
    """torch elastic's agent replaces this interpreter's SIGINT/SIGTERM/... handlers and leaves them
    so; a notebook needs its own back (an interrupt must stay a KeyboardInterrupt)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signals = [getattr(signal, sig) for sig in _AGENT_SIGNALS if hasattr(signal, sig)]
    saved = {sig: signal.getsignal(sig) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)
