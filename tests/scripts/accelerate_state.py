"""What Accelerate's own state answers inside an engine run (tests/test_accelerate_state.py): a loop ported by its
`Accelerator` import alone, which keeps `accelerate.logging.get_logger` and `accelerate.utils` (`set_seed(...,
device_specific=True)`, `gather_object`, `broadcast_object_list`, `gather`) as transformers' `*_no_trainer.py`
examples do, and asks `AcceleratorState()`, `PartialState()` and `GradientState()` during gradient accumulation.
Each rank writes `<out>.rank<r>.json`. Run in one process or under torchrun.
"""

from __future__ import annotations

import argparse
import json
import logging

import torch
from accelerate.logging import get_logger
from accelerate.state import AcceleratorState, GradientState, PartialState
from accelerate.utils import broadcast_object_list, gather, gather_object, set_seed

from hf_backend import Accelerator  # was: from accelerate import Accelerator

logger = get_logger(__name__)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--mixed-precision", default="no")
    parser.add_argument("--fsdp", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(format="%(message)s", level=logging.INFO)

    plugin = None
    if args.fsdp:
        from hf_backend import FullyShardedDataParallelPlugin

        plugin = FullyShardedDataParallelPlugin(auto_wrap_policy="NO_WRAP")
    accelerator = Accelerator(gradient_accumulation_steps=2, mixed_precision=args.mixed_precision, fsdp_plugin=plugin)
    logger.info(accelerator.state, main_process_only=False)  # run_glue_no_trainer.py's first log line
    logger.info("logged once", main_process_only=True)
    set_seed(7, device_specific=True)
    seeded = torch.initial_seed()

    state, partial = AcceleratorState(), PartialState()
    report = {
        "seed": seeded,
        "accelerator_state": [state.num_processes, state.process_index, str(state.distributed_type),
                              state.mixed_precision, str(state.device)],
        "partial_state": [partial.num_processes, partial.process_index, partial.local_process_index,
                          partial.is_main_process, str(partial.distributed_type), partial.use_distributed],
        "fsdp_plugin_is_the_engines": state.fsdp_plugin is accelerator.state.fsdp_plugin,
        "gathered_objects": gather_object([f"rank{accelerator.process_index}"]),
        "broadcast": broadcast_object_list([accelerator.process_index * 10 + 1])[0],
        "gathered": gather(torch.tensor([accelerator.process_index + 1.0])).tolist(),
    }

    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 1)),
                                       batch_size=2)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    seen = []
    for x, y in data:
        with accelerator.accumulate(model):
            gradient_state = GradientState()
            seen.append([gradient_state.sync_gradients, gradient_state.num_steps, gradient_state.in_dataloader,
                         gradient_state.end_of_dataloader])
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    report["gradient_state"] = seen
    report["gradient_state_after"] = [GradientState().in_dataloader, GradientState().sync_gradients]
    with open(f"{args.out}.rank{accelerator.process_index}.json", "w") as f:
        json.dump(report, f)
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
