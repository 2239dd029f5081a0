"""A group that must form again after a restart: rank 1 SIGKILLs itself in the first run; the restarted group forms
and the main process writes `<restart count> <sum>`. Under `hf-backend launch --max_restarts 1` it trains at once;
run by python, through `notebook_launcher(..., max_restarts=1)` on the port given."""

from __future__ import annotations

import os
import signal
import sys
import time

import torch

from hf_backend import Accelerator, notebook_launcher
from hf_backend.utils import reduce


def train(out: str) -> None:
    if os.environ["TORCHELASTIC_RESTART_COUNT"] != "0" and os.environ["RANK"] == "0":
        time.sleep(1.0)  # rank 1 looks up rank 0's address first: on a store shared across rounds it finds the old one
    accelerator = Accelerator(cpu=True)
    total = reduce(torch.ones(1), "sum")
    if accelerator.restart_count == 0 and accelerator.process_index == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    total = reduce(total, "sum")
    if accelerator.is_main_process:
        with open(out, "w") as f:
            f.write(f"{accelerator.restart_count} {total.item():g}")


if __name__ == "__main__" and "TORCHELASTIC_RESTART_COUNT" in os.environ:
    train(sys.argv[1])
elif __name__ == "__main__":
    notebook_launcher(train, (sys.argv[1],), num_processes=2, max_restarts=1, use_port=sys.argv[2])
