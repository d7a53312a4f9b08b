"""What the TRL workers of benchmarks.bench_peer (trl_sft_worker.py, trl_dpo_worker.py) share: their
flags, the Trainer settings both sides train with, the model and its LoRA, and the result file.

Imported by the workers as a sibling module (they run as scripts under torchrun, so benchmarks/ is
on their path); imports nothing of ddptrain.
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path


def parser(description: str, data_flag: str) -> argparse.ArgumentParser:
    """The shared flags; `data_flag` names the JSONL file of records."""
    parser = argparse.ArgumentParser(description=description)
    for flag in ("--model-dir", data_flag, "--out"):
        parser.add_argument(flag, required=True)
    for flag in ("--micro", "--accumulation", "--steps", "--timed-from", "--seed"):
        parser.add_argument(flag, type=int, required=True)
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--betas", type=float, nargs=2, required=True)
    parser.add_argument("--weight-decay", type=float, required=True)
    parser.add_argument("--grad-clip", type=float, required=True)
    parser.add_argument("--lora-r", type=int, default=0)
    return parser


def trainer_settings(args) -> dict:
    """The TrainingArguments both workers set: ddptrain's optimizer, fp32, no gradient checkpointing
    (TRL's defaults are bf16 and checkpointing), DDP over gloo on CPU, no saving or evaluation."""
    return dict(output_dir=args.out, per_device_train_batch_size=args.micro,
                gradient_accumulation_steps=args.accumulation, max_steps=args.steps, learning_rate=args.lr,
                adam_beta1=args.betas[0], adam_beta2=args.betas[1], weight_decay=args.weight_decay,
                max_grad_norm=args.grad_clip, lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch",
                bf16=False, fp16=False, gradient_checkpointing=False, ddp_find_unused_parameters=False,
                use_cpu=True, ddp_backend="gloo", logging_steps=args.timed_from, save_strategy="no",
                eval_strategy="no", report_to=[], disable_tqdm=True, seed=args.seed)


def model_tokenizer_and_lora(args):
    """(model in fp32 with sdpa, tokenizer, peft LoraConfig of rank --lora-r on every linear layer or None)."""
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model_dir, local_files_only=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model_dir, local_files_only=True,
                                                              dtype=torch.float32, attn_implementation="sdpa")
    if not args.lora_r:
        return model, tokenizer, None
    from peft import LoraConfig

    return model, tokenizer, LoraConfig(r=args.lora_r, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear",
                                        task_type="CAUSAL_LM")


def peak_rss_bytes() -> int:
    """This process's peak resident set: Linux's VmHWM, as ddptrain's runs read theirs (getrusage's
    ru_maxrss would also hold the peak of the process this one was exec'd from: torchrun's)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))  # kB


def finish(args, counts: dict[str, dict[int, int]], step_ends: dict[int, float], dataset: dict) -> None:
    """Rank 0 writes OUT/result.json: each of `counts` (per step, this rank's) summed over the timed steps
    and the ranks, the timed seconds, `dataset` and rank 0's peak RSS (VmHWM); then the process group ends."""
    import torch
    import torch.distributed as dist

    timed = range(args.timed_from + 1, args.steps + 1)
    totals = torch.tensor([sum(per_step.get(s, 0) for s in timed) for per_step in counts.values()])
    distributed = dist.is_available() and dist.is_initialized()
    if distributed:
        dist.all_reduce(totals)
    if not distributed or dist.get_rank() == 0:
        result = {**dict(zip(counts, map(int, totals))), **dataset,
                  "seconds": step_ends[args.steps] - step_ends[args.timed_from],
                  "peak_rss_bytes": peak_rss_bytes()}
        Path(args.out, "result.json").write_text(json.dumps(result))
    # A DDP module still alive when the process exits with its group sometimes aborts it ("terminate
    # called without an active exception"; see ddptrain/__main__.py): the caller freed its trainer.
    gc.collect()
    if distributed:
        dist.destroy_process_group()
