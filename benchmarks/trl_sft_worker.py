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

import time

import trl_common

IGNORE_INDEX = -100


def count_targets(dataset) -> int:
    """Valid targets of the tokenized dataset: its labels where it has them, else its loss mask, shifted."""
    if "labels" in dataset.column_names:
        return sum(sum(label != IGNORE_INDEX for label in labels[1:]) for labels in dataset["labels"])
    mask = "completion_mask" if "completion_mask" in dataset.column_names else "assistant_masks"
    return sum(sum(row[1:]) for row in dataset[mask])


def main() -> None:
    parser = trl_common.parser(__doc__.splitlines()[0], "--chats")
    parser.add_argument("--max-length", type=int, required=True)
    parser.add_argument("--loss", choices=("assistant", "completion"), default="assistant")
    parser.add_argument("--packing", action="store_true")
    args = parser.parse_args()

    import datasets
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

    config = SFTConfig(assistant_only_loss=args.loss == "assistant", packing=args.packing, max_length=args.max_length,
                       **trl_common.trainer_settings(args))
    model, tokenizer, peft_config = trl_common.model_tokenizer_and_lora(args)
    chats = datasets.load_dataset("json", data_files=args.chats, split="train")
    trainer = CountingTrainer(model=model, args=config, train_dataset=chats, processing_class=tokenizer,
                              callbacks=[Clock()], peft_config=peft_config)
    dataset = {"dataset_targets": int(count_targets(trainer.train_dataset)),
               "dataset_examples": len(trainer.train_dataset)}
    trainer.train()
    del trainer, model
    trl_common.finish(args, {"valid_tokens": valid, "padded_tokens": padded}, step_ends, dataset)


if __name__ == "__main__":
    main()
