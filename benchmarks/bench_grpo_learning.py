"""GRPO learns: the held-out reward of SmolLM2-135M-Instruct on two-digit sums, before and along a
GRPO run with LoRA and the exact_match reward: `python -m benchmarks.bench_grpo_learning`.

    python -m benchmarks.bench_grpo_learning                        # 4 segments of 5 steps, 2 ranks
    python -m benchmarks.bench_grpo_learning --segments 2 --steps 3 --held-out 16 --nproc 1

The run trains `--segments` x `--steps` steps through the command line (`torchrun -m ddptrain`), one
segment per launch: each relaunch resumes the run (the rollouts of a step derive from the step,
so the segments are one run), and between launches the run's weights (`ddptrain.load_model`) answer
`--held-out` prompts the run never trains on, greedily, in one continuous batch; their mean
exact_match reward is the curve's figure, beside the mean training reward of the segment's steps
(sampled at rl.temperature). A figure, not a test: the task, the model and the seeds are fixed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _train(model_dir: Path, prompts: Path, run_dir: Path, steps: int, total: int, args: argparse.Namespace) -> float:
    """Train the run up to `steps` (of a schedule of `total`); the launch's seconds."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
               "-m", "ddptrain", "model=hf", f"model.path={model_dir}", "model.lora.r=16", "data=prompts",
               "objective=grpo", f"data.paths=[{prompts}]", "reward.functions=[exact_match]",
               f"rl.group_size={args.group_size}", f"rl.max_new_tokens={args.max_new_tokens}",
               f"batch.global_size={args.prompts_per_step}", f"batch.micro_size={min(4, args.prompts_per_step)}",
               "batch.seq_len=96", f"trainer.max_steps={steps}", f"optim.decay_steps={total}", "trainer.log_every=1",
               f"optim.lr={args.lr}",
               "optim.warmup_steps=0", "logger.progress=lines", f"run.dir={run_dir}"]
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
    if result.returncode != 0:
        sys.exit(f"the GRPO run failed:\n{result.stderr[-4000:]}")
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--segments", type=int, default=4, help="launches, each --steps steps")
    parser.add_argument("--steps", type=int, default=5, help="GRPO steps per segment")
    parser.add_argument("--held-out", type=int, default=48, help="held-out prompts evaluated after each segment")
    parser.add_argument("--nproc", type=int, default=2, help="ranks")
    parser.add_argument("--lr", type=float, default=2e-4, help="the LoRA adapter's learning rate")
    parser.add_argument("--prompts-per-step", type=int, default=8, help="prompts per GRPO step (batch.global_size)")
    parser.add_argument("--group-size", type=int, default=8, help="completions per prompt (rl.group_size)")
    parser.add_argument("--max-new-tokens", type=int, default=16,
                        help="tokens per completion, in training and in the held-out evaluation")
    args = parser.parse_args(argv)

    import ddptrain
    import transformers
    from tests.data.chats import write_jsonl
    from tests.real_model import smollm2_dir
    from tests.rl.sums import held_out_reward, sum_prompts

    model_dir = smollm2_dir()
    tokenizer_file = str(model_dir / "tokenizer.json")
    work = Path(tempfile.mkdtemp(prefix="bench_grpo_learning_"))
    try:
        prompts = work / "sums.jsonl"
        write_jsonl(prompts, sum_prompts(256, seed=0))
        held_out = sum_prompts(args.held_out, seed=1)
        run_dir, total = work / "run", args.segments * args.steps
        print(f"benchmarks.bench_grpo_learning: SmolLM2-135M-Instruct + LoRA r=16, two-digit sums, exact_match; "
              f"{args.prompts_per_step} prompts x {args.group_size} completions of <= {args.max_new_tokens} tokens "
              f"per step, {args.nproc} rank(s), lr {args.lr}; "
              f"held-out: {args.held_out} prompts, greedy")
        print(f"{'step':>5} {'train reward':>13} {'held-out reward':>16} {'seconds':>8}")
        base = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
        print(f"{0:>5} {'-':>13} {held_out_reward(base, tokenizer_file, held_out, args.max_new_tokens):>16.3f} {'-':>8}", flush=True)
        del base
        for segment in range(1, args.segments + 1):
            steps = segment * args.steps
            seconds = _train(model_dir, prompts, run_dir, steps, total, args)
            records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
            rewards = [r["reward"] for r in records if steps - args.steps < r["step"] <= steps and r["reward"] is not None]
            reward = held_out_reward(ddptrain.load_model(run_dir), tokenizer_file, held_out, args.max_new_tokens)
            print(f"{steps:>5} {sum(rewards) / max(len(rewards), 1):>13.3f} {reward:>16.3f} {seconds:>8.0f}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
