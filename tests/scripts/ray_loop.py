"""One training loop run two ways: by `hf-backend launch` (main) and inside Ray Train's TorchTrainer (`train` is the
worker function). tests/test_ray.py compares the two.

A small MLP with dropout regresses 64 fixed samples, 4 per batch per process, for `epochs` epochs. Each process writes
out/rank{r}.json: what it saw of the world, the sample ids of each epoch, its parameters at the end. Inside Ray it
reports a checkpoint after every epoch and restores Ray's latest one at start; `crash_after` makes the first attempt
fail right after reporting that epoch, so Ray restarts the workers and the run continues from the checkpoint.
`trainer_job` does the same for hf_backend.Trainer with Ray's own report callback; `ray_data_jobs` runs the loop on
Ray Data and then `trainer_job` in the same workers (one worker group for both).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

from hf_backend import Accelerator, DeepSpeedPlugin, FullyShardedDataParallelPlugin
from hf_backend.utils import set_seed

SAMPLES, FEATURES = 64, 8


def samples() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    y = x @ torch.linspace(-1, 1, FEATURES) + 0.1 * torch.randn(SAMPLES, generator=g)
    return [{"x": x[i].tolist(), "y": float(y[i]), "id": i} for i in range(SAMPLES)]


class Samples(Dataset):
    def __init__(self) -> None:
        self.rows = samples()

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        row = self.rows[i]
        return {"x": torch.tensor(row["x"]), "y": torch.tensor(row["y"]), "id": row["id"]}


class Progress:
    def __init__(self) -> None:
        self.epoch = 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = state["epoch"]


def build_accelerator(strategy: str) -> Accelerator:
    if strategy == "fsdp":
        return Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(
            state_dict_type="SHARDED_STATE_DICT", auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=200))
    if strategy == "deepspeed":
        return Accelerator(cpu=True, deepspeed_plugin=DeepSpeedPlugin(zero_stage=3, gradient_clipping=1.0))
    return Accelerator(cpu=True)


def train(config: dict) -> None:
    out = Path(config["out"])
    in_ray = config.get("ray", False)
    accelerator = build_accelerator(config.get("strategy", "ddp"))
    set_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if config.get("data") == "ray":
        import ray.train

        batches = ray.train.get_dataset_shard(config.get("dataset", "train")).iter_torch_batches(
            batch_size=4, dtypes={"x": torch.float32, "y": torch.float32, "id": torch.int64})
    else:
        batches = DataLoader(Samples(), batch_size=4, shuffle=True)
    model, optimizer, batches = accelerator.prepare(model, optimizer, batches)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    restored = None
    if in_ray:
        from hf_backend import ray_train

        restored = ray_train.restore(accelerator)
    rank = accelerator.process_index
    record_path = out / f"rank{rank}.json"
    record = json.loads(record_path.read_text()) if record_path.exists() else {"ids": {}, "starts": []}
    record["starts"].append(progress.epoch)
    record.update(world=accelerator.num_processes, rank=rank, local_rank=accelerator.local_process_index,
                  device=str(accelerator.device), distributed_type=accelerator.distributed_type.value,
                  batches_type=type(batches).__module__ + "." + type(batches).__name__,
                  restored=restored is not None)
    for epoch in range(progress.epoch, config.get("epochs", 3)):
        ids = []
        for batch in batches:
            loss = torch.nn.functional.mse_loss(model(batch["x"]).squeeze(-1), batch["y"])
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            ids += batch["id"].tolist()
        record["ids"][str(epoch)] = ids
        progress.epoch = epoch + 1
        record_path.write_text(json.dumps(record))
        if in_ray:
            last = progress.epoch == config.get("epochs", 3)
            ray_train.report(accelerator, {"epoch": progress.epoch, "loss": loss.detach()},
                             model=model if last else None)
            marker = out / "crashed"
            if config.get("crash_after") == progress.epoch and not marker.exists():
                accelerator.wait_for_everyone()
                if accelerator.is_main_process:
                    marker.touch()
                raise RuntimeError(f"planned crash after epoch {progress.epoch}")
    state = accelerator.get_state_dict(model)
    record["local_params"] = [p.detach().float().flatten().tolist() for p in accelerator.unwrap_model(model)
                              .parameters()] if config.get("strategy", "ddp") == "ddp" else None
    if accelerator.is_main_process:
        record["full_params"] = {k: v.float().flatten().tolist() for k, v in state.items()}
    record_path.write_text(json.dumps(record))
    accelerator.end_training()


def trainer_rows() -> list[dict]:
    from bert_loop import data

    ids, labels = data(64).tensors
    return [{"input_ids": ids[i].tolist(), "labels": int(labels[i])} for i in range(len(ids))]


def trainer_job(config: dict) -> None:
    """hf_backend.Trainer on a tiny BERT as the Ray docs run transformers: Ray Data's shard as the train dataset
    through `prepare_trainer`, `RayTrainReportCallback` reporting the checkpoint saved after the 4 steps."""
    import ray.train
    from bert_loop import CONFIG
    from ray.train.huggingface.transformers import RayTrainReportCallback, prepare_trainer
    from transformers import BertConfig, BertForSequenceClassification

    from hf_backend import Trainer, TrainingArguments

    out = Path(config["out"])
    shard = ray.train.get_dataset_shard(config.get("dataset", "train")).iter_torch_batches(batch_size=8)
    args = TrainingArguments(output_dir=str(out / "trainer"), per_device_train_batch_size=8, max_steps=4,
                             learning_rate=1e-3, save_strategy="steps", save_steps=4, logging_steps=1,
                             report_to="none", seed=0, use_cpu=True)
    seen: list[int] = []

    class CountingTrainer(Trainer):  # records the rows of each training batch this process gets
        def training_step(self, model, inputs, num_items_in_batch=None):
            seen.append(len(inputs["labels"]))
            return super().training_step(model, inputs, num_items_in_batch)

    set_seed(0)
    model = BertForSequenceClassification(BertConfig(**CONFIG))
    trainer = CountingTrainer(model=model, args=args, train_dataset=shard)
    trainer.add_callback(RayTrainReportCallback())
    trainer = prepare_trainer(trainer)
    trainer.train()
    rank = trainer.args.process_index
    record = {"world": trainer.args.world_size, "rank": rank, "wrapped": type(trainer.model_wrapped).__name__,
              "steps": trainer.state.global_step, "rows": sum(seen),
              "params": [p.detach().flatten().tolist() for p in trainer.model.parameters()][-2:]}
    (out / f"trainer_rank{rank}.json").write_text(json.dumps(record))


def ray_data_jobs(config: dict) -> None:
    """`train` on Ray Data's shards of the dataset "loop", then `trainer_job` on those of "trainer", one after the
    other in the same worker processes (Ray's process group stays up between them)."""
    train({**config, "ray": True, "data": "ray", "dataset": "loop"})
    trainer_job({**config, "dataset": "trainer"})


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--strategy", default="ddp", choices=("ddp", "fsdp", "deepspeed"))
    p.add_argument("--epochs", type=int, default=3)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    train({"out": args.out, "strategy": args.strategy, "epochs": args.epochs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
