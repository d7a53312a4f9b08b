"""TRL's DPOTrainer on one rank of `benchmarks.bench_peer --mode dpo` (run under torchrun; imports nothing of ddptrain).

    torchrun --standalone --nproc_per_node=2 benchmarks/trl_dpo_worker.py --model-dir DIR --pairs pairs.jsonl \
        --out OUT --micro 4 --accumulation 2 --steps 30 --timed-from 5 --lora-r 16

DPOConfig with its default padding (each microbatch's 2 x micro sequences, chosen then rejected,
padded to the longest, with an attention mask) and default dataloader; loss sigmoid, beta 0.1;
`--lora-r`: a peft LoRA of that rank on every linear layer, whose reference is the base with the
adapter disabled; without it, full fine-tuning against a frozen copy of the model (TRL's own
choice). fp32, no gradient checkpointing, DDP with find_unused_parameters=False. Rank 0 writes
OUT/result.json: the pairs and padded positions of steps timed_from+1..steps, counted on every rank
and summed, rank 0's seconds between the ends of steps timed_from and steps, the pairs and
completion tokens of the whole tokenized dataset (to check that both sides train the same) and rank
0's peak resident set size.
"""

from __future__ import annotations

import time

import trl_common


def main() -> None:
    args = trl_common.parser(__doc__.splitlines()[0], "--pairs").parse_args()

    import datasets
    import transformers
    from trl import DPOConfig, DPOTrainer

    pairs, padded, step_ends = {}, {}, {}

    class CountingTrainer(DPOTrainer):
        def training_step(self, model, inputs, *rest, **kwargs):
            step = self.state.global_step + 1  # the optimizer step this microbatch belongs to
            pairs[step] = pairs.get(step, 0) + inputs["input_ids"].shape[0] // 2  # chosen rows, then rejected
            padded[step] = padded.get(step, 0) + inputs["input_ids"].numel()
            return super().training_step(model, inputs, *rest, **kwargs)

    class Clock(transformers.TrainerCallback):
        def on_step_end(self, targs, state, control, **kwargs):
            step_ends[state.global_step] = time.perf_counter()

    config = DPOConfig(max_length=None, beta=0.1, loss_type=["sigmoid"], **trl_common.trainer_settings(args))
    model, tokenizer, peft_config = trl_common.model_tokenizer_and_lora(args)
    records = datasets.load_dataset("json", data_files=args.pairs, split="train")
    trainer = CountingTrainer(model=model, args=config, train_dataset=records, processing_class=tokenizer,
                              callbacks=[Clock()], peft_config=peft_config)
    tokenized = trainer.train_dataset
    dataset = {"dataset_pairs": len(tokenized), "dataset_targets": sum(
        len(ids) for column in ("chosen_ids", "rejected_ids") for ids in tokenized[column])}
    trainer.train()
    del trainer, model
    trl_common.finish(args, {"pairs": pairs, "padded_tokens": padded}, step_ends, dataset)


if __name__ == "__main__":
    main()
