"""The config model: every key a config file may hold, its type, allowed values, default and meaning.

It reads the files `accelerate config` writes (same key names, same layout) and is the one source
for validation, `hf-backend config` questions, and the generated reference in docs/config.md. Each
field's metadata says: help (one line), choices (canonical spellings), minimum and maximum (every
number has a range), unused (accepted from Accelerate, means nothing here), aliases (older or
prefix-less spellings), question (asked by the interactive `hf-backend config`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

DISTRIBUTED_TYPES = ("NO", "MULTI_CPU", "MULTI_GPU", "FSDP", "DEEPSPEED")
SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
# Ranges far above any real job (the largest runs have ~10^5 accelerators), there to refuse typos
# and overflows.
MAX_PROCESSES = 1 << 20
MAX_MACHINES = 1 << 16
MAX_ACCUMULATION = 1_000_000


def key(default: Any, help: str, *, choices: tuple | None = None, minimum: float | None = None,
        maximum: float | None = None, unused: bool = False, aliases: tuple[str, ...] = (),
        question: str | None = None, int_choices: dict[int, str] | None = None) -> Any:
    meta = {"help": help, "choices": choices, "minimum": minimum, "maximum": maximum, "unused": unused,
            "aliases": aliases, "question": question, "int_choices": int_choices}
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class FsdpSection:
    """`fsdp_config:`, read into the FSDP strategy's options (config/fsdp.py). Keys may be written
    with or without the `fsdp_` prefix."""

    fsdp_version: int = key(2, "1 is accepted and mapped onto FSDP2 (fully_shard), the only "
                               "implementation used",
                            choices=(1, 2))
    fsdp_sharding_strategy: str = key(
        "FULL_SHARD", "how parameters, gradients and optimizer state are sharded (1-5 as accelerate writes them)",
        choices=SHARDING_STRATEGIES, int_choices=dict(enumerate(SHARDING_STRATEGIES, start=1)),
        question="Sharding strategy")
    fsdp_reshard_after_forward: bool = key(True, "free gathered parameters after "
                                                 "forward (FSDP2's FULL_SHARD)")
    fsdp_offload_params: bool = key(False, "keep parameters and gradients on the CPU between uses",
                                    aliases=("cpu_offload",), question="Offload parameters to the CPU")
    fsdp_auto_wrap_policy: str = key("TRANSFORMER_BASED_WRAP", "which submodules become their own FSDP unit",
                                     choices=("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"),
                                     question="Auto wrap policy")
    fsdp_transformer_layer_cls_to_wrap: str | None = key(
        None, "comma-separated block class names to wrap (default: the model's _no_split_modules)",
        aliases=("transformer_cls_names_to_wrap",),  # Accelerate's plugin field name
        question="Transformer layer class names to wrap (empty: the model's own)")
    fsdp_min_num_params: int = key(100_000_000, "smallest module size wrapped "
                                                "by SIZE_BASED_WRAP", minimum=0,
                                   maximum=10**15)
    fsdp_backward_prefetch: str = key("BACKWARD_PRE", "prefetch of the next unit's parameters in backward",
                                      choices=("BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH"),
                                      aliases=("fsdp_backward_prefetch_policy",))
    fsdp_forward_prefetch: bool | None = key(
        None, "prefetch the next unit's parameters in forward (unset: on the CPU yes, on GPUs "
              "FSDP2's own overlap)")
    fsdp_state_dict_type: str = key("FULL_STATE_DICT", "checkpoint format of save_state",
                                    # FSDP2 has no local one
                                    choices=("FULL_STATE_DICT", "SHARDED_STATE_DICT"),
                                    question="State dict type")
    fsdp_cpu_ram_efficient_loading: bool = key(False, "only rank 0 materializes pretrained weights")
    fsdp_sync_module_states: bool = key(True, "broadcast rank 0's weights at wrap time")
    fsdp_use_orig_params: bool = key(True, "FSDP1 option; FSDP2 always "
                                           "keeps the original parameters")
    fsdp_activation_checkpointing: bool = key(False, "recompute activations of each "
                                                     "wrapped block in backward")


@dataclass
class DeepSpeedSection:
    """`deepspeed_config:`, read by the DeepSpeed strategy."""

    zero_stage: int = key(2, "ZeRO stage", choices=(0, 1, 2, 3), question="ZeRO stage")
    gradient_accumulation_steps: int = key(1, "micro steps per optimizer "
                                              "step", minimum=1, maximum=MAX_ACCUMULATION)
    gradient_clipping: float = key(1.0, "max gradient norm", minimum=0, maximum=1_000_000)
    offload_optimizer_device: str = key("none", "where optimizer state lives", choices=("none", "cpu", "nvme"),
                                        question="Offload optimizer state to")
    offload_param_device: str = key("none", "where parameters live (ZeRO-3)", choices=("none", "cpu", "nvme"))
    offload_optimizer_nvme_path: str | None = key(None, "NVMe path for optimizer offload")
    offload_param_nvme_path: str | None = key(None, "NVMe path for parameter offload")
    zero3_init_flag: bool = key(False, "partition parameters while the model is built (ZeRO-3)")
    zero3_save_16bit_model: bool = key(False, "gather 16-bit weights when saving a ZeRO-3 model")
    deepspeed_config_file: str | None = key(None, "a DeepSpeed JSON config; its "
                                                  "values win over the keys above")
    deepspeed_hostfile: str | None = key(None, "DeepSpeed's own multi-node launcher", unused=True)
    deepspeed_inclusion_filter: str | None = key(None, "DeepSpeed's own multi-node "
                                                       "launcher", unused=True)
    deepspeed_exclusion_filter: str | None = key(None, "DeepSpeed's own multi-node "
                                                       "launcher", unused=True)
    deepspeed_multinode_launcher: str | None = key(None, "DeepSpeed's own multi-node "
                                                         "launcher", unused=True)
    deepspeed_moe_layer_cls_names: str | None = key(None, "MoE layer classes kept whole by ZeRO-3")


# torch.distributed.pipelining's schedules, by the names get_schedule_class takes (strategies/pipeline.py)
PP_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
                "DualPipeV")


@dataclass
class ParallelismSection:
    """`parallelism_config:` (Accelerate's keys and flags): the process grid of the native mesh path, a
    ParallelismConfig in every process. The sizes multiply to the number of processes (all 1: not
    used)."""

    parallelism_config_dp_replicate_size: int = key(1, "data-parallel replicas "
                                                       "(HSDP's replicate dimension)",
                                                    minimum=1, maximum=MAX_PROCESSES,
                                                    question="Data-parallel replicas "
                                                             "(dp_replicate_size)")
    parallelism_config_dp_shard_size: int = key(1, "data-parallel shards (FSDP over "
                                                   "this dimension)", minimum=1,
                                                maximum=MAX_PROCESSES, question="FSDP shards "
                                                                                "(dp_shard_size)")
    parallelism_config_tp_size: int = key(1, "tensor-parallel shards (from "
                                             "the model's tp_plan)", minimum=1,
                                          maximum=MAX_PROCESSES, question="Tensor-parallel "
                                                                          "size (tp_size)")
    parallelism_config_cp_size: int = key(1, "context-parallel slices of each "
                                             "sequence (causal attention)",
                                          minimum=1, maximum=MAX_PROCESSES,
                                          question="Context-parallel size (cp_size)")
    parallelism_config_cp_backend: str = key("torch", "context parallelism backend", choices=("torch",))
    parallelism_config_cp_comm_strategy: str = key("allgather", "how K/V are exchanged: hf_backend passes "
                                                                "them around a ring", unused=True)
    parallelism_config_sp_size: int = key(1, "sequence-parallel slices of each sequence "
                                             "(Ulysses: heads traded by all-to-all)",
                                          minimum=1, maximum=MAX_PROCESSES,
                                          question="Sequence-parallel size (sp_size)")
    parallelism_config_sp_backend: str = key("deepspeed", "both run hf_backend's Ulysses ('deepspeed' is "
                                                          "Accelerate's default)",
                                             choices=("deepspeed", "hf_backend"))
    parallelism_config_ep_size: int = key(1, "expert-parallel ranks a mixture of experts' experts are split over "
                                             "(hf_backend's: within dp_shard x cp x sp, no processes of its own)",
                                          minimum=1, maximum=MAX_PROCESSES,
                                          question="Expert-parallel size (ep_size)")
    parallelism_config_pp_size: int = key(1, "pipeline stages: the model's layers cut over that many ranks, the "
                                             "outermost dimension (hf_backend's; an Accelerate loop calls "
                                             "accelerator.forward_backward)", minimum=1, maximum=MAX_PROCESSES,
                                          question="Pipeline-parallel size (pp_size)")
    parallelism_config_pp_schedule: str = key("1F1B", "torch.distributed.pipelining's schedule", choices=PP_SCHEDULES)
    parallelism_config_pp_microbatches: int = key(0, "microbatches the schedule cuts each batch into (0: one per "
                                                     "stage)", minimum=0, maximum=1_000_000)


@dataclass
class FaultToleranceSection:
    """`fault_tolerance_config:`, read when `fault_tolerance: true`: this launch is one replica group of a torchft
    run (docs/fault_tolerance.md). Each key is also a `hf-backend launch` flag."""

    replica_id: int = key(0, "this replica group's index, from 0 (every machine of a group gives the same)",
                          minimum=0, maximum=MAX_MACHINES - 1)
    num_replica_groups: int = key(2, "replica groups in the run", minimum=1, maximum=MAX_MACHINES)
    lighthouse: str | None = key(None, "the torchft lighthouse's address, http://HOST:PORT (unset: replica group 0's "
                                       "launcher starts one on lighthouse_port and prints it)")
    lighthouse_port: int = key(29510, "port of the lighthouse replica group 0's launcher starts (0: a free one)",
                               minimum=0, maximum=65535)
    min_replicas: int = key(1, "the fewest live replica groups a step commits with", minimum=1, maximum=MAX_MACHINES)
    collective_timeout: float = key(60.0, "seconds a gradient exchange, commit or healing may take",
                                    minimum=1, maximum=86_400)
    quorum_timeout: float = key(120.0, "seconds a step waits for a quorum of live groups", minimum=1, maximum=86_400)
    sync_every: int = key(1, "optimizer steps between two meetings of the groups: 1, gradients averaged at every "
                             "step; N > 1, each group steps alone and every N steps the groups average how far "
                             "they moved (LocalSGD; DiLoCo with the outer settings below)",
                          minimum=1, maximum=1_000_000)
    outer_lr: float = key(1.0, "with sync_every > 1: the learning rate of the outer SGD step on the averaged move "
                               "(1 with momentum 0: LocalSGD, the average of the groups' weights; DiLoCo: 0.7)",
                          minimum=0, maximum=100)
    outer_momentum: float = key(0.0, "with sync_every > 1: the outer step's Nesterov momentum (DiLoCo: 0.9)", minimum=0,
                                maximum=0.999)


@dataclass
class LaunchConfig:
    """What `hf-backend launch` starts and how `Accelerator()` in each process is set up."""

    compute_environment: str = key("LOCAL_MACHINE", "only this machine and its peers; SageMaker is not supported",
                                   choices=("LOCAL_MACHINE",))
    distributed_type: str = key("NO", "how the work is spread (MULTI_CPU: DDP over gloo)", choices=DISTRIBUTED_TYPES,
                                question="Distributed type")
    mixed_precision: str = key("no", "autocast dtype", choices=("no", "fp16", "bf16"), question="Mixed precision")
    use_cpu: bool = key(False, "train on the CPU even when a GPU is there", question="Train on the CPU only")
    num_processes: int = key(1, "processes in total, across all "
                                "machines", minimum=1, maximum=MAX_PROCESSES,
                             question="How many processes in total")
    num_machines: int = key(1, "machines taking part", minimum=1, maximum=MAX_MACHINES, question="How many machines")
    machine_rank: int = key(0, "this machine's index, 0 on the main "
                               "machine", minimum=0, maximum=MAX_MACHINES - 1,
                            question="Rank of this machine")
    main_process_ip: str | None = key(None, "address of machine 0 (needed "
                                            "with more than one machine)",
                                      question="IP address of machine 0")
    main_process_port: int | None = key(None, "port on machine 0 (free port "
                                              "chosen on one machine when unset)",
                                        minimum=1, maximum=65535, question="Port on machine 0")
    rdzv_backend: str = key("c10d", "torch elastic rendezvous (static: no restarts across several machines)",
                            choices=("static", "c10d", "etcd", "etcd-v2"))
    same_network: bool = key(True, "machines share a network (informational)")
    gpu_ids: str | None = key(None, "GPUs to use, 'all' or a comma-separated list (sets "
                                    "CUDA_VISIBLE_DEVICES)")
    gradient_accumulation_steps: int = key(1, "micro steps per optimizer "
                                              "step", minimum=1, maximum=MAX_ACCUMULATION)
    debug: bool = key(False, "TORCH_DISTRIBUTED_DEBUG=DETAIL in every process")
    main_training_function: str = key("main", "used by notebook launchers; accepted", unused=True)
    downcast_bf16: str = key("no", "XLA/TPU only", choices=("no", "yes", "first"), unused=True)
    enable_cpu_affinity: bool = key(False, "NUMA pinning is not done by hf_backend", unused=True)
    dynamo_backend: str = key("NO", "torch.compile backend for every prepared model (inductor, eager, ...; NO: off), "
                                    "unless the script passes its own")
    fsdp_config: dict = key({}, "FSDP settings (see below)")
    deepspeed_config: dict = key({}, "DeepSpeed settings (see below)")
    megatron_lm_config: dict = key({}, "Megatron-LM is not supported", unused=True)
    dynamo_config: dict = key({}, "mode, fullgraph, dynamic: pass a "
                                  "TorchDynamoPlugin in the script", unused=True)
    ipex_config: dict = key({}, "IPEX is not supported", unused=True)
    mpirun_config: dict = key({}, "processes start through torch elastic, not mpirun", unused=True)
    fp8_config: dict = key({}, "fp8 is not supported", unused=True)
    parallelism_config: dict = key({}, "the process grid: tensor parallelism "
                                       "x FSDP / HSDP (see below)")
    fault_tolerance: bool = key(False, "replica groups on torchft: a failed group restarts and heals from a live one "
                                       "while the others train on")
    fault_tolerance_config: dict = key({}, "this launch's replica group and the lighthouse (see below)")
    tpu_name: str | None = key(None, "TPU only", unused=True)
    tpu_zone: str | None = key(None, "TPU only", unused=True)
    tpu_use_cluster: bool = key(False, "TPU only", unused=True)
    tpu_use_sudo: bool = key(False, "TPU only", unused=True)
    tpu_vm: list[str] = key([], "TPU only", unused=True)
    tpu_env: list[str] = key([], "TPU only", unused=True)
    command_file: str | None = key(None, "TPU pod commands", unused=True)
    commands: list[str] = key([], "TPU pod commands", unused=True)

    @property
    def fsdp(self) -> FsdpSection:
        return FsdpSection(**self.fsdp_config)

    @property
    def deepspeed(self) -> DeepSpeedSection:
        return DeepSpeedSection(**self.deepspeed_config)

    @property
    def parallelism(self) -> ParallelismSection:
        return ParallelismSection(**self.parallelism_config)

    @property
    def replica_group(self) -> FaultToleranceSection:
        return FaultToleranceSection(**self.fault_tolerance_config)

    def to_dict(self) -> dict[str, Any]:
        """The keys worth writing: everything used, plus unused keys only where they differ from the
        default."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.metadata["unused"] and value == default_of(f):
                continue
            out[f.name] = value
        return out


SECTIONS: dict[str, type] = {"fsdp_config": FsdpSection, "deepspeed_config": DeepSpeedSection,
                             "parallelism_config": ParallelismSection, "fault_tolerance_config": FaultToleranceSection}


def fields_of(model: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(model)}


def default_of(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
