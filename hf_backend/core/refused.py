"""The Accelerate names (of `accelerate` and `accelerate.utils`) that hf_backend refuses, grouped by
why, and their one-line error. Plain data, importing nothing heavy: `hf_backend`'s own `__getattr__`
asks here."""

from __future__ import annotations

from .errors import HfBackendError

_REFUSED_GROUPS: dict[str, tuple[str, ...]] = {
    "big-model inference and offloading (device maps, meta-device init, CPU/disk offload) is not "
    "part of hf_backend; for inference load with transformers' from_pretrained(device_map=...)": (
        "init_empty_weights", "init_on_device", "cpu_offload", "cpu_offload_with_hook", "disk_offload",
        "dispatch_model", "infer_auto_device_map", "load_checkpoint_and_dispatch", "load_checkpoint_in_model",
        "get_balanced_memory", "get_max_memory", "check_device_map", "compute_module_sizes", "calculate_maximum_sizes",
        "get_max_layer_size", "offload_state_dict", "offload_weight", "load_offloaded_weight", "load_offloaded_weights",
        "save_offload_index", "OffloadedWeightsLoader", "PrefixedDataset", "set_module_tensor_to_device",
        "align_module_device", "named_module_tensors", "has_offloaded_params", "find_tied_parameters",
        "retie_parameters", "check_tied_parameters_in_config", "check_tied_parameters_on_same_device",
        "dtype_byte_size", "convert_file_size_to_int", "id_tensor_storage", "load_state_dict",
        "extract_submodules_state_dict", "get_module_children_bottom_up", "prepare_pippy", "big_modeling",
        "hooks", "inference"),
    "Megatron-LM is not supported; use FSDP or DeepSpeed ZeRO-3": (
        "MegatronLMPlugin", "MegatronLMDummyDataLoader", "MegatronLMDummyScheduler", "AbstractTrainStep",
        "BertTrainStep", "GPTTrainStep", "T5TrainStep", "avg_losses_across_data_parallel_group",
        "add_model_config_to_megatron_parser"),
    "fp8 training (TransformerEngine, MS-AMP, torchao) is not supported; use mixed_precision='bf16' or "
    "'fp16'": (
        "AORecipeKwargs", "FP8RecipeKwargs", "MSAMPRecipeKwargs", "TERecipeKwargs", "apply_fp8_autowrap",
        "contextual_fp8_autocast", "convert_model", "convert_model_to_fp8_ao", "filter_first_and_last_linear_layers",
        "has_ao_layers", "has_transformer_engine_layers", "check_cuda_fp8_capability", "torchao_required"),
    "Accelerate's own bitsandbytes loading is not supported: load the base with transformers' "
    "BitsAndBytesConfig(load_in_4bit=True) and train it under a LoRA adapter (QLoRA, docs/llm.md)": (
        "BnbQuantizationConfig", "load_and_quantize_model", "has_4bit_bnb_layers"),
    "TPUs (torch_xla) are not supported; hf_backend runs on CPUs and CUDA GPUs": ("install_xla", "prepare_tpu"),
    "pipeline parallelism is not supported; use "
    "ParallelismConfig(tp_size=..., cp_size=..., sp_size=..., dp_shard_size=...) or DeepSpeed ZeRO-3": (
        "TorchTensorParallelPlugin", "get_model_tp_size"),
    "an Accelerate internal of its DeepSpeed/FSDP integration; in hf_backend the strategy does "
    "this inside accelerator.prepare / save_state / load_state / save_model / get_state_dict": (
        "DeepSpeedEngineWrapper", "DeepSpeedOptimizerWrapper", "DeepSpeedSchedulerWrapper", "HfDeepSpeedConfig",
        "GatheredParameters", "deepspeed_required", "get_active_deepspeed_plugin", "map_pytorch_optim_to_deepspeed",
        "fsdp2_apply_ac", "fsdp2_canonicalize_names", "fsdp2_load_full_state_dict", "fsdp2_prepare_model",
        "fsdp2_switch_optimizer_parameters", "save_fsdp_model", "load_fsdp_model", "save_fsdp_optimizer",
        "load_fsdp_optimizer", "merge_fsdp_weights", "enable_fsdp_ram_efficient_loading",
        "disable_fsdp_ram_efficient_loading", "get_fsdp2_grad_scaler", "get_grad_scaler",
        "get_mixed_precision_context_manager", "ensure_weights_retied", "model_has_dtensor", "is_peft_model",
        "checkpointing", "optimizer", "scheduler", "data_loader"),
    "an internal of Accelerate's launcher; use `hf-backend launch` and `hf-backend config`": (
        "PrepareForLaunch", "prepare_deepspeed_cmd_env", "prepare_multi_gpu_env", "prepare_sagemager_args_inputs",
        "prepare_simple_launcher_cmd_env", "TORCH_LAUNCH_PARAMS", "convert_dict_to_env_variables",
        "purge_accelerate_environment", "get_cpu_distributed_information", "set_numa_affinity",
        "check_cuda_p2p_ib_support", "check_os_kernel", "get_gpu_info", "write_basic_config",
        "get_current_device_type", "are_libraries_initialized", "commands", "test_utils"),
    "Accelerate's checkpoint file names; hf_backend's checkpoints have their own layout "
    "(docs/engine.md): read them with accelerator.load_state": (
        "MODEL_NAME", "OPTIMIZER_NAME", "SCHEDULER_NAME", "SAMPLER_NAME", "SCALER_NAME", "RNG_STATE_NAME",
        "SAFE_MODEL_NAME", "SAFE_WEIGHTS_NAME", "SAFE_WEIGHTS_INDEX_NAME", "SAFE_WEIGHTS_PATTERN_NAME", "WEIGHTS_NAME",
        "WEIGHTS_INDEX_NAME", "WEIGHTS_PATTERN_NAME", "PROFILE_PATTERN_NAME", "TORCH_DISTRIBUTED_OPERATION_TYPES",
        "MITA_PROFILING_AVAILABLE_PYTORCH_VERSION", "XPU_PROFILING_AVAILABLE_PYTORCH_VERSION"),
    "an internal helper of Accelerate's with no counterpart "
    "in hf_backend; use torch or the standard library": (
        "CannotPadNestedTensorWarning", "TensorInformation", "is_tensor_information", "initialize_tensors",
        "get_data_structure", "copy_tensor_to_devices", "pad_input_tensors", "slice_tensors",
        "convert_outputs_to_fp32", "convert_to_fp32", "find_device", "ignorant_find_batch_size", "honor_type",
        "recursive_getattr", "get_pretty_name", "merge_dicts", "convert_bytes", "clean_state_dict_for_safetensors",
        "parse_choice_from_env"),
}
REFUSED_NAMES: dict[str, str] = {name: why for why, names in _REFUSED_GROUPS.items() for name in names}


def refuse(module: str, name: str) -> HfBackendError:
    """The one-line error for an Accelerate name hf_backend does not provide."""
    return HfBackendError(f"{module}.{name}: {REFUSED_NAMES[name]}")
