"""SIGKILL a training process again and again, some kills inside a save, and check every resume (issue 18, item 3).

`train`: one run of an engine training loop (a 2-layer MLP, AdamW, data drawn from the step number so a resumed run
sees what the uninterrupted one saw). It resumes with `load_state()` from the newest usable automatic checkpoint,
if any, and saves every `--every` steps with automatic naming and a total limit. Before each save it records in a
side file (atomically) the digest of exactly what it is saving (weights, optimizer state, step) and, once save_state
has returned, that the save finished. It prints one marker line per event: `RESUMED <checkpoint> <digest>`, `READY`,
`SAVE_BEGIN <checkpoint>`, `SAVED`, `RECORDED`, `DONE <digest>`.

`chain` (what runs): the test. Runs `train` once uninterrupted (the reference), then a chain of runs in another
project, each forked fresh (modules imported once), each resuming the one before, and SIGKILLs `--kills` of them at
seeded random moments: half aimed inside a save (a random delay after a SAVE_BEGIN line, within 1.2 times a save's
median duration), half at any moment within two save intervals after READY. Each resumed run's digest is compared
with the record of the checkpoint it chose, and that checkpoint with the newest one on disk. The last run finishes;
its final digest is compared with the reference's. Writes a JSON report to `--out`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import select
import shutil
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from hf_backend import Accelerator, ProjectConfiguration
from hf_backend.checkpoint import layout

WIDTH = 384


class Progress:
    """The step counter, saved with the checkpoint (register_for_checkpointing)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]


def digest(model: torch.nn.Module, optimizer: Any, progress: Progress) -> str:
    """SHA-256 of the weights, the optimizer's state and the step: what a checkpoint must give back bit for bit."""
    h = hashlib.sha256(str(progress.step).encode())

    def add(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            h.update(value.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        elif isinstance(value, dict):
            for key in sorted(value, key=str):
                h.update(str(key).encode())
                add(value[key])
        elif isinstance(value, (list, tuple)):
            for item in value:
                add(item)
        else:
            h.update(repr(value).encode())

    add(model.state_dict())
    add(optimizer.state_dict())
    return h.hexdigest()


def record(path: Path, name: str, entry: dict) -> None:
    """Update the side file atomically: a kill leaves the old or the new one, never a torn one."""
    data = json.loads(path.read_text()) if path.exists() else {}
    data[name] = entry
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def train(project: Path, side_file: Path, steps: int, every: int, total_limit: int) -> str:
    """One run, resumed from the newest usable checkpoint when there is one; returns the final digest."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.Tanh(), torch.nn.Linear(4 * WIDTH, WIDTH))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=str(project), automatic_checkpoint_naming=True, total_limit=total_limit))
    model, optimizer = accelerator.prepare(model, optimizer)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    config = accelerator.project_configuration
    if layout.automatic_dirs(project):
        accelerator.load_state()
        chosen = layout.automatic_dir(project, config.iteration - 1).name  # load_state continues its numbering
        say(f"RESUMED {chosen} {digest(model, optimizer, progress)}")
    say("READY")
    while progress.step < steps:
        generator = torch.Generator().manual_seed(progress.step)
        x = torch.randn(16, WIDTH, generator=generator)
        accelerator.backward((model(x) - x.flip(-1)).square().mean())
        optimizer.step()
        optimizer.zero_grad()
        progress.step += 1
        if progress.step % every == 0:
            name = layout.automatic_dir(project, config.iteration).name
            record(side_file, name, {"digest": digest(model, optimizer, progress), "step": progress.step,
                                     "finished": False})
            say(f"SAVE_BEGIN {name}")
            accelerator.save_state()
            say("SAVED")
            record(side_file, name, {**json.loads(side_file.read_text())[name], "finished": True})
            say("RECORDED")
    final = digest(model, optimizer, progress)
    say(f"DONE {final}")
    return final


# -- the chain ---------------------------------------------------------------------------------------------------------
class Run:
    """`train` in a forked child, its marker lines read from a pipe."""

    def __init__(self, args: argparse.Namespace, project: Path, side_file: Path) -> None:
        read, write = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the child
            os.close(read)
            os.dup2(write, 1)
            code = 0
            try:
                train(project, side_file, args.steps, args.every, args.total_limit)
            except BaseException:  # noqa: BLE001 - reported on stderr, the exit status says it failed
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            os._exit(code)
        os.close(write)
        self.fd, self.buffer, self.lines = read, b"", []

    def next_line(self, timeout: float | None = None) -> str | None:
        """The next marker line; None at the end of the output or after `timeout` seconds without one."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self.buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self.fd], [], [], left)[0]:
                return None
            chunk = os.read(self.fd, 65536)
            if not chunk:
                return None
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        self.lines.append(line.decode())
        return self.lines[-1]

    def wait_for(self, prefix: str) -> str | None:
        while (line := self.next_line()) is not None:
            if line.startswith(prefix):
                return line
        return None

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)

    def finish(self) -> int:
        """Read what is left, reap the child; its exit status (negative: the signal that ended it)."""
        while self.next_line() is not None:
            pass
        os.close(self.fd)
        status = os.waitpid(self.pid, 0)[1]
        return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def moment(lines: list[str]) -> str:
    """Where the run was when it was killed, from the markers it printed."""
    if "READY" not in lines:
        return "resuming"
    last = next((line.split()[0] for line in reversed(lines) if line.split()[0] in
                 ("SAVE_BEGIN", "SAVED", "RECORDED", "READY")), "READY")
    return {"SAVE_BEGIN": "inside save_state", "SAVED": "after save_state, before its record"}.get(last, "training")


def check_resume(run: Run, project: Path, side_file: Path, newest: str | None) -> dict:
    """What the run resumed from: the checkpoint, whether it is the newest on disk, and whether what it loaded is
    exactly what was recorded as saved there."""
    line = run.wait_for("RESUMED")
    if line is None:
        return {"chosen": None, "newest_on_disk": newest}
    _, chosen, loaded = line.split()
    saved = json.loads(side_file.read_text()).get(chosen, {}) if side_file.exists() else {}
    return {"chosen": chosen, "newest_on_disk": newest, "equal_to_saved": loaded == saved.get("digest"),
            "save_recorded_finished": saved.get("finished"), "step": saved.get("step")}


def chain(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="hf_backend_kill_chain_"))
    started = time.monotonic()
    try:
        reference = Run(args, root / "reference", root / "reference.json")
        times, final_reference, begun_at = [], None, time.monotonic()
        while (line := reference.next_line()) is not None:
            if line.startswith("SAVE_BEGIN"):
                begun = time.monotonic()
            elif line == "SAVED":
                times.append(time.monotonic() - begun)
            elif line.startswith("DONE"):
                final_reference = line.split()[1]
        assert reference.finish() == 0, "the uninterrupted run failed"
        save_time = sorted(times)[len(times) // 2]
        interval = (time.monotonic() - begun_at) / len(times)  # from one save to the next
        project, side_file = root / "chain", root / "chain.json"
        kills = []
        for i in range(args.kills + 1):
            found = layout.automatic_dirs(project)
            newest = found[-1].name if found else None
            run = Run(args, project, side_file)
            resumed = check_resume(run, project, side_file, newest) if newest else {"chosen": None}
            if i == args.kills:  # the last run finishes
                line = run.wait_for("DONE")
                status = run.finish()
                return {"kills": kills, "final_resumed": resumed, "final_status": status,
                        "final_equal": line is not None and line.split()[1] == final_reference,
                        "median_save_s": save_time, "save_interval_s": interval,
                        "seconds": time.monotonic() - started}
            aim = "inside a save" if rng.random() < 0.5 else "anywhere"
            if run.wait_for("READY") is not None:
                if aim == "inside a save":
                    for _ in range(rng.randint(1, 2)):
                        run.wait_for("SAVE_BEGIN")
                    time.sleep(rng.uniform(0, 1.2 * save_time))
                else:
                    time.sleep(rng.uniform(0, 2 * interval))
            run.kill()
            status = run.finish()
            kills.append({**resumed, "aim": aim, "killed": moment(run.lines), "status": status,
                          "saving": next((line.split()[1] for line in reversed(run.lines)
                                          if line.startswith("SAVE_BEGIN")), None)})
        raise AssertionError("unreachable")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--seed", type=int, default=18)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--total-limit", type=int, default=3)
    args = parser.parse_args()
    args.out.write_text(json.dumps(chain(args), indent=1))


if __name__ == "__main__":
    main()
