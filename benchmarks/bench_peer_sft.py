"""ddptrain data=sft against TRL's SFTTrainer on chats: valid target tokens per second.

    python -m benchmarks.bench_peer --mode sft                 # 2 rounds (ABCD, DCBA), 2 gloo ranks on CPU
    python -m benchmarks.bench_peer --mode sft --rounds 4 --contenders ddptrain-budget,trl

Everything is written locally into a temporary directory, nothing is downloaded:

- chats.jsonl: multi-turn conversations (TRL's {"messages": [...]}) of pseudo-words, generated from a
  seed; assistant replies are 1 to 160 words, log-uniform, so the targets per chat differ widely.
  Every chat fits batch.seq_len + 1 tokens, so neither side drops or cuts one.
- a BPE tokenizer trained on the same words (tokenizers library, saved as PreTrainedTokenizerFast)
  whose ChatML template marks each assistant reply and its <|im_end|> with {% generation %}: both
  sides take transformers' assistant mask, so they train on the same targets (checked: the
  dataset's valid targets must be equal on both sides).
- a Llama (GQA, RoPE, SwiGLU) with random weights, save_pretrained with the tokenizer.

Contenders, each a fresh `torchrun --nproc_per_node=2` per round, the same global batch of chats,
AdamW (lr 1e-3, betas 0.9/0.95, weight decay 0.1, constant), clipping at 1.0, fp32, one thread per rank:

- ddptrain-micro / ddptrain-budget / ddptrain-pack: `-m ddptrain model=hf data=sft` with
  batch.micro_size=micro (TRL's layout); batch.micro_tokens=--micro-tokens (default seq_len: a
  rank's chats, longest first, grouped while rows x longest fits, so similar lengths share a
  microbatch; a budget of several chats lumps long and short ones together and pads about as much
  as micro_size); batch.pack=true batch.micro_size=micro (the step's chats packed whole into rows
  of <= seq_len positions, micro rows per microbatch: at most the positions of TRL's largest
  microbatch). Figure: metrics.jsonl's global valid targets over the seconds of data wait +
  Engine.step of rank 0, for the windows after the first (the warm-up).
- trl: benchmarks/trl_sft_worker.py, SFTConfig(assistant_only_loss=True) with its default padding
  (each microbatch padded to its longest chat) and dataloader, per_device_train_batch_size=micro
  and gradient accumulation to the same global batch; fp32 and no gradient checkpointing, like
  ddptrain (TRL's defaults are bf16 and checkpointing).
  Figure: the valid targets of the same steps (counted on every rank) over rank 0's wall time
  between the ends of those steps.

Rounds alternate the order (ABCD, DCBA, ...) so that a shared machine's noise hits all alike; the
report is per-round figures, padding efficiency (valid targets / padded positions) and the
median of per-round ratios to TRL. A figure, not a test.

`--real` runs the real model instead (tests/real_model.py: SmolLM2-135M-Instruct, vocabulary 49,152,
ChatML without generation markers, which TRL refuses for assistant-only loss) on WordNet
prompt-completion pairs (tests/real_text.py: "What does 'X' mean?" -> the gloss), completion-only
loss on both sides, for `--finetune lora,full` (LoRA r=16 on every linear layer; every weight):
ddptrain-default (nothing set but the global batch: packed, one row per microbatch), ddptrain-best (`--best`), trl (its default
padding) and trl-pack (packing=True: padding-free rows of seq_len; whether its attention keeps the
documents apart is probed and printed). Beside each rate stands rank 0's peak resident set size.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks.peer_common import BETAS, FINETUNES, GRAD_CLIP, LR, SEED, WEIGHT_DECAY, execute, run_chat_ddptrain, \
    sentence, write_chat_inputs, zipf_weights

CONTENDERS = ("ddptrain-micro", "ddptrain-budget", "ddptrain-pack", "trl")
REAL_CONTENDERS = ("ddptrain-default", "ddptrain-best", "trl", "trl-pack")
WORKER = Path(__file__).with_name("trl_sft_worker.py")


# -- the local inputs: chats (words, tokenizer and model: peer_common) -----------------------------------------


def chats(count: int, seed: int, words: list[str], fits) -> list[dict]:
    """Conversations of 1 to 3 turns (some with a system message), each accepted by `fits`."""
    rng = random.Random(seed)
    weights = zipf_weights(words)
    out = []
    while len(out) < count:
        messages = [{"role": "system", "content": sentence(rng, words, weights, rng.randint(3, 12))}] \
            if rng.random() < 0.3 else []
        for _ in range(rng.choice([1, 1, 2, 3])):
            messages.append({"role": "user", "content": sentence(rng, words, weights, rng.randint(3, 40))})
            reply = round(math.exp(rng.uniform(0, math.log(160))))  # 1..160 words, log-uniform
            messages.append({"role": "assistant", "content": sentence(rng, words, weights, reply)})
        if fits(messages):
            out.append({"messages": messages})
    return out


def write_inputs(work: Path, args) -> tuple[Path, Path, Path]:
    """(model dir, chats.jsonl, val.jsonl) under `work`."""
    return write_chat_inputs(work, args, chats, (("chats.jsonl", args.chats), ("val.jsonl", 8)))


def ddptrain_data(args, model_dir: Path, train: Path, val: Path, cache: Path) -> list[str]:
    return ["data=sft", f"data.paths=[{train}]", f"data.val_paths=[{val}]", f"data.cache_dir={cache}",
            f"data.tokenizer={model_dir / 'tokenizer.json'}"]


def training_examples(args, model_dir: Path, train: Path, val: Path, cache: Path):
    """ddptrain's training examples (through its cache, which the runs then reuse)."""
    from ddptrain.config.compose import compose_config
    from ddptrain.data import load_splits

    cfg = compose_config(ddptrain_data(args, model_dir, train, val, cache))
    return load_splits(cfg.data, args.seq_len).train


# -- the contenders -----------------------------------------------------------------------------


def layout(name: str, args) -> list[str]:
    micro = f"batch.micro_size={args.micro}"
    return {"ddptrain-micro": [micro, "batch.pack=false"],
            "ddptrain-budget": [f"batch.micro_tokens={args.micro_tokens}"],
            "ddptrain-pack": ["batch.pack=true", micro], "ddptrain-default": [],
            "ddptrain-best": args.best.split()}[name]


def run_ddptrain(name: str, args, data: list[str], model_dir: Path, run_dir: Path,
                 extra: tuple[str, ...] = ()) -> tuple[float, float]:
    return run_chat_ddptrain(args, model_dir, run_dir, [*data, *layout(name, args), *extra])


def run_trl(args, model_dir: Path, train: Path, out: Path, options: tuple[str, ...] = (),
            micro: int | None = None) -> tuple[float, float, dict]:
    """`options`: the worker's own flags (--loss, --packing, --lora-r); `micro`: rows per device (packing)."""
    micro = micro or args.micro
    accumulation, remainder = divmod(args.global_batch, micro * args.world_size)
    if "--packing" in options:
        accumulation, remainder = 1, 0  # `micro` packed rows per device hold about the global batch
    if remainder or not accumulation:
        raise SystemExit(f"global batch {args.global_batch} must be divisible by micro {micro} x world size "
                         f"{args.world_size} for TRL's gradient accumulation")
    out.mkdir(parents=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.world_size}",
           str(WORKER), "--model-dir", str(model_dir), "--chats", str(train), "--out", str(out),
           "--micro", str(micro), "--accumulation", str(accumulation), "--steps", str(args.steps),
           "--timed-from", str(args.log_every), "--max-length", str(args.seq_len + 1), "--seed", str(SEED),
           "--lr", str(LR), "--betas", *map(str, BETAS), "--weight-decay", str(WEIGHT_DECAY),
           "--grad-clip", str(GRAD_CLIP), *options]
    execute(cmd, args, extra_env={"HF_DATASETS_CACHE": str(out / "datasets")})
    result = json.loads((out / "result.json").read_text())
    return result["valid_tokens"] / result["seconds"], result["valid_tokens"] / result["padded_tokens"], result


# -- the comparison -----------------------------------------------------------------------------


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_peer --mode sft",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--real", action="store_true",
                        help="the real model on WordNet pairs (contenders "
                             f"{', '.join(REAL_CONTENDERS)}; --chats counts pairs)")
    parser.add_argument("--contenders", default=None,
                        help=f"comma-separated, of {', '.join(CONTENDERS)} (--real: {', '.join(REAL_CONTENDERS)})")
    parser.add_argument("--finetune", default="lora,full", help="--real: lora and/or full, comma-separated")
    parser.add_argument("--best", default=None,
                        help="--real: ddptrain-best's overrides (default: packed, one microbatch per rank)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=25, help="optimizer steps per run")
    parser.add_argument("--log-every", type=int, default=5, help="steps 1..log-every are warm-up, not timed")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--global-batch", type=int, default=16, help="chats per optimizer step")
    parser.add_argument("--micro", type=int, default=4,
                        help="chats per microbatch (TRL, ddptrain-micro); packed rows (ddptrain-pack)")
    parser.add_argument("--micro-tokens", type=int, default=None,
                        help="ddptrain-budget's batch.micro_tokens (default: seq_len)")
    parser.add_argument("--chats", type=int, default=1000, help="conversations in chats.jsonl")
    parser.add_argument("--words", type=int, default=1500, help="distinct pseudo-words")
    parser.add_argument("--vocab", type=int, default=2048, help="the BPE tokenizer's vocabulary")
    parser.add_argument("--width", type=int, default=256, help="the Llama's hidden size")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per run")
    args = parser.parse_args(argv)
    known = REAL_CONTENDERS if args.real else CONTENDERS
    contenders = (args.contenders or ",".join(known)).split(",")
    if any(name not in known for name in contenders) or "trl" not in contenders or len(contenders) < 2:
        parser.error(f"--contenders {args.contenders}: of {', '.join(known)}, with trl and at least one ddptrain")
    args.finetune = args.finetune.split(",")
    if not args.finetune or any(mode not in FINETUNES for mode in args.finetune):
        parser.error(f"--finetune {','.join(args.finetune)}: of {', '.join(FINETUNES)}")
    args.best = args.best or f"batch.pack=true batch.micro_size={args.global_batch}"
    if args.steps <= args.log_every:
        parser.error(f"--steps {args.steps} must exceed --log-every {args.log_every} (the warm-up steps)")
    args.contenders = contenders
    args.micro_tokens = args.micro_tokens or args.seq_len
    return args


def describe(args, examples) -> str:
    targets, lengths = examples.targets_per_example(), examples.lengths
    return (f"benchmarks.bench_peer --mode sft: Llama {args.layers} x {args.width}, vocab {args.vocab}, "
            f"{len(examples):,} chats of {int(lengths.min())}..{int(lengths.max())} tokens (mean "
            f"{lengths.mean():.0f}), {examples.valid_targets() / len(examples):.1f} valid targets each on average "
            f"({int(targets.min())}..{int(targets.max())}), seq_len {args.seq_len}, global batch {args.global_batch} "
            f"chats, micro {args.micro} chats (packed: rows), budget {args.micro_tokens} padded positions, "
            f"{args.world_size} gloo ranks x {args.threads} thread(s), fp32, steps {args.log_every + 1}..{args.steps} "
            f"of each run timed; contenders {', '.join(args.contenders)}")


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.real:
        return main_real(args)
    rates: dict[str, list[float]] = {name: [] for name in args.contenders}
    efficiency: dict[str, list[float]] = {name: [] for name in args.contenders}
    with tempfile.TemporaryDirectory(prefix="bench_peer_sft_") as tmp:
        work = Path(tmp)
        model_dir, train, val = write_inputs(work, args)
        data = ddptrain_data(args, model_dir, train, val, work / "cache")
        examples = training_examples(args, model_dir, train, val, work / "cache")
        print(describe(args, examples), flush=True)
        for round_index in range(args.rounds):
            for name in args.contenders if round_index % 2 == 0 else args.contenders[::-1]:
                out = work / f"{name}-{round_index}"
                if name != "trl":
                    rate, padding = run_ddptrain(name, args, data, model_dir, out)
                else:
                    rate, padding, result = run_trl(args, model_dir, train, out)
                    ours = (len(examples), examples.valid_targets())
                    if (result["dataset_examples"], result["dataset_targets"]) != ours:
                        raise RuntimeError(f"TRL's dataset holds {result['dataset_examples']} chats with "
                                           f"{result['dataset_targets']} targets, ddptrain's {ours[0]} with {ours[1]}: "
                                           "they would not train the same")
                rates[name].append(rate)
                efficiency[name].append(padding)
            print(f"round {round_index + 1}: " + ", ".join(f"{n} {rates[n][-1]:,.0f}" for n in args.contenders),
                  flush=True)
    report(args, rates, efficiency)


def report(args, rates: dict[str, list[float]], efficiency: dict[str, list[float]]) -> None:
    """Per-round figures, medians and padding efficiency; per-round ratios to TRL and their median."""
    print()
    print(f"{'valid targets/s':22}" + "".join(f"{f'round {r}':>10}" for r in range(1, args.rounds + 1))
          + f"{'median':>10}{'padding eff.':>14}")
    for name, values in rates.items():
        print(f"{name:22}" + "".join(f"{v:10,.0f}" for v in values) + f"{statistics.median(values):10,.0f}"
              f"{statistics.median(efficiency[name]):14.3f}")
    ratios = {name: [ours / peer for ours, peer in zip(values, rates["trl"])]
              for name, values in rates.items() if name != "trl"}
    for name, values in ratios.items():
        print(f"{name + ' / trl':22}" + "".join(f"{r:10.2f}" for r in values) + f"{statistics.median(values):10.2f}")
    best = max(ratios, key=lambda name: statistics.median(ratios[name]))
    print(f"best ddptrain layout: {best}, median ratio {statistics.median(ratios[best]):.2f} (target >= 1.3)")


# -- the real model ------------------------------------------------------------------------------


def real_inputs(args) -> tuple[Path, Path, Path]:
    """(SmolLM2's directory, train pairs, val pairs): built once per machine into the tests' cache."""
    import pytest

    from tests.real_model import smollm2_dir
    from tests.real_text import wordnet_records

    try:
        return smollm2_dir(), wordnet_records(args.chats, seed=1), wordnet_records(8, seed=2)
    except pytest.skip.Exception as missing:
        raise SystemExit(f"--real needs the real model and WordNet: {missing}") from None


def trl_packing_mixes_documents(model_dir: Path, train: Path) -> float:
    """The largest logit difference between two pairs in one row of TRL's padding-free collator (what
    packing=True feeds the model) and each pair alone: 0 keeps the documents apart."""
    import torch
    import transformers
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                              attn_implementation="sdpa").eval()
    pairs = [json.loads(line) for line in train.read_text().splitlines()[:2]]
    ids = [tokenizer(pair["prompt"] + pair["completion"])["input_ids"] for pair in pairs]
    batch = DataCollatorForLanguageModeling(pad_token_id=tokenizer.eos_token_id, padding_free=True)(
        [{"input_ids": row} for row in ids])
    with torch.no_grad():
        packed = model(**{key: value for key, value in batch.items() if key != "labels"}).logits[0]
        alone = torch.cat([model(torch.tensor([row])).logits[0] for row in ids])
    return float((packed - alone).abs().max())


def packed_rows_per_device(args, train: Path, model_dir: Path) -> int:
    """TRL's packed rows of seq_len per device that hold about the global batch's positions."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    pairs = [json.loads(line) for line in train.read_text().splitlines()[:200]]
    mean = statistics.mean(len(tokenizer(p["prompt"] + p["completion"])["input_ids"]) for p in pairs)
    return max(1, round(args.global_batch * mean / (args.seq_len * args.world_size)))


def peak_rss(run_dir: Path) -> int:
    """Rank 0's peak resident set size: the last metrics.jsonl line's."""
    return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["peak_memory_bytes"]


def main_real(args) -> None:
    model_dir, train, val = real_inputs(args)
    data = ["data=sft", f"data.paths=[{train}]", f"data.val_paths=[{val}]"]
    rows = packed_rows_per_device(args, train, model_dir)
    mixed = trl_packing_mixes_documents(model_dir, train)
    print(f"benchmarks.bench_peer --mode sft --real: SmolLM2-135M-Instruct ({model_dir.name}), {args.chats} WordNet "
          f"prompt-completion pairs, completion-only loss, seq_len {args.seq_len}, global batch {args.global_batch} "
          f"pairs, TRL micro {args.micro} pairs (trl-pack: {rows} packed rows per device), ddptrain-best: {args.best}; "
          f"{args.world_size} gloo ranks x {args.threads} thread(s), fp32, steps {args.log_every + 1}..{args.steps} "
          f"timed; peak: rank 0's peak RSS", flush=True)
    print(f"trl-pack keeps documents apart: {'yes' if mixed < 1e-4 else 'NO'} (largest logit difference between a "
          f"packed row and its pairs alone: {mixed:.3g})", flush=True)
    figures: dict[str, dict[str, list[tuple[float, float]]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench_peer_sft_real_") as tmp:
        work = Path(tmp)
        for finetune in args.finetune:
            figures[finetune] = {name: [] for name in args.contenders}
            lora = ("--lora-r", "16") if finetune == "lora" else ()
            for round_index in range(args.rounds):
                for name in args.contenders if round_index % 2 == 0 else args.contenders[::-1]:
                    out = work / f"{finetune}-{name}-{round_index}"
                    if name.startswith("ddptrain"):
                        rate, _ = run_ddptrain(name, args, [*data, f"data.cache_dir={work / 'cache'}"], model_dir,
                                               out, tuple(FINETUNES[finetune]))
                        peak = peak_rss(out)
                    else:
                        packing = ("--packing",) if name == "trl-pack" else ()
                        options = ("--loss", "completion", *lora, *packing)
                        rate, _, result = run_trl(args, model_dir, train, out, options, micro=rows if packing else None)
                        peak = result["peak_rss_bytes"]
                    figures[finetune][name].append((rate, peak))
                print(f"{finetune} round {round_index + 1}: " + ", ".join(
                    f"{n} {figures[finetune][n][-1][0]:,.0f}" for n in args.contenders), flush=True)
    report_real(figures)


def report_real(figures: dict[str, dict[str, list[tuple[float, float]]]]) -> None:
    """Per fine-tuning mode: median valid targets/s and peak RSS of each contender, and both as ratios to
    TRL's (per-round rate ratios, their median)."""
    for finetune, contenders in figures.items():
        print(f"\n{finetune}: {'contender':18}{'median tok/s':>14}{'peak MiB':>10}{'x trl tok/s':>13}"
              f"{'x trl peak':>12}   per-round tok/s ratios")
        trl = contenders["trl"]
        for name, values in contenders.items():
            rates = [rate for rate, _ in values]
            ratios = [rate / peer for rate, (peer, _) in zip(rates, trl)]
            peak = statistics.median(peak for _, peak in values)
            print(f"{'':{len(finetune) + 2}}{name:18}{statistics.median(rates):14,.0f}{peak / 2**20:10,.0f}"
                  f"{statistics.median(ratios):13.2f}{peak / statistics.median(p for _, p in trl):12.2f}   "
                  + ", ".join(f"{ratio:.2f}" for ratio in ratios))
