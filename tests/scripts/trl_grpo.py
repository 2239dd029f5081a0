"""TRL's GRPOTrainer or RLOOTrainer (online RL: completions sampled with `generate` inside the loop, scored, and
trained on) on hf_backend's engine (`hf_backend.on_engine`), or stock (`--stock`: transformers' Trainer on
Accelerate; under torchrun on a CPU it needs ACCELERATE_USE_CPU=1), on the tiny Llama and word-level tokenizer of
trl_sft.py. The reward counts
the completion's colour words; `--beta` > 0 adds the KL term against a reference model TRL builds from the saved path
(or, with LoRA, the policy with its adapter disabled). Strategies: DDP by the process count, `--fsdp` (FSDP2,
`--sharded` checkpoints), `--zero N`. Checkpoints every `--save-steps`; `--resume` continues from one. Rank 0 writes a
JSON report: the logged losses, rewards, KL, the completions' lengths and the trained parameters."""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

import torch
from datasets import Dataset
from transformers import LlamaConfig, LlamaForCausalLM
from trl_sft import WORDS, tokenizer

COLOURS = {"red", "green", "blue"}


def colour_reward(completions: list[str], **kwargs) -> list[float]:
    """How many colour words the completion has, less a little per other word."""
    return [sum(w in COLOURS for w in c.split()) - 0.1 * sum(w not in COLOURS for w in c.split()) for c in completions]


def prompts(n: int, seed: int) -> Dataset:
    r = random.Random(seed)
    things = [w for w in WORDS if w not in ("?", ":")]
    return Dataset.from_list([{"prompt": " ".join(r.choice(things) for _ in range(4)) + " answer :"}
                              for _ in range(n)])


def initial_model(tok, directory: Path, barrier: bool) -> Path:
    """The tiny Llama, saved once by rank 0 (TRL builds the reference model from the path)."""
    if int(os.environ.get("RANK", "0")) == 0 and not (directory / "config.json").exists():
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(
            vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id, bos_token_id=None)).save_pretrained(directory)
    if barrier and "RANK" in os.environ:
        import torch.distributed as dist

        dist.barrier()
    return directory


class StandInServer:
    """What TRL's VLLMClient does in server mode, recorded: the announced metadata, then each streamed tensor."""

    def __init__(self) -> None:
        self.metadata: list = []
        self.params: list[tuple[str, torch.Tensor]] = []
        self.reset = 0

    def update_named_params(self, metadata: list, named_params) -> None:
        self.metadata = [list(m) for m in metadata]
        self.params = [(name, tensor.detach().float().cpu().clone()) for name, tensor in named_params]

    def reset_prefix_cache(self) -> None:
        self.reset += 1


def sync_to_stand_in(trainer) -> dict | None:
    """TRL's own `VLLMGeneration.sync_weights` (server mode) with the trained model and the engine's accelerator,
    streaming into StandInServer instead of vLLM; every rank takes part in the gathers."""
    from trl.distributed import DistributedBackend
    from trl.generation.vllm_generation import VLLMGeneration

    sync = object.__new__(VLLMGeneration)  # no vLLM here: only the weight path is exercised
    server = StandInServer()
    sync.mode, sync.enable_sleep_mode, sync._weight_metadata = "server", False, None
    sync.model, sync.accelerator, sync.vllm_client = trainer.model, trainer.accelerator, server
    sync._dist = DistributedBackend(trainer.accelerator)
    sync.sync_weights()
    return {"metadata": server.metadata, "params": server.params, "reset": server.reset}


def merged_weights(trainer, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What vLLM must hold: the full weights under the base model's names, a LoRA adapter merged into them."""
    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    if not hasattr(model, "peft_config"):
        return {name: value.float() for name, value in full.items() if name != "lm_head.weight" or
                not model.config.tie_word_embeddings}
    merged = {}
    scale = model.peft_config["default"].lora_alpha / model.peft_config["default"].r
    for name, value in full.items():
        if "lora_" in name:
            continue
        base = name.removeprefix("base_model.model.").replace(".base_layer", "")
        value = value.float()
        prefix = name.removesuffix(".base_layer.weight")
        if name.endswith(".base_layer.weight"):
            value = value + scale * full[f"{prefix}.lora_B.default.weight"].float() @ \
                full[f"{prefix}.lora_A.default.weight"].float()
        merged[base] = value
    return merged


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--stock", action="store_true")
    p.add_argument("--rloo", action="store_true", help="TRL's RLOOTrainer instead of GRPOTrainer")
    p.add_argument("--lora", action="store_true")
    p.add_argument("--fsdp", action="store_true")
    p.add_argument("--sharded", action="store_true", help="FSDP's SHARDED_STATE_DICT checkpoints")
    p.add_argument("--zero", type=int, default=0)
    p.add_argument("--beta", type=float, default=0.0)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--save-steps", type=int, default=0)
    p.add_argument("--resume", default=None)
    p.add_argument("--batch-size", type=int, default=4, help="per process: completions per step")
    p.add_argument("--sync-weights", action="store_true", help="after training, TRL's vLLM weight sync (server mode) "
                   "into a stand-in receiver; the report holds what it received")
    args = p.parse_args()

    from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

    if args.rloo:
        GRPOTrainer, GRPOConfig = RLOOTrainer, RLOOConfig  # the same arguments here
    if not args.stock:
        import hf_backend

        GRPOTrainer, GRPOConfig = hf_backend.on_engine(GRPOTrainer, GRPOConfig)
    backend = {}
    if args.fsdp:
        backend = {"fsdp": "full_shard", "fsdp_config": {
            "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
            "state_dict_type": "SHARDED_STATE_DICT" if args.sharded else "FULL_STATE_DICT"}}
    if args.zero:
        backend = {"deepspeed": {"zero_optimization": {"stage": args.zero}, "train_micro_batch_size_per_gpu": "auto",
                                 "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}}
    config = GRPOConfig(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
        num_generations=4, max_completion_length=6, temperature=1.0, beta=args.beta, learning_rate=1e-2,
        logging_steps=1, save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
        report_to="none", disable_tqdm=True, seed=0, bf16=False, use_vllm=False, **backend)
    tok = tokenizer()
    saved = initial_model(tok, Path(args.output_dir) / "initial", barrier=config.world_size > 1)
    model = LlamaForCausalLM.from_pretrained(saved)
    peft_config = None
    if args.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    trainer = GRPOTrainer(model=model, reward_funcs=colour_reward, args=config, train_dataset=prompts(64, 0),
                          processing_class=tok, peft_config=peft_config)
    trainer.train(resume_from_checkpoint=args.resume)
    params = trainer.accelerator.get_state_dict(trainer.model_wrapped)
    unwrapped = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    trainable = sorted(n for n, q in unwrapped.named_parameters() if q.requires_grad)
    received = sync_to_stand_in(trainer) if args.sync_weights else None
    if trainer.is_world_process_zero():
        history = trainer.state.log_history

        def logged(key: str) -> list[float]:
            return [h[key] for h in history if key in h]

        flat = torch.cat([params[n].detach().float().flatten() for n in trainable])
        report = {"losses": logged("loss"), "rewards": logged("reward"), "kl": logged("kl"),
                  "lengths": logged("completions/mean_length"), "params": flat.tolist(), "trainable": trainable,
                  "world_size": config.world_size}
        if received is not None:
            merged = merged_weights(trainer, params)
            report["sync"] = {"names": [name for name, _ in received["params"]],
                              "metadata": received["metadata"], "expected": sorted(merged),
                              "largest_difference": max(float((value - merged[name]).abs().max())
                                                        for name, value in received["params"]),
                              "reset": received["reset"]}
        Path(args.out).write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
