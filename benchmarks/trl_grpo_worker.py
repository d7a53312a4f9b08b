"""TRL's GRPOTrainer on one rank of `benchmarks.bench_peer --mode grpo` (run under torchrun; imports nothing of ddptrain).

    torchrun --standalone --nproc_per_node=2 benchmarks/trl_grpo_worker.py --model-dir DIR --prompts sums.jsonl \
        --out OUT --micro 8 --accumulation 1 --steps 3 --timed-from 1 --group-size 4 --max-new-tokens 16 --lora-r 16

GRPOConfig with num_generations=--group-size, max_completion_length=--max-new-tokens, plain
`generate` (use_transformers_continuous_batching=False: TRL's continuous batching fails on CPU
with transformers 5.x), temperature 1, top_p 1, loss_type dapo (the step's token mean), beta 0
(no reference), one update per rollout; per_device_train_batch_size=--micro completions, so a
step's generation batch is micro x ranks x accumulation completions. The reward: exact_match, the
same rule as ddptrain's built-in (the final answer after `####`, else in the last `\\boxed{}`, else
the last number, against the record's `answer`, numbers compared as numbers), written here with
TRL's reward signature. `--lora-r`: a peft LoRA of that rank on every linear layer; without it,
full fine-tuning. fp32, DDP with find_unused_parameters=False. Rank 0 writes OUT/result.json: the
completions and completion tokens of steps timed_from+1..steps (every rank's, summed), rank 0's
seconds between the ends of steps timed_from and steps (generation included) and its peak RSS.
"""

from __future__ import annotations

import re
import time

import trl_common

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_answer(text: str) -> str | None:
    if "####" in text:
        answer = text.rsplit("####", 1)[1].strip().splitlines()
        return answer[0].strip() if answer else None
    boxed = _BOXED.findall(text)
    if boxed:
        return boxed[-1].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def normal(answer) -> str:
    text = str(answer).strip().rstrip(".")
    try:
        return repr(float(text.replace(",", "")))
    except ValueError:
        return text


def exact_match(prompts, completions, answer, **fields) -> list[float]:
    """TRL's reward signature: 1 where the completion's final answer equals the record's answer."""
    texts = ["".join(m["content"] for m in c) if isinstance(c, list) else c for c in completions]
    return [float((found := final_answer(text)) is not None and normal(found) == normal(expected))
            for text, expected in zip(texts, answer)]


def main() -> None:
    parser = trl_common.parser(__doc__.splitlines()[0], "--prompts")
    parser.add_argument("--group-size", type=int, required=True)
    parser.add_argument("--max-new-tokens", type=int, required=True)
    args = parser.parse_args()

    import datasets
    import transformers
    from trl import GRPOConfig, GRPOTrainer

    completions, tokens, step_ends = {}, {}, {}

    class CountingTrainer(GRPOTrainer):
        def _prepare_inputs(self, inputs):  # generates (once per generation batch), then hands out a microbatch
            prepared = super()._prepare_inputs(inputs)
            step = self.state.global_step + 1  # the optimizer step this microbatch belongs to
            completions[step] = completions.get(step, 0) + prepared["completion_ids"].shape[0]
            tokens[step] = tokens.get(step, 0) + int(prepared["completion_mask"].sum())
            return prepared

    class Clock(transformers.TrainerCallback):
        def on_step_end(self, targs, state, control, **kwargs):
            step_ends[state.global_step] = time.perf_counter()

    config = GRPOConfig(num_generations=args.group_size, max_completion_length=args.max_new_tokens,
                        use_transformers_continuous_batching=False, temperature=1.0, top_p=1.0, loss_type="dapo",
                        beta=0.0, num_iterations=1, steps_per_generation=args.accumulation,
                        **trl_common.trainer_settings(args))
    model, tokenizer, peft_config = trl_common.model_tokenizer_and_lora(args)
    records = datasets.load_dataset("json", data_files=args.prompts, split="train")
    trainer = CountingTrainer(model=model, reward_funcs=[exact_match], args=config, train_dataset=records,
                              processing_class=tokenizer, callbacks=[Clock()], peft_config=peft_config)
    trainer.train()
    del trainer, model
    trl_common.finish(args, {"completions": completions, "completion_tokens": tokens}, step_ends, {})


if __name__ == "__main__":
    main()
