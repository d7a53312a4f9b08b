"""TRL's SFTTrainer on one rank of `benchmarks.bench_peer --mode sft` (run under torchrun; imports nothing of ddptrain).

    torchrun --standalone --nproc_per_node=2 benchmarks/trl_sft_worker.py --model-dir DIR --chats chats.jsonl \
        --out OUT --micro 4 --accumulation 2 --steps 30 --timed-from 5

SFTConfig(assistant_only_loss=True) with its default padding (each microbatch padded to its longest
chat, with an attention mask) and default dataloader (`--loss completion`: prompt-completion pairs and
TRL's completion-only loss; `--packing`: its packing=True, padding-free rows of --max-length; `--lora-r`:
a peft LoRA of that rank on every linear layer); fp32 and no gradient checkpointing (TRL
defaults to bf16 and checkpointing, ddptrain to neither); DDP with find_unused_parameters=False
(Trainer would turn it on once checkpointing is off). Rank 0 writes OUT/result.json: the valid
targets (labels != -100 after the shift) and padded positions of steps timed_from+1..steps,
counted on every rank and summed, rank 0's seconds between the ends of steps timed_from and steps,
the valid targets of the whole tokenized dataset (to check that both sides train the same) and rank
0's peak resident set size.
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import time
from pathlib import Path

IGNORE_INDEX = -100


def count_targets(dataset) -> int:
    """Valid targets of the tokenized dataset: its labels where it has them, else its loss mask, shifted."""
    if "labels" in dataset.column_names:
        return sum(sum(label != IGNORE_INDEX for label in labels[1:]) for labels in dataset["labels"])
    mask = "completion_mask" if "completion_mask" in dataset.column_names else "assistant_masks"
    return sum(sum(row[1:]) for row in dataset[mask])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag in ("--model-dir", "--chats", "--out"):
        parser.add_argument(flag, required=True)
    for flag in ("--micro", "--accumulation", "--steps", "--timed-from", "--max-length", "--seed"):
        parser.add_argument(flag, type=int, required=True)
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--betas", type=float, nargs=2, required=True)
    parser.add_argument("--weight-decay", type=float, required=True)
    parser.add_argument("--grad-clip", type=float, required=True)
    parser.add_argument("--loss", choices=("assistant", "completion"), default="assistant")
    parser.add_argument("--packing", action="store_true")
    parser.add_argument("--lora-r", type=int, default=0)
    args = parser.parse_args()

    import datasets
    import torch
    import torch.distributed as dist
    import transformers
    from trl import SFTConfig, SFTTrainer

    valid, padded, step_ends = {}, {}, {}

    class CountingTrainer(SFTTrainer):
        def training_step(self, model, inputs, *rest, **kwargs):
            step = self.state.global_step + 1  # the optimizer step this microbatch belongs to
            valid[step] = valid.get(step, 0) + int((inputs["labels"][:, 1:] != IGNORE_INDEX).sum())
            padded[step] = padded.get(step, 0) + inputs["input_ids"].numel()
            return super().training_step(model, inputs, *rest, **kwargs)

    class Clock(transformers.TrainerCallback):
        def on_step_end(self, targs, state, control, **kwargs):
            step_ends[state.global_step] = time.perf_counter()

    config = SFTConfig(
        output_dir=args.out, assistant_only_loss=args.loss == "assistant", packing=args.packing,
        max_length=args.max_length,
        per_device_train_batch_size=args.micro, gradient_accumulation_steps=args.accumulation, max_steps=args.steps,
        learning_rate=args.lr, adam_beta1=args.betas[0], adam_beta2=args.betas[1], weight_decay=args.weight_decay,
        max_grad_norm=args.grad_clip, lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch",
        bf16=False, fp16=False, gradient_checkpointing=False, ddp_find_unused_parameters=False,
        use_cpu=True, ddp_backend="gloo", logging_steps=args.timed_from, save_strategy="no", eval_strategy="no",
        report_to=[], disable_tqdm=True, seed=args.seed)
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model_dir, local_files_only=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model_dir, local_files_only=True,
                                                              dtype=torch.float32, attn_implementation="sdpa")
    chats = datasets.load_dataset("json", data_files=args.chats, split="train")
    peft_config = None
    if args.lora_r:
        from peft import LoraConfig

        peft_config = LoraConfig(r=args.lora_r, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear",
                                 task_type="CAUSAL_LM")
    trainer = CountingTrainer(model=model, args=config, train_dataset=chats, processing_class=tokenizer,
                              callbacks=[Clock()], peft_config=peft_config)
    dataset_targets = count_targets(trainer.train_dataset)
    trainer.train()

    timed = range(args.timed_from + 1, args.steps + 1)
    counts = torch.tensor([sum(valid.get(s, 0) for s in timed), sum(padded.get(s, 0) for s in timed)])
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(counts)
    if not dist.is_initialized() or dist.get_rank() == 0:
        result = {"valid_tokens": int(counts[0]), "padded_tokens": int(counts[1]),
                  "seconds": step_ends[args.steps] - step_ends[args.timed_from],
                  "dataset_targets": int(dataset_targets), "dataset_examples": len(trainer.train_dataset),
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}  # Linux: KiB
        Path(args.out, "result.json").write_text(json.dumps(result))
    # A DDP module still alive when the process exits with its group sometimes aborts it ("terminate
    # called without an active exception"; see ddptrain/__main__.py): free both first.
    del trainer, model
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
