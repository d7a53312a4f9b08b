"""ddptrain against the Hugging Face Trainer on ragged data: valid target tokens per second.

    python -m benchmarks.bench_peer                    # 3 interleaved rounds, 2 gloo ranks on CPU
    python -m benchmarks.bench_peer --rounds 5 --contenders ddptrain-pack,hf-group,hf-rebalance
    python -m benchmarks.bench_peer --mode sft         # chats: data=sft against TRL's SFTTrainer (bench_peer_sft.py)
    python -m benchmarks.bench_peer --mode step        # one rank's step per layout in one process (bench_peer_step.py)
    python -m benchmarks.bench_peer --mode dpo         # preference pairs: objective=dpo against TRL's DPOTrainer
    python -m benchmarks.bench_peer --mode grpo        # two-digit sums: objective=grpo against TRL's GRPOTrainer

Both train the same model, a small Llama built from a config.json (no weights, no download), on
the same ragged corpus: the standard-library sources of this interpreter cut into paragraphs
(`data=text data.split_by=paragraph`, byte tokens; most paragraphs are far shorter than seq_len,
so padding to the longest sequence wastes about a third to half of a random microbatch). The
Trainer gets exactly ddptrain's training examples (ddptrain.data.load_splits with the same data
config), each fed as `input_ids` = `labels` (the model shifts them), so a row of L tokens has the
same L - 1 valid targets on both sides. Same global batch (sequences per optimizer step), same
seq_len, fp32, AdamW (lr 1e-3, betas 0.9/0.95, weight decay 0.1, constant schedule), clipping at
1.0, 2 ranks with gloo, one thread per rank.

Contenders (each a fresh `torchrun --nproc_per_node=2` per round; default: all but hf-rebalance):

- ddptrain-pack: the CLI (`-m ddptrain model=hf model.path=DIR ...`) with batch.pack=true: rows of
  seq_len tokens holding several documents, attention kept inside each document from the rows'
  boundaries (trainer.attention=auto: the gather backend on CPU, no mask), positions restarting
  per document. A packed "sequence" is a row, so the global batch is set to
  the rows that hold as many valid targets as global_batch average examples (the step's work and
  its gradient noise stay comparable); microbatches of <= micro x seq_len tokens.
- ddptrain: the same CLI with token-budget microbatches (batch.micro_tokens = micro x seq_len: no
  microbatch holds more padded tokens than one of the Trainer's) and global_batch sequences.
  For both, the figure is metrics.jsonl's tokens_per_second: global valid target tokens divided
  by the seconds spent in data wait + Engine.step (ddptrain/metrics.py), over the windows after
  the first (warm-up) one.
- hf / hf-group / hf-rebalance: transformers.Trainer with average_tokens_across_devices=True (the
  exact global token mean), per_device_train_batch_size=micro and gradient accumulation to the same
  global batch, padding each microbatch to its longest row (no attention mask: right padding under
  a causal mask changes nothing, and a padding mask would only slow the Trainer down);
  train_sampling_strategy random | group_by_length | batch_rebalance (older transformers:
  group_by_length=True). Its figure: the valid targets of the steps after the warm-up window (every
  rank's, counted in training_step) divided by rank 0's wall time between those steps' ends.
- any of them with `+compile` (`ddptrain-pack+compile`, `hf-group+compile`, ...): the same run under
  torch.compile, `trainer.compile=true` for ddptrain and `torch_compile=True` for the Trainer
  (Inductor, default options on both sides). Compiling happens in the warm-up window, and whatever
  recompiles later (a new shape) counts in the timed steps, as it does in a run.

The timed steps (6..30 by default) are one full cycle of group_by_length's megabatches (50 x the
per-rank step batch, sorted longest first, so 25 steps on 2 ranks): timing only its first steps
would time only its longest, best-filled batches. Note what group_by_length buys its speed with:
its steps are no longer random samples (a step of long sequences, then shorter and shorter ones),
whereas ddptrain's layouts keep each step's global batch the seeded random sample and only decide
which rank and microbatch computes each example.

Beside each rate stands the contender's padding efficiency over the timed steps (valid targets /
positions computed), and beside each ratio the part of it that padding alone explains (the ratio of
the two efficiencies): a layout that computes as many positions per target as its peer can beat it
only by being faster per position.

Rounds run the contenders in alternating order (ABC, CBA, ...) so that the noise of a shared
machine hits all alike; the report is the per-round figures and the median of per-round ratios.
A figure, not a test.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.peer_common import BETAS, GRAD_CLIP, LR, SEED, WEIGHT_DECAY, data_overrides, execute, packed_rows, \
    stdlib_glob, torchrun, training_examples, windowed_rates, write_model_dir

CONTENDERS = ("ddptrain", "ddptrain-pack", "hf", "hf-group", "hf-rebalance")
DEFAULT_CONTENDERS = "ddptrain-pack,ddptrain,hf,hf-group"
HF_SAMPLING = {"hf": "random", "hf-group": "group_by_length", "hf-rebalance": "batch_rebalance"}
COMPILED = "+compile"  # a contender's suffix: trainer.compile=true, or the Trainer's torch_compile=True


# -- ddptrain through its CLI -----------------------------------------------------------------


def run_ddptrain(args, model_dir: Path, run_dir: Path, pack: bool, compiled: bool) -> float:
    global_size = args.pack_rows if pack else args.global_batch
    cmd = [*torchrun(args), "-m", "ddptrain", "model=hf", f"model.path={model_dir}", *data_overrides(args),
           f"batch.seq_len={args.seq_len}", f"batch.global_size={global_size}", f"batch.pack={str(pack).lower()}",
           f"batch.micro_tokens={args.micro_tokens}",
           f"trainer.max_steps={args.steps}", f"trainer.log_every={args.log_every}", "trainer.eval_examples=1",
           f"optim.lr={LR}", f"optim.betas=[{BETAS[0]},{BETAS[1]}]", f"optim.weight_decay={WEIGHT_DECAY}",
           "optim.schedule=constant", "optim.warmup_steps=0", f"trainer.grad_clip={GRAD_CLIP}",
           "trainer.precision=fp32", f"run.seed={SEED}", f"run.dir={run_dir}", "logger.progress=lines",
           f"trainer.compile={str(compiled).lower()}"]
    execute(cmd, args)
    return windowed_rates(run_dir, args.log_every)


# -- the Hugging Face Trainer (run under torchrun: --hf-worker) -------------------------------


def hf_worker(args) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist
    import transformers

    from ddptrain.contract.targets import IGNORE_INDEX

    torch.set_num_threads(args.threads)
    examples = training_examples(args)  # the same examples ddptrain trains on

    class Examples(torch.utils.data.Dataset):
        def __len__(self):
            return len(examples)

        def __getitem__(self, index):
            start, length = examples.starts[index], examples.lengths[index]
            return {"input_ids": np.asarray(examples.tokens[start:start + length], dtype=np.int64)}

    def pad_to_longest(features):
        width = max(len(f["input_ids"]) for f in features)
        input_ids = torch.zeros(len(features), width, dtype=torch.long)
        labels = torch.full((len(features), width), IGNORE_INDEX, dtype=torch.long)
        for row, feature in enumerate(features):
            ids = torch.from_numpy(feature["input_ids"])
            input_ids[row, :len(ids)] = ids
            labels[row, :len(ids)] = ids
        return {"input_ids": input_ids, "labels": labels}

    step_tokens: dict[int, int] = {}
    step_positions: dict[int, int] = {}
    step_ends: dict[int, float] = {}

    class CountingTrainer(transformers.Trainer):
        def training_step(self, model, inputs, *rest, **kwargs):
            step = self.state.global_step + 1  # the step this microbatch belongs to
            step_tokens[step] = step_tokens.get(step, 0) + int((inputs["labels"][:, 1:] != IGNORE_INDEX).sum())
            step_positions[step] = step_positions.get(step, 0) + inputs["input_ids"].numel()
            return super().training_step(model, inputs, *rest, **kwargs)

    class Clock(transformers.TrainerCallback):
        def on_step_end(self, targs, state, control, **kwargs):
            step_ends[state.global_step] = time.perf_counter()

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    accumulation, remainder = divmod(args.global_batch, args.micro * world_size)
    if remainder or not accumulation:
        raise SystemExit(f"global batch {args.global_batch} must be divisible by micro {args.micro} "
                         f"x world size {world_size}")
    sampling = {}
    fields = transformers.TrainingArguments.__dataclass_fields__
    if "train_sampling_strategy" in fields:
        sampling["train_sampling_strategy"] = HF_SAMPLING[args.hf_worker]
    elif args.hf_worker == "hf-group":
        sampling["group_by_length"] = True
    elif args.hf_worker != "hf":
        raise SystemExit(f"{args.hf_worker} needs transformers with train_sampling_strategy")
    targs = transformers.TrainingArguments(
        output_dir=args.out, per_device_train_batch_size=args.micro, gradient_accumulation_steps=accumulation,
        max_steps=args.steps, learning_rate=LR, adam_beta1=BETAS[0], adam_beta2=BETAS[1], weight_decay=WEIGHT_DECAY,
        max_grad_norm=GRAD_CLIP, lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch",
        average_tokens_across_devices=True, logging_steps=args.steps, save_strategy="no", eval_strategy="no",
        report_to=[], disable_tqdm=True, use_cpu=True, ddp_backend="gloo", dataloader_num_workers=0,
        remove_unused_columns=False, seed=SEED, ddp_find_unused_parameters=False, torch_compile=args.compile,
        **sampling)
    torch.manual_seed(SEED)
    config = transformers.AutoConfig.from_pretrained(args.model_dir, local_files_only=True)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    trainer = CountingTrainer(model=model, args=targs, train_dataset=Examples(), data_collator=pad_to_longest,
                              callbacks=[Clock()])
    trainer.train()
    if args.compile:
        from torch._dynamo.utils import counters

        if not counters["stats"]["unique_graphs"]:
            raise SystemExit("--compile: the Trainer's torch_compile=True compiled no graph")
    timed = range(args.log_every + 1, args.steps + 1)
    counts = torch.tensor([sum(step_tokens.get(step, 0) for step in timed),
                           sum(step_positions.get(step, 0) for step in timed)], dtype=torch.int64)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(counts)
    if int(os.environ.get("RANK", "0")) == 0:
        seconds = step_ends[args.steps] - step_ends[args.log_every]
        Path(args.out, "result.json").write_text(json.dumps({"tokens": int(counts[0]), "positions": int(counts[1]),
                                                             "seconds": seconds}))
    # A DDP module still alive when the process exits with its group sometimes aborts it ("terminate
    # called without an active exception"; see ddptrain/__main__.py): free both first.
    del trainer, model
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def run_hf(args, model_dir: Path, out_dir: Path, contender: str, compiled: bool) -> tuple[float, float]:
    cmd = [*torchrun(args), "-m", "benchmarks.bench_peer", "--hf-worker", contender, "--model-dir", str(model_dir),
           "--out", str(out_dir), *shared_flags(args), *(["--compile"] if compiled else [])]
    execute(cmd, args)
    result = json.loads((out_dir / "result.json").read_text())
    return result["tokens"] / result["seconds"], result["tokens"] / result["positions"]


# -- the comparison ---------------------------------------------------------------------------


def shared_flags(args) -> list[str]:
    return ["--seq-len", str(args.seq_len), "--global-batch", str(args.global_batch), "--micro", str(args.micro),
            "--steps", str(args.steps), "--log-every", str(args.log_every), "--threads", str(args.threads),
            "--data-glob", args.data_glob]


def run_contender(name: str, args, model_dir: Path, work: Path, round_index: int) -> tuple[float, float]:
    """(valid targets per second, padding efficiency: valid targets / positions computed) of one run."""
    out = work / f"{name}-{round_index}"
    base, compiled = name.removesuffix(COMPILED), name.endswith(COMPILED)
    if base.startswith("ddptrain"):
        return run_ddptrain(args, model_dir, out, pack=base == "ddptrain-pack", compiled=compiled)
    out.mkdir(parents=True)
    return run_hf(args, model_dir, out, base, compiled)


def main(argv: list[str] | None = None) -> None:
    modes = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    modes.add_argument("--mode", choices=("text", "sft", "step", "dpo", "grpo"), default="text")
    known, argv = modes.parse_known_args(sys.argv[1:] if argv is None else argv)
    if known.mode == "sft":
        from benchmarks.bench_peer_sft import main as sft_main

        return sft_main(argv)
    if known.mode == "step":
        from benchmarks.bench_peer_step import main as step_main

        return step_main(argv)
    if known.mode == "dpo":
        from benchmarks.bench_peer_dpo import main as dpo_main

        return dpo_main(argv)
    if known.mode == "grpo":
        from benchmarks.bench_peer_grpo import main as grpo_main

        return grpo_main(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("text", "sft", "step", "dpo", "grpo"), default="text",
                        help="text: ragged paragraphs against transformers.Trainer (the flags below); sft: chats "
                             "against TRL's SFTTrainer (python -m benchmarks.bench_peer --mode sft --help); step: "
                             "one rank's step per layout, interleaved in one process (--mode step --help); dpo: preference "
                             "pairs against TRL's DPOTrainer (--mode dpo --help); grpo: two-digit sums against TRL's "
                             "GRPOTrainer (--mode grpo --help)")
    parser.add_argument("--contenders", default=DEFAULT_CONTENDERS, help=f"comma-separated, of {', '.join(CONTENDERS)}, each also with {COMPILED} (torch.compile: "
                             "trainer.compile=true, the Trainer's torch_compile=True)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per run")
    parser.add_argument("--log-every", type=int, default=5, help="ddptrain's window; the first one is warm-up")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--global-batch", type=int, default=16, help="sequences per optimizer step")
    parser.add_argument("--micro", type=int, default=4,
                        help="Trainer: sequences per microbatch; ddptrain: micro x seq_len tokens per microbatch")
    parser.add_argument("--micro-tokens", type=int, default=None,
                        help="ddptrain's batch.micro_tokens (default: micro x seq_len, the Trainer's largest "
                             "microbatch)")
    parser.add_argument("--pack-rows", type=int, default=None,
                        help="ddptrain-pack's global batch in rows (default: the rows holding global-batch examples)")
    parser.add_argument("--width", type=int, default=128, help="the Llama's hidden size")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--data-glob", default=None, help="text files (default: this interpreter's stdlib *.py)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per run")
    parser.add_argument("--hf-worker", choices=tuple(HF_SAMPLING), help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)  # the worker's torch_compile
    args = parser.parse_args(argv)
    args.data_glob = args.data_glob or stdlib_glob()
    if args.hf_worker:
        return hf_worker(args)
    contenders = args.contenders.split(",")
    unknown = [name for name in contenders if name.removesuffix(COMPILED) not in CONTENDERS]
    if unknown or not any(c.startswith("ddptrain") for c in contenders):
        parser.error(f"--contenders: {unknown or contenders} (of {', '.join(CONTENDERS)}, each also with {COMPILED}; "
                     "at least one ddptrain)")
    figures: dict[str, list[float]] = {name: [] for name in contenders}
    efficiency: dict[str, list[float]] = {name: [] for name in contenders}
    with tempfile.TemporaryDirectory(prefix="bench_peer_") as tmp:
        work = Path(tmp)
        model_dir = work / "llama"
        write_model_dir(model_dir, args.seq_len, args.width, args.layers)
        examples = training_examples(args)  # builds the data cache before any contender starts
        args.pack_rows = args.pack_rows or packed_rows(args, examples)
        args.micro_tokens = args.micro_tokens or args.micro * args.seq_len
        print(f"benchmarks.bench_peer: Llama {args.layers} x {args.width}, seq_len {args.seq_len}, "
              f"{len(examples):,} training examples ({examples.valid_targets() / len(examples):.1f} valid targets "
              f"each on average), global batch {args.global_batch} sequences (ddptrain-pack: {args.pack_rows} packed "
              f"rows of {args.seq_len} tokens), micro {args.micro} sequences (ddptrain: <= {args.micro_tokens} padded "
              f"tokens), {args.world_size} gloo ranks x {args.threads} thread(s), fp32, steps "
              f"{args.log_every + 1}..{args.steps} of each run timed; contenders {', '.join(contenders)}", flush=True)
        for round_index in range(args.rounds):
            order = contenders if round_index % 2 == 0 else contenders[::-1]
            for name in order:
                rate, padding = run_contender(name, args, model_dir, work, round_index)
                figures[name].append(rate)
                efficiency[name].append(padding)
            print(f"round {round_index + 1}: " + ", ".join(f"{n} {figures[n][-1]:,.0f}" for n in contenders),
                  flush=True)
    print()
    report(contenders, figures, efficiency)


def report(contenders: list[str], figures: dict[str, list[float]], efficiency: dict[str, list[float]]) -> None:
    """Medians and per-round figures with padding efficiency; per-round ratios of ours to each peer.

    Beside each ratio stands what padding alone accounts for: the ratio of the two padding
    efficiencies (valid targets / positions computed). A layout that computes the same positions per
    token as its peer can only beat it by being faster per position.
    """
    width = max(14, *map(len, contenders))
    print(f"{'contender':{width}} {'median tok/s':>13} {'padding eff.':>13}   per round")
    for name in contenders:
        print(f"{name:{width}} {statistics.median(figures[name]):13,.0f} {statistics.median(efficiency[name]):13.3f}   "
              + " ".join(f"{value:,.0f}" for value in figures[name]))
    for ours in (c for c in contenders if c.startswith("ddptrain")):
        for peer in (c for c in contenders if c.startswith("hf")):
            ratios = [a / b for a, b in zip(figures[ours], figures[peer])]
            padding = statistics.median(efficiency[ours]) / statistics.median(efficiency[peer])
            print(f"{ours} / {peer}: median ratio {statistics.median(ratios):.2f} "
                  f"(rounds: {', '.join(f'{r:.2f}' for r in ratios)}); from padding alone {padding:.2f}")


if __name__ == "__main__":
    main()
