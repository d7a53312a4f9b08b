"""ddptrain objective=grpo against TRL's GRPOTrainer on two-digit sums: seconds per step and peak memory.

    python -m benchmarks.bench_peer --mode grpo                      # tiny Llama, LoRA and full, 2 rounds
    python -m benchmarks.bench_peer --mode grpo --real --finetune lora --prompts-per-step 4 --group-size 4

Both sides train the same model on the same prompts with the same reward and sampling:

- sums.jsonl: two-digit sums as chat prompts with their answers (tests/rl/sums.py: "What is a + b?
  Reply with the number only." and `answer`), rendered with the model's chat template on both sides.
- the reward: exact_match on the answer (ddptrain's built-in `reward.functions=[exact_match]`; TRL:
  the same rule written with TRL's reward signature in benchmarks/trl_grpo_worker.py).
- each step: --prompts-per-step prompts, each with --group-size completions of at most
  --max-new-tokens tokens sampled at temperature 1, top_p 1 from the current policy; the token mean
  over the step's completion tokens (ddptrain's rl.loss_aggregation=token_mean, TRL's loss_type
  dapo with one generation per step), epsilon 0.2, no KL (beta 0: no reference), one update per
  rollout; AdamW (lr 1e-3, betas 0.9/0.95, weight decay 0.1, constant), clipping at 1.0, fp32,
  2 gloo ranks, one thread per rank; `--finetune lora` (r=16 on every linear layer, alpha 16) and/or
  `full`.
- the model: by default a tiny Llama with random weights over the pseudo-word BPE tokenizer of
  bench_peer --mode sft (ChatML; written here, nothing downloaded); `--real`: SmolLM2-135M-Instruct
  (tests/real_model.py), its tokenizer and template.

Contenders, each a fresh `torchrun --nproc_per_node=2` per round:

- ddptrain: `-m ddptrain model=hf data=prompts objective=grpo` with batch.global_size = prompts per
  step, batch.micro_size = one microbatch of prompts per rank (each with its whole group).
  Generation: ddptrain's own continuous-batching generator. Figure: per step, metrics.jsonl's
  generate_s + score_s + train_s + data_wait_s (rank 0), averaged over the steps after --log-every.
- trl: benchmarks/trl_grpo_worker.py, GRPOConfig with num_generations = group size,
  max_completion_length = max new tokens, plain `generate` (continuous batching off),
  per_device_train_batch_size = the completions of a rank's prompts, no accumulation.
  Figure: rank 0's wall time between the ends of step --log-every and the last step, per step
  (generation included).

Beside each figure stands rank 0's peak resident set size. Rounds alternate the order (AB, BA, ...)
so that a shared machine's noise hits both alike; the report is, per fine-tuning mode, the median
seconds per step and peak, and the per-round ratios to TRL. A figure, not a test.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks.peer_common import BETAS, FINETUNES, GRAD_CLIP, LR, SEED, WEIGHT_DECAY, execute, pseudo_words, \
    save_llama, torchrun, write_tokenizer

CONTENDERS = ("ddptrain", "trl")
WORKER = Path(__file__).with_name("trl_grpo_worker.py")


def write_inputs(work: Path, args) -> tuple[Path, Path]:
    """(model dir, sums.jsonl) under `work`: the real model from the tests' cache, or a tiny Llama."""
    import transformers

    from tests.data.chats import write_jsonl
    from tests.rl.sums import sum_prompts

    prompts = work / "sums.jsonl"
    write_jsonl(prompts, sum_prompts(args.prompts, seed=0))
    if args.real:
        import pytest

        from tests.real_model import smollm2_dir

        try:
            return smollm2_dir(), prompts
        except pytest.skip.Exception as missing:
            raise SystemExit(f"--real needs the real model: {missing}") from None
    model_dir = work / "llama"
    write_tokenizer(model_dir, pseudo_words(args.words, SEED), args.vocab)
    save_llama(model_dir, transformers.AutoTokenizer.from_pretrained(model_dir), args)
    return model_dir, prompts


def run_ddptrain(args, model_dir: Path, prompts: Path, run_dir: Path, finetune: str) -> tuple[float, int]:
    """(seconds per step, rank 0's peak memory in bytes)."""
    cmd = [*torchrun(args), "-m", "ddptrain", "model=hf", f"model.path={model_dir}", *FINETUNES[finetune],
           "data=prompts", "objective=grpo", f"data.paths=[{prompts}]",
           f"data.tokenizer={model_dir / 'tokenizer.json'}",
           f"data.cache_dir={run_dir.parent / 'cache'}", "reward.functions=[exact_match]",
           f"rl.group_size={args.group_size}", f"rl.max_new_tokens={args.max_new_tokens}", "rl.temperature=1.0",
           "rl.top_p=1.0", "rl.loss_aggregation=token_mean", "rl.beta=0.0",
           f"batch.seq_len={args.seq_len}", f"batch.global_size={args.prompts_per_step}",
           f"batch.micro_size={args.prompts_per_step // args.world_size}",
           f"trainer.max_steps={args.steps}", "trainer.log_every=1", "trainer.eval_examples=1",
           f"optim.lr={LR}", f"optim.betas=[{BETAS[0]},{BETAS[1]}]", f"optim.weight_decay={WEIGHT_DECAY}",
           "optim.schedule=constant", "optim.warmup_steps=0", f"trainer.grad_clip={GRAD_CLIP}",
           "trainer.precision=fp32", f"run.seed={SEED}", f"run.dir={run_dir}", "logger.progress=lines"]
    execute(cmd, args)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    timed = [r for r in records if r["step"] > args.log_every and r.get("generate_s") is not None]
    if not timed:
        raise RuntimeError(f"{run_dir}/metrics.jsonl has no step after {args.log_every}: {records}")
    seconds = [r["generate_s"] + r["score_s"] + r["train_s"] + r.get("data_wait_s", 0.0) for r in timed]
    return sum(seconds) / len(seconds), max(r["peak_memory_bytes"] for r in records if r.get("peak_memory_bytes"))


def run_trl(args, model_dir: Path, prompts: Path, out: Path, finetune: str) -> tuple[float, int]:
    """(seconds per step, rank 0's peak RSS in bytes)."""
    out.mkdir(parents=True)
    cmd = [*torchrun(args), str(WORKER), "--model-dir", str(model_dir), "--prompts", str(prompts), "--out", str(out),
           "--micro", str(args.prompts_per_step // args.world_size * args.group_size), "--accumulation", "1",
           "--steps", str(args.steps), "--timed-from", str(args.log_every), "--seed", str(SEED), "--lr", str(LR),
           "--betas", *map(str, BETAS), "--weight-decay", str(WEIGHT_DECAY), "--grad-clip", str(GRAD_CLIP),
           "--group-size", str(args.group_size), "--max-new-tokens", str(args.max_new_tokens),
           *(["--lora-r", "16"] if finetune == "lora" else [])]
    execute(cmd, args, extra_env={"HF_DATASETS_CACHE": str(out / "datasets")})
    result = json.loads((out / "result.json").read_text())
    expected = (args.steps - args.log_every) * args.prompts_per_step * args.group_size
    if result["completions"] != expected:
        raise RuntimeError(f"TRL trained {result['completions']} completions in the timed steps, not {expected}: "
                           "the two sides would not do the same work")
    return result["seconds"] / (args.steps - args.log_every), result["peak_rss_bytes"]


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_peer --mode grpo",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--real", action="store_true", help="the real model (SmolLM2-135M-Instruct)")
    parser.add_argument("--finetune", default="lora,full", help="lora and/or full, comma-separated")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per run")
    parser.add_argument("--log-every", type=int, default=1, help="steps 1..log-every are warm-up, not timed")
    parser.add_argument("--prompts-per-step", type=int, default=4, help="prompts per optimizer step (all ranks)")
    parser.add_argument("--group-size", type=int, default=4, help="completions per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="a completion's most tokens")
    parser.add_argument("--prompts", type=int, default=256, help="prompts in sums.jsonl")
    parser.add_argument("--seq-len", type=int, default=128, help="ddptrain's batch.seq_len: prompt + completion")
    parser.add_argument("--words", type=int, default=200, help="tiny model: pseudo-words of its tokenizer")
    parser.add_argument("--vocab", type=int, default=400, help="tiny model: the BPE tokenizer's vocabulary")
    parser.add_argument("--width", type=int, default=64, help="tiny model: the Llama's hidden size")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    args = parser.parse_args(argv)
    args.finetune = [name.strip() for name in args.finetune.split(",") if name.strip()]
    for name in args.finetune:
        if name not in FINETUNES:
            parser.error(f"--finetune: {name!r} is not one of {', '.join(FINETUNES)}")
    if args.prompts_per_step % args.world_size:
        parser.error(f"--prompts-per-step {args.prompts_per_step} must be divisible by --world-size {args.world_size}")
    if not 0 <= args.log_every < args.steps:
        parser.error(f"--log-every {args.log_every} must be below --steps {args.steps}: no step would be timed")
    return args


def describe(args) -> str:
    model = (" --real: SmolLM2-135M-Instruct" if args.real
             else f": Llama {args.layers} x {args.width}, vocab {args.vocab}")
    return (f"benchmarks.bench_peer --mode grpo{model}, two-digit sums, exact_match; {args.prompts_per_step} prompts "
            f"x {args.group_size} completions of <= {args.max_new_tokens} tokens per step, token mean, beta 0, "
            f"{args.world_size} gloo ranks x {args.threads} thread(s), fp32, steps {args.log_every + 1}..{args.steps} "
            f"of each run timed (generation included); peak: rank 0's peak RSS")


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    figures: dict[str, dict[str, list[tuple[float, int]]]] = {}
    work = Path(tempfile.mkdtemp(prefix="bench_peer_grpo_"))
    try:
        model_dir, prompts = write_inputs(work, args)
        print(describe(args), flush=True)
        for finetune in args.finetune:
            figures[finetune] = {name: [] for name in CONTENDERS}
            for round_index in range(args.rounds):
                for name in CONTENDERS if round_index % 2 == 0 else CONTENDERS[::-1]:
                    out = work / f"{finetune}-{name}-{round_index}"
                    run = run_ddptrain if name == "ddptrain" else run_trl
                    figures[finetune][name].append(run(args, model_dir, prompts, out, finetune))
                print(f"{finetune} round {round_index + 1}: " + ", ".join(
                    f"{n} {figures[finetune][n][-1][0]:.2f} s/step" for n in CONTENDERS), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(figures)


def report(figures: dict[str, dict[str, list[tuple[float, int]]]]) -> None:
    """Per fine-tuning mode: median seconds per step and peak RSS of each contender, and both as ratios
    to TRL's (the per-round ratios of seconds, their median)."""
    for finetune, contenders in figures.items():
        print(f"\n{finetune}: {'contender':12}{'s/step':>9}{'peak MiB':>10}{'x trl s/step':>14}"
              f"{'x trl peak':>12}   per-round s/step ratios")
        trl = contenders["trl"]
        for name, values in contenders.items():
            seconds = [s for s, _ in values]
            ratios = [s / peer for s, (peer, _) in zip(seconds, trl)]
            peak = statistics.median(p for _, p in values)
            print(f"{'':{len(finetune) + 2}}{name:12}{statistics.median(seconds):9.2f}{peak / 2**20:10,.0f}"
                  f"{statistics.median(ratios):14.2f}{peak / statistics.median(p for _, p in trl):12.2f}   "
                  + ", ".join(f"{ratio:.2f}" for ratio in ratios))


if __name__ == "__main__":
    main(sys.argv[1:])
