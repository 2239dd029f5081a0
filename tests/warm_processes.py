"""Run a test script in N processes forked from one warm interpreter: the suite's own stand-in for torchrun.

A fresh interpreter that imports torch, transformers and DeepSpeed takes 8-12 s on the 2-core CI machine, and the
suite starts a hundred of them. So the session starts one server process (this file, run as a script) that imports
those modules once, and every `run` forks the processes of one job from it. Each job gets fresh copies of the
server, with nothing carried over from earlier jobs; the environment torchrun gives its workers (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, a port of its own); and its script run as `python script.py
args` would run it. When one process fails, the others are stopped, as torch elastic stops them. The launcher itself
is still tested through real launches (test_cli.py, the recipes, the Trainer's launcher test, Ray).

Variables that those modules read at import (HF_HUB_OFFLINE, DS_ACCELERATOR, KMP_DUPLICATE_LIB_OK, ...) cannot change
per job: a job whose environment sets them otherwise than the server's gets a new server started with its
environment. Every job runs offline (HF_HUB_OFFLINE, HF_DATASETS_OFFLINE).
"""

from __future__ import annotations

import atexit
import ctypes
import faulthandler
import gc
import importlib
import json
import os
import random
import runpy
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

# Read when the interpreter starts or the preloaded modules are imported; a job's environment must leave them as the
# server had them.
_FROZEN_PREFIXES = ("PYTHON", "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "DS_", "DEEPSPEED_", "PYTORCH_", "TORCH_", "OMP_",
                    "MKL_", "KMP_", "OPENBLAS_")
# Read when a job uses them, not at import (OMP_NUM_THREADS: each job sets torch's thread count from it).
_PER_JOB = ("HF_BACKEND_", "TORCH_DISTRIBUTED_DEBUG", "TORCHELASTIC_", "OMP_NUM_THREADS")
# Threads the server may have when it forks: its own, and jemalloc's (pyarrow, under datasets), which jemalloc's
# fork handlers make safe. Any other thread could hold a lock that every forked process would inherit held.
_THREADS_SAFE_TO_FORK = {"jemalloc_bg_thd"}
_OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}  # tests talk to nothing but 127.0.0.1


def _frozen(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(_FROZEN_PREFIXES) and not k.startswith(_PER_JOB)}


def free_port() -> int:
    """A free port below Linux's ephemeral range (32768-60999): a port the kernel hands out for binding port 0 can be
    handed out again as the source port of any client's connect before the store binds it."""
    for port in random.Random().sample(range(20000, 32000), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-31999 on 127.0.0.1")


# -- the client, in the pytest process ---------------------------------------------------------------------------------
class _Server:
    def __init__(self, env: dict[str, str]) -> None:
        self.frozen = _frozen(env)
        self.dir = Path(tempfile.mkdtemp(prefix="warm_processes_"))
        self.log = self.dir / "server.log"
        with self.log.open("w") as log:
            self.proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=log, text=True, env={**env, "OMP_NUM_THREADS": "1"})
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the warm process server did not start:\n{self.log.read_text()[-3000:]}")
        self.jobs = 0

    def submit(self, request: dict) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        # The server answers once the job ended or was killed at its timeout; give it a minute more.
        ready, _, _ = select.select([self.proc.stdout], [], [], request["timeout"] + 60)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.close()
            raise RuntimeError(f"the warm process server died or stopped answering:\n{self.log.read_text()[-3000:]}")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()
        shutil.rmtree(self.dir, ignore_errors=True)


_SERVER: _Server | None = None


def run(script: str | Path, args: list[str], nproc: int = 1, env: dict[str, str] | None = None,
        timeout: float = 240, torchrun: bool = False) -> subprocess.CompletedProcess:
    """Run `script args` in `nproc` processes (torchrun's environment when nproc > 1, or when `torchrun`: one
    process as `torchrun --nproc_per_node 1` starts it), like subprocess.run with
    capture_output: returncode 0 when every process succeeded, else that of the first failure seen (negative for a
    signal), and `returncodes` each rank's; stdout and stderr hold every process's output, rank by rank
    (`rank_stderr` each rank's stderr). Raises
    subprocess.TimeoutExpired after `timeout`."""
    global _SERVER
    job_env = {**(os.environ if env is None else env), **_OFFLINE}
    if _SERVER is None or _SERVER.proc.poll() is not None or _SERVER.frozen != _frozen(job_env):
        if _SERVER is None:
            atexit.register(_close_server)
        else:
            _SERVER.close()
        _SERVER = _Server(job_env)
    _SERVER.jobs += 1
    logs = _SERVER.dir / f"job{_SERVER.jobs}"
    logs.mkdir()
    reply = _SERVER.submit({"script": str(script), "args": [str(a) for a in args], "nproc": nproc, "env": job_env,
                            "cwd": os.getcwd(), "timeout": timeout, "logs": str(logs),
                            "torchrun": torchrun or nproc > 1})
    streams, ranks = {}, {}
    for stream in ("out", "err"):
        ranks[stream] = [(logs / f"rank{r}.{stream}").read_text(errors="replace") for r in range(nproc)]
        streams[stream] = ranks[stream][0] if nproc == 1 else "".join(
            f"[rank {r}]\n{p}" for r, p in enumerate(ranks[stream]))
    cmd = [f"{script}", *args]
    if reply["timed_out"]:
        raise subprocess.TimeoutExpired(cmd, timeout, streams["out"], streams["err"])
    proc = subprocess.CompletedProcess(cmd, reply["first_failure"], streams["out"], streams["err"])
    proc.returncodes = reply["returncodes"]  # each rank's
    proc.rank_stderr = ranks["err"]
    return proc


def _close_server() -> None:
    if _SERVER is not None:
        _SERVER.close()


# -- the server: `python warm_processes.py`, one JSON request per line on stdin, one reply per line on stdout ---------
_REPLIES_FD = -1  # the server's end of the reply pipe, which its jobs' processes must not keep open


def _serve() -> None:
    global _REPLIES_FD
    _REPLIES_FD = os.dup(1)
    replies = os.fdopen(_REPLIES_FD, "w")
    os.dup2(2, 1)  # anything the imports print goes to the server's log, never into the replies
    import torch  # noqa: F401  (the imports every job would otherwise repeat)
    import torch.distributed.checkpoint  # noqa: F401
    import transformers  # noqa: F401
    from transformers import BertForSequenceClassification, Trainer  # noqa: F401

    import hf_backend.trainer  # noqa: F401

    # DeepSpeed's ZeRO engine imports its Muon optimizer on every prepare (is_zero_supported_optimizer), and that
    # imports torch.compile's inductor: 2-5 s per process here.
    for optional in ("datasets", "deepspeed", "deepspeed.runtime.zero.muon.muon_optimizer"):
        try:
            importlib.import_module(optional)
        except ImportError:
            pass
    try:  # py-cpuinfo answers every call from an interpreter it starts (1.5 s here), and DeepSpeed's CPU Adam asks
        import cpuinfo.cpuinfo as cpu  # three times a process: the CPU stays the same, ask once

        answer = cpu.get_cpu_info_json()
        cpu.get_cpu_info_json = lambda: answer
    except ImportError:
        pass
    if "deepspeed" in sys.modules and sys.modules["deepspeed"].get_accelerator().device_name() == "cpu":
        sys.modules["deepspeed"].ops.__compatible_ops__  # noqa: B018 - probed on first use (compilers run: 0.5 s a job)
    threads = {Path(f"/proc/self/task/{task}/comm").read_text().strip() for task in os.listdir("/proc/self/task")
               if int(task) != os.getpid()}
    if threads - _THREADS_SAFE_TO_FORK:
        raise RuntimeError(f"the preloaded modules started threads {sorted(threads)}: forking would copy their locks")
    # The preloaded modules' objects live as long as the server: moved out of the collector's sight, a job's
    # gc.collect() (the engine runs two as it tears its process group down, the Trainer one in free_memory) walks only
    # what the job made, not the whole heap of torch, transformers and datasets (about 0.9 s a call here otherwise).
    gc.collect()
    gc.freeze()
    print("ready", file=replies, flush=True)
    for line in sys.stdin:
        print(json.dumps(_job(json.loads(line))), file=replies, flush=True)


def _job(request: dict) -> dict:
    nproc, port, server = request["nproc"], free_port(), os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()
    pids: list[int] = []
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            _child(request, rank, port, pids[0] if pids else 0, server)
        try:
            os.setpgid(pid, pids[0] if pids else pid)  # one process group per job (the child does the same)
        except OSError:
            pass  # already exited, or already in it
        pids.append(pid)
    codes: dict[int, int] = {}
    deadline = time.monotonic() + request["timeout"]
    timed_out = False
    while len(codes) < nproc:
        for pid in pids:
            if pid not in codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[pid] = os.waitstatus_to_exitcode(status)
        failed = any(code != 0 for code in codes.values())
        if len(codes) < nproc and (failed or time.monotonic() > deadline):
            timed_out = not failed
            _kill_group(pids[0])
            for pid in pids:
                if pid not in codes:
                    codes[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        time.sleep(0.02)
    _kill_group(pids[0])  # whatever a job's processes started and left behind
    first_failure = next((code for code in codes.values() if code != 0), 0)  # the first one seen to end
    return {"returncodes": [codes[pid] for pid in pids], "first_failure": first_failure, "timed_out": timed_out}


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _die_with_the_server(server: int) -> None:
    """Be SIGKILLed when the server ends (an interrupted test session) instead of training on as an orphan."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != server:  # the server was gone before prctl took effect
        os._exit(1)


def _child(request: dict, rank: int, port: int, pgid: int, server: int) -> None:
    """Become rank `rank` of the job and run its script; never returns."""
    code = 1
    try:
        os.close(_REPLIES_FD)  # else a client could wait forever on a server that died while this process lives
        os.setpgid(0, pgid)
        _die_with_the_server(server)
        logs = Path(request["logs"])
        for fd, name in ((1, "out"), (2, "err")):
            target = os.open(logs / f"rank{rank}.{name}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(target, fd)
            os.close(target)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        faulthandler.enable(all_threads=True)  # a crash in native code (SIGSEGV) leaves every thread's Python stack
        os.environ.clear()
        os.environ.update(request["env"])
        nproc = request["nproc"]
        if request["torchrun"]:
            os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                              LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(port))
        import torch

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        os.chdir(request["cwd"])
        script = request["script"]
        sys.argv = [script, *request["args"]]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as stop:
            if stop.code is None or isinstance(stop.code, int):
                code = stop.code or 0
            else:
                print(stop.code, file=sys.stderr)
        threading._shutdown()  # what a normal interpreter exit runs: join the threads, then the atexit functions
        atexit._run_exitfuncs()  # (the engine's process-group teardown among them)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    _serve()
