"""Fine-tune on a GLUE task inside Ray Train's TorchTrainer: the loop of recipes/glue/run_glue_loop.py, unchanged,
in each Ray worker, with checkpoints reported to Ray.

    python recipes/ray/run_glue_ray.py --task mrpc --data_dir ../shared/data/glue/MRPC --num_workers 2
    python recipes/ray/run_glue_ray.py --data ray ...             # training batches from Ray Data
    python recipes/ray/run_glue_ray.py --address auto ...         # an existing cluster (`ray start --head`)

Without --address it starts a local Ray cluster with num_workers x cpus_per_worker CPUs (plus one for Ray Data).
`--data torch` (default): every worker reads the data and the engine shards a DataLoader; `--data ray`: the driver
reads and tokenizes the training set once and Ray Data streams each worker its share (evaluation stays on the
engine's loaders, so metrics are gathered exactly). Running the same command again (same --run_name and
--storage_path) continues from the run's latest checkpoint; a failed worker is restarted from it (--max_failures).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "glue"))

from common import parse_args  # noqa: E402
from glue_data import DataError, default_model, fail, get_task, load, tokenize  # noqa: E402


def ray_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num_workers", type=int, default=2)
    p.add_argument("--cpus_per_worker", type=float, default=1)
    p.add_argument("--use_gpu", action="store_true", help="one GPU per worker")
    p.add_argument("--address", default=None, help="an existing Ray cluster ('auto', ray://host:10001); default: "
                                                    "start a local one")
    p.add_argument("--data", choices=("torch", "ray"), default="torch", help="where training batches come from")
    p.add_argument("--storage_path", default=None, help="where Ray keeps checkpoints (default: output_dir/ray)")
    p.add_argument("--run_name", default=None, help="default: glue_<task>_<data>")
    p.add_argument("--max_failures", type=int, default=1, help="worker-group restarts from the latest checkpoint")


class RayCheckpoints:
    """The recipe's checkpoints, reported to Ray (every worker writes its part) and restored from Ray's latest."""

    def restore(self, accelerator: Any) -> None:
        from hf_backend import ray_train

        ray_train.restore(accelerator)

    def save(self, accelerator: Any, metrics: dict[str, Any]) -> None:
        from hf_backend import ray_train

        ray_train.report(accelerator, metrics)


class RayDataBatches:
    """This worker's share of the Ray Dataset "train", shuffled per epoch (seed + epoch) within a local buffer."""

    def __init__(self, rows: int, world_size: int, batch_size: int, seed: int) -> None:
        import ray.train

        self.shard = ray.train.get_dataset_shard("train")
        self.batch_size, self.seed = batch_size, seed
        # Ray splits with equal=True: every worker gets rows // world_size rows.
        self.steps_per_epoch = math.ceil((rows // world_size) / batch_size)

    def __call__(self, epoch: int, collate: Any):
        import ray.train.torch

        device = ray.train.torch.get_device()

        def to_batch(columns: dict[str, Any]) -> dict[str, Any]:  # Ray hands over numpy columns of ragged rows
            count = len(columns["labels"])
            rows = [{k: v[i].tolist() for k, v in columns.items()} for i in range(count)]
            return {k: t.to(device) for k, t in collate(rows).items()}

        return self.shard.iter_torch_batches(batch_size=self.batch_size, collate_fn=to_batch,
                                             local_shuffle_buffer_size=4 * self.batch_size,
                                             local_shuffle_seed=self.seed + epoch)


def train_func(config: dict[str, Any]) -> None:
    """What each Ray worker runs."""
    from run_glue_loop import train

    from hf_backend import Accelerator

    args = argparse.Namespace(**config["args"])
    accelerator = Accelerator(mixed_precision=args.mixed_precision)
    batches = None
    if args.data == "ray":
        batches = RayDataBatches(config["train_rows"], accelerator.num_processes, args.batch_size, args.seed)
    train(args, accelerator, RayCheckpoints(), batches)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__.splitlines()[0], argv, more_options=ray_options)
    if args.data == "ray" and args.checkpointing_steps.isdigit():
        fail(DataError("--data ray resumes at epoch boundaries only (Ray Data has no mid-epoch position); use "
                       "--checkpointing_steps epoch or no"))
    if args.resume:
        fail(DataError("--resume: Ray continues a run by itself; run the same command again (same --run_name and "
                       "--storage_path)"))
    # Workers run elsewhere (another directory, maybe another machine): every path they get is absolute.
    args.output_dir = os.path.abspath(args.output_dir)
    args.data_dir = os.path.abspath(args.data_dir) if args.data_dir else None
    try:
        task = get_task(args.task)
        args.model = args.model or default_model()
    except DataError as err:
        fail(err)
    storage = os.path.abspath(args.storage_path or os.path.join(args.output_dir, "ray"))
    name = args.run_name or f"glue_{task.name}_{args.data}"

    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    recipe_dirs = os.pathsep.join(str(Path(__file__).resolve().parents[1] / d) for d in ("glue", "ray"))
    if not ray.is_initialized():
        local = args.address is None
        ray.init(address=args.address, include_dashboard=False,
                 num_cpus=math.ceil(args.num_workers * args.cpus_per_worker) + 1 if local else None,
                 runtime_env={"env_vars": {"PYTHONPATH": recipe_dirs}})
    datasets, config = {}, {"args": vars(args)}
    if args.data == "ray":
        from transformers import AutoTokenizer

        try:
            data = load(task, args.data_dir, args.max_train_samples, args.max_eval_samples)
        except DataError as err:
            fail(err)
        encoded = tokenize(data["train"], AutoTokenizer.from_pretrained(args.model), args.max_length)
        # From the Arrow table (from_huggingface first tries to re-read the dataset's source files).
        datasets["train"] = ray.data.from_arrow(encoded.rename_column("label", "labels").flatten_indices().data.table)
        config["train_rows"] = len(encoded)
    trainer = TorchTrainer(
        train_func, train_loop_config=config, datasets=datasets,
        scaling_config=ScalingConfig(num_workers=args.num_workers, use_gpu=args.use_gpu,
                                     resources_per_worker={"CPU": args.cpus_per_worker}),
        run_config=RunConfig(name=name, storage_path=storage, checkpoint_config=CheckpointConfig(num_to_keep=2),
                             failure_config=FailureConfig(max_failures=args.max_failures)),
    )
    result = trainer.fit()
    print(f"results: {os.path.join(args.output_dir, 'results.json')}; Ray run: {os.path.join(storage, name)}")
    if result.checkpoint is not None:
        print(f"latest checkpoint: {result.checkpoint.path} ({result.metrics})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
