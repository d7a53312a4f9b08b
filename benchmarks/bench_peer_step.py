"""One rank's optimizer step on packed rows against group_by_length's microbatches, in one process.

    python -m benchmarks.bench_peer --mode step --seq-len 1024
    python -m benchmarks.bench_peer --mode step --seq-len 256

bench_peer's end-to-end figures are separate torchrun launches, minutes apart; on a shared machine
the same command moves by 10-20% between them. This times only the step, of three loops built in
one process and interleaved step by step, so that drift hits all three alike:

- engine-pack: ddptrain's Engine on packed rows of the same corpus (the gather backend, documents
  kept apart from the rows' boundaries): what `ddptrain-pack` computes on one rank.
- engine-group: the Engine on rank 0's microbatches as transformers' group_by_length lays them out
  (megabatches of 50 step batches sorted longest first, cut into microbatches of `micro` dealt to
  the ranks in turn, each padded to its longest row).
- hand-group: a hand-written loop on the same microbatches: the model's forward with `labels` and
  `num_items_in_batch` (transformers' own loss, the exact global token mean), backward, clipping,
  torch AdamW: what transformers.Trainer's training step computes, without the Trainer around it.

Same Llama as bench_peer (random weights from a config.json), same examples (ddptrain's, through
its data cache), same optimizer settings, fp32, one thread. Every timed step index is run by each
loop in turn (the order alternating), over `--passes` passes; the report is valid targets per
second per loop, each loop's padding efficiency (valid targets / positions computed), and the
ratios. If engine-pack / hand-group is close to the ratio of padding efficiencies, the layouts cost
the same per position and packing's gain over group_by_length is bounded by padding alone.
A figure, not a test.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.peer_common import BETAS, GRAD_CLIP, LR, SEED, WEIGHT_DECAY, packed_rows, stdlib_glob, \
    training_examples, write_model_dir

LOOPS = ("engine-pack", "engine-group", "hand-group")
MEGABATCH_STEPS = 50  # transformers' LengthGroupedSampler sorts megabatches of 50 step batches


def group_by_length_steps(examples, steps: int, per_rank: int, world_size: int, micro: int, rng):
    """`steps` steps of rank 0: (input_ids, targets) microbatches of `micro` examples padded to their longest.

    As transformers lays them out: LengthGroupedSampler sorts each megabatch of MEGABATCH_STEPS x
    `per_rank` random examples longest first; the dataloader cuts that order into microbatches of
    `micro`, dealt to the ranks in turn; a rank's step is its next per_rank / micro of them."""
    import torch

    chosen = rng.choice(len(examples), steps * per_rank * world_size, replace=False)
    chunk = MEGABATCH_STEPS * per_rank
    ordered = np.concatenate([part[np.argsort(-examples.lengths[part], kind="stable")]
                              for part in np.split(chosen, range(chunk, len(chosen), chunk))])
    mine = [ordered[first:first + micro] for first in range(0, len(ordered), micro)][::world_size]
    per_step = per_rank // micro
    result = []
    for step in range(steps):
        microbatches = []
        for rows in mine[step * per_step:(step + 1) * per_step]:
            # The Trainer's layout, as bench_peer's hf worker feeds it: all L tokens of an example in,
            # its L - 1 targets out (examples.collate would give ddptrain's L - 1 input positions).
            width = int(examples.lengths[rows].max())
            inputs = torch.zeros(len(rows), width, dtype=torch.long)
            targets = torch.full((len(rows), width), -100, dtype=torch.long)
            for row, index in enumerate(rows):
                start, length = examples.starts[index], examples.lengths[index]
                tokens = torch.from_numpy(np.asarray(examples.tokens[start:start + length], dtype=np.int64))
                inputs[row, :length] = tokens
                targets[row, :length - 1] = tokens[1:]
            microbatches.append((inputs, targets))
        result.append(microbatches)
    return result


def packed_steps(examples, seq_len: int, steps: int, rows: int, micro: int, rng):
    """`steps` steps of `rows` random packed rows each, in microbatches of at most `micro` rows."""
    from ddptrain.data.packing import PackedExamples

    packed = PackedExamples.from_examples(examples, seq_len)
    result = []
    for _ in range(steps):
        ids = rng.choice(len(packed), rows, replace=False)
        result.append([packed.collate(ids[first:first + micro]) for first in range(0, rows, micro)])
    return result


class HandLoop:
    """transformers.Trainer's step without the Trainer: loss from `labels` over num_items_in_batch."""

    def __init__(self, model_dir: Path):
        import torch
        import transformers

        config = transformers.AutoConfig.from_pretrained(model_dir, local_files_only=True)
        self.model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa",
                                                                   dtype=torch.float32)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)

    def step(self, microbatches) -> None:
        import torch

        items = torch.tensor(sum(int((targets != -100).sum()) for _, targets in microbatches))
        for inputs, targets in microbatches:
            labels = inputs.clone()  # the model shifts labels: position t+1's label is t's target
            labels[:, 1:][targets[:, :-1] == -100] = -100
            self.model(input_ids=inputs, labels=labels, num_items_in_batch=items).loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), GRAD_CLIP)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def engine_loop(model_dir: Path, seq_len: int, packed: bool):
    import torch

    import ddptrain
    from ddptrain.models.adapters import adapter_for, adapter_of

    model_cfg = {"name": "hf", "path": str(model_dir), "attn_implementation": "sdpa"}
    model, spec = adapter_for(model_cfg).build(model_cfg, 256, seq_len)
    if packed:
        adapter_of(spec).use_attention(model, "gather", forced=True)  # trainer.attention=auto on CPU
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)
    return ddptrain.Engine(model, optimizer, "ddp", grad_clip=GRAD_CLIP)


def counts(steps) -> tuple[int, int]:
    """(valid targets, positions computed) of these steps."""
    targets = sum(int((y != -100).sum()) for step in steps for _, y in step)
    positions = sum(y.numel() for step in steps for _, y in step)
    return targets, positions


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("step",), default="step", help=argparse.SUPPRESS)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--global-batch", type=int, default=16, help="sequences per optimizer step, as bench_peer")
    parser.add_argument("--micro", type=int, default=4, help="sequences per microbatch (packed: rows)")
    parser.add_argument("--world-size", type=int, default=2, help="whose one rank's share each step is")
    parser.add_argument("--steps", type=int, default=25, help="timed steps per pass")
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per loop first")
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--data-glob", default=None, help="text files (default: this interpreter's stdlib *.py)")
    args = parser.parse_args(argv)
    args.data_glob = args.data_glob or stdlib_glob()

    import torch

    torch.set_num_threads(args.threads)
    per_rank, remainder = divmod(args.global_batch, args.world_size * args.micro)
    if remainder or per_rank < 1:
        parser.error(f"--global-batch {args.global_batch} must be a positive multiple of --micro {args.micro} x "
                     f"--world-size {args.world_size} (the Trainer's accumulation steps are whole)")
    per_rank *= args.micro
    examples = training_examples(args)
    rows = max(1, packed_rows(args, examples) // args.world_size)
    rng = np.random.default_rng(SEED)
    total = args.warmup + args.steps
    inputs = {"engine-group": group_by_length_steps(examples, total, per_rank, args.world_size, args.micro, rng),
              "engine-pack": packed_steps(examples, args.seq_len, total, rows, args.micro, rng)}
    inputs["hand-group"] = inputs["engine-group"]
    with tempfile.TemporaryDirectory(prefix="bench_peer_step_") as tmp:
        model_dir = Path(tmp) / "llama"
        write_model_dir(model_dir, args.seq_len, args.width, args.layers)
        loops = {}
        for name in LOOPS:
            torch.manual_seed(SEED)
            loops[name] = HandLoop(model_dir) if name == "hand-group" else engine_loop(
                model_dir, args.seq_len, packed=name == "engine-pack")
    print(f"benchmarks.bench_peer --mode step: Llama {args.layers} x {args.width}, seq_len {args.seq_len}, one rank "
          f"of {args.world_size}: {per_rank} sequences per step in microbatches of {args.micro} (group) against "
          f"{rows} packed rows of {args.seq_len} tokens; {args.steps} steps x {args.passes} passes, interleaved "
          f"step by step, {args.threads} thread(s), fp32", flush=True)
    for name, loop in loops.items():
        for step in inputs[name][:args.warmup]:
            loop.step(step)
    seconds = {name: [0.0] * args.passes for name in LOOPS}
    for number in range(args.passes):
        for index in range(args.warmup, total):
            order = LOOPS if (index + number) % 2 == 0 else LOOPS[::-1]
            for name in order:
                started = time.perf_counter()
                loops[name].step(inputs[name][index])
                seconds[name][number] += time.perf_counter() - started
    figures = {}
    print(f"\n{'loop':14} {'tok/s':>8} {'padding eff.':>13}   per pass")
    for name in LOOPS:
        targets, positions = counts(inputs[name][args.warmup:])
        rates = [targets / s for s in seconds[name]]
        figures[name] = (targets * args.passes / sum(seconds[name]), targets / positions)
        print(f"{name:14} {figures[name][0]:8,.0f} {figures[name][1]:13.3f}   " + " ".join(f"{r:,.0f}" for r in rates))
    for ours, peer in (("engine-pack", "hand-group"), ("engine-pack", "engine-group"), ("engine-group", "hand-group")):
        print(f"{ours} / {peer}: {figures[ours][0] / figures[peer][0]:.2f}; from padding alone "
              f"{figures[ours][1] / figures[peer][1]:.2f}")


if __name__ == "__main__":
    main()
