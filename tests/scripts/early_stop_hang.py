"""Early stopping decided on a per-rank metric (a real Trainer bug report): rank 1's metric crosses the threshold a
step before rank 0's, so rank 1 leaves the loop and waits for everyone at the end while rank 0 trains on into the
next step's gradient all-reduce. Each rank writes its pid to <dir>/pid<rank>; rank 1 writes the time it stopped to
<dir>/stopped, when the job starts to hang. A second argument, seconds: the hang watch this script passes itself
(plain torchrun; `hf-backend launch` installs one)."""

import os
import sys
import time

import torch

from hf_backend import Accelerator
from hf_backend.launch.hang_watch import HangWatch

out = sys.argv[1]
accelerator = Accelerator(cpu=True, kwargs_handlers=[HangWatch(float(arg)) for arg in sys.argv[2:3]])
rank = accelerator.process_index
with open(os.path.join(out, f"pid{rank}"), "w") as f:
    f.write(str(os.getpid()))
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = accelerator.prepare(model, optimizer)
data = torch.randn(8, 4) + rank
for step in range(10):
    loss = model(data).pow(2).mean()
    metric = step + rank  # this rank's own metric: no rank sees the others'
    if metric >= 3:
        with open(os.path.join(out, "stopped"), "w") as f:
            f.write(repr(time.time()))
        break
    accelerator.backward(loss)  # rank 0 waits here
    optimizer.step()
    optimizer.zero_grad()
accelerator.wait_for_everyone()  # rank 1 waits here
print("finished", rank, flush=True)
