"""TRL's SFTTrainer on hf_backend's engine (`hf_backend.on_engine`), or stock (`--stock`), on a tiny Llama with a
word-level tokenizer built here: prompt-completion pairs (the prompt masked out of the loss), optionally packed
padding-free, with a LoRA adapter, under FSDP or DeepSpeed ZeRO, with checkpoints and a resume; `--load-after-config`
loads the model after the config, as TRL's scripts do (under ZeRO-3 it is then built partitioned). Rank 0 writes a
JSON report."""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

import torch
from datasets import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

WORDS = ["red", "green", "blue", "cat", "dog", "bird", "one", "two", "three", "big", "small", "the", "is", "what",
         "color", "animal", "number", "?", "answer", ":"]


def tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {word: i for i, word in enumerate(["<pad>", "<eos>", "<unk>", *WORDS])}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def pairs(n: int, seed: int) -> Dataset:
    """'what color is the big cat ? answer :' -> ' red' and the like: the completion is a function of the prompt."""
    r = random.Random(seed)
    kinds = {"color": ["red", "green", "blue"], "animal": ["cat", "dog", "bird"], "number": ["one", "two", "three"]}
    rows = []
    for _ in range(n):
        kind = r.choice(list(kinds))
        size, thing = r.choice(["big", "small"]), r.choice(kinds["animal"])
        answer = kinds[kind][(WORDS.index(thing) + (size == "big")) % 3]
        rows.append({"prompt": f"what {kind} is the {size} {thing} ? answer :", "completion": f" {answer}"})
    return Dataset.from_list(rows)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--stock", action="store_true", help="TRL's SFTTrainer on transformers and Accelerate")
    p.add_argument("--lora", action="store_true")
    p.add_argument("--qlora", action="store_true", help="with --lora: the model reloaded in 4 bits (bitsandbytes nf4)")
    p.add_argument("--packing", action="store_true")
    p.add_argument("--fsdp", action="store_true")
    p.add_argument("--zero", type=int, default=0, help="DeepSpeed ZeRO stage (2 or 3)")
    p.add_argument("--tied", action="store_true", help="lm_head tied to the input embeddings")
    p.add_argument("--bare-zero", action="store_true", help="a DeepSpeed config of the ZeRO stage alone")
    p.add_argument("--bf16", action="store_true", help="SFTConfig's default precision (the tests' default: fp32)")
    p.add_argument("--load-after-config", action="store_true", help="from_pretrained after SFTConfig, as TRL's scripts")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=4, help="per process")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--save-steps", type=int, default=0, help="a checkpoint every this many steps (0: none)")
    p.add_argument("--resume", default=None, help="a checkpoint directory")
    args = p.parse_args()

    from trl import SFTConfig, SFTTrainer

    if not args.stock:
        import hf_backend

        SFTTrainer, SFTConfig = hf_backend.on_engine(SFTTrainer, SFTConfig)  # the documented one-line change
    tok = tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id, bos_token_id=None, tie_word_embeddings=args.tied))
    if args.load_after_config:  # TRL's scripts: the arguments first, then from_pretrained (ZeRO-3: built partitioned)
        saved = Path(args.output_dir) / "initial"
        if int(os.environ.get("RANK", "0")) == 0:
            model.save_pretrained(saved)
        if torch.distributed.is_available() and "RANK" in os.environ:
            import hf_backend

            hf_backend.PartialState().wait_for_everyone()
    peft_config = None
    if args.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    backend = {"fsdp": "full_shard", "fsdp_config": {"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}} \
        if args.fsdp else {}
    if args.zero:
        backend = {"deepspeed": {"zero_optimization": {"stage": args.zero}, "train_micro_batch_size_per_gpu": "auto",
                                 "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}}
        if args.bare_zero:  # the stage alone, as many users write it
            backend = {"deepspeed": {"zero_optimization": {"stage": args.zero}}}
    config = SFTConfig(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum, learning_rate=5e-3, logging_steps=1,
        save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500, report_to="none",
        disable_tqdm=True, seed=0,
        bf16=args.bf16, packing=args.packing, max_length=64, dataloader_drop_last=True, **backend)
    if args.load_after_config:
        model = LlamaForCausalLM.from_pretrained(saved)
    if args.qlora:  # TRL's SFTTrainer prepares a quantized model for k-bit training itself (peft_config)
        from transformers import BitsAndBytesConfig

        base = Path(args.output_dir) / "base"
        if int(os.environ.get("RANK", "0")) == 0:
            model.save_pretrained(base)
        if "RANK" in os.environ:
            import hf_backend

            hf_backend.PartialState().wait_for_everyone()
        model = LlamaForCausalLM.from_pretrained(base, quantization_config=BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32))
    trainer = SFTTrainer(model=model, args=config, train_dataset=pairs(64, 0), processing_class=tok,
                         peft_config=peft_config)
    trainer.train(resume_from_checkpoint=args.resume)
    import accelerate

    seen_by_accelerate = accelerate.PartialState()  # what TRL's own calls are told
    params = trainer.accelerator.get_state_dict(trainer.model_wrapped)
    unwrapped = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    trainable = sorted(n for n, q in unwrapped.named_parameters() if q.requires_grad)
    if trainer.is_world_process_zero():
        flat = torch.cat([params[n].detach().float().flatten() for n in trainable])
        report = {
            "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "grad_norms": [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h],
            "num_tokens": [h.get("num_tokens") for h in trainer.state.log_history if "loss" in h],
            "params": flat.tolist(),
            "trainable": trainable,
            "world_size": config.world_size,
            "accelerate_world": [seen_by_accelerate.num_processes, seen_by_accelerate.process_index],
            "args_class": f"{type(config).__module__}.{type(config).__qualname__}",
            "round_trip": type(config)(**config.to_dict()).to_dict() == config.to_dict(),
        }
        Path(args.out).write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
