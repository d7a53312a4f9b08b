"""ddptrain objective=dpo against TRL's DPOTrainer on preference pairs: pairs per second and peak memory.

    python -m benchmarks.bench_peer --mode dpo                 # 2 rounds (ABCD, DCBA), 2 gloo ranks on CPU
    python -m benchmarks.bench_peer --mode dpo --finetune lora --contenders ddptrain-pack,trl

Everything is written locally into a temporary directory, nothing is downloaded:

- pairs.jsonl: TRL's conversational pairs ({"prompt": [user], "chosen": [assistant], "rejected":
  [assistant]}) of pseudo-words from a seed; prompts of 3 to 40 words, each completion 1 to 160
  words, log-uniform, so pairs differ widely in length. Both sequences of every pair fit
  batch.seq_len + 1 tokens, so neither side drops or cuts one (checked: both sides' datasets hold
  the same pairs and completion tokens).
- the pseudo-word BPE tokenizer (ChatML) and a Llama with random weights of bench_peer --mode sft.

Contenders, each a fresh `torchrun --nproc_per_node=2` per round, the same global batch of pairs,
sigmoid DPO with beta 0.1, AdamW (lr 1e-3, betas 0.9/0.95, weight decay 0.1, constant), clipping at
1.0, fp32, one thread per rank, for `--finetune lora` (r=16 on every linear layer, alpha 16; the
reference is the base with the adapter disabled on both sides) and `full` (every weight; the
reference a frozen copy on both sides):

- ddptrain-default: `-m ddptrain model=hf data=preference objective=dpo` with nothing set but the
  global batch (the default layout: the step's pairs packed whole, one row per microbatch).
- ddptrain-micro: batch.micro_size=micro (TRL's layout).
- ddptrain-pack: batch.pack=true batch.micro_size=micro (the step's pairs packed whole, chosen and
  rejected as two documents of a row of <= 2 x seq_len positions; micro rows per microbatch: at most
  the positions of TRL's largest microbatch).
  Figure: metrics.jsonl's global pairs per second (data wait + Engine.step of rank 0, the reference
  forward included), for the windows after the first (the warm-up).
- trl: benchmarks/trl_dpo_worker.py, DPOConfig with its default padding and dataloader,
  per_device_train_batch_size=micro and gradient accumulation to the same global batch.
  Figure: the pairs of the same steps over rank 0's wall time between the ends of those steps.

`--real` runs the real model instead (tests/real_model.py: SmolLM2-135M-Instruct, its own tokenizer
and ChatML template) on WordNet preference pairs built here (tests/real_text.py): "What does 'X'
mean?" -> X's gloss as chosen, the next sampled word's gloss as rejected, both rendered with the
model's template on both sides; --width, --layers, --heads, --vocab and --words are then unused.

Beside each rate stands rank 0's peak resident set size. Rounds alternate the order (ABCD, DCBA,
...) so that a shared machine's noise hits all alike; the report is, per fine-tuning mode, the
median rates and peaks and the median of per-round ratios to TRL, then each contender's peak with
LoRA beside its peak with full fine-tuning. A figure, not a test.
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
    sentence, torchrun, write_chat_inputs, zipf_weights

CONTENDERS = ("ddptrain-default", "ddptrain-micro", "ddptrain-pack", "trl")
LAYOUTS = {"ddptrain-default": lambda args: [], "ddptrain-micro": lambda args: [f"batch.micro_size={args.micro}"],
           "ddptrain-pack": lambda args: ["batch.pack=true", f"batch.micro_size={args.micro}"]}
WORKER = Path(__file__).with_name("trl_dpo_worker.py")


# -- the local inputs ------------------------------------------------------------------------------


def pairs(count: int, seed: int, words: list[str], fits) -> list[dict]:
    """Conversational pairs whose prompt + chosen and prompt + rejected are both accepted by `fits`."""
    rng = random.Random(seed)
    weights = zipf_weights(words)
    out = []
    while len(out) < count:
        prompt = [{"role": "user", "content": sentence(rng, words, weights, rng.randint(3, 40))}]
        chosen, rejected = ([{"role": "assistant", "content": sentence(rng, words, weights, round(
            math.exp(rng.uniform(0, math.log(160)))))}] for _ in range(2))  # 1..160 words, log-uniform
        if chosen != rejected and fits(prompt + chosen) and fits(prompt + rejected):
            out.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return out


def write_inputs(work: Path, args) -> tuple[Path, Path, Path]:
    """(model dir, pairs.jsonl, val.jsonl) under `work`."""
    return write_chat_inputs(work, args, pairs, (("pairs.jsonl", args.pairs), ("val.jsonl", 4)))


def wordnet_pairs(count: int, seed: int, fits) -> list[dict]:
    """Conversational pairs of WordNet glosses: "What does 'X' mean?" -> X's gloss (chosen) or the next
    sampled word's (rejected), each accepted by `fits(messages)`."""
    from tests.real_text import question, wordnet_glosses

    glosses = wordnet_glosses()
    rng = random.Random(seed)
    out = []
    while len(out) < count:
        (word, gloss), (_, other) = rng.sample(glosses, 2)
        prompt = [{"role": "user", "content": question(word)}]
        chosen, rejected = ([{"role": "assistant", "content": text}] for text in (gloss, other))
        if gloss != other and fits(prompt + chosen) and fits(prompt + rejected):
            out.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return out


def write_real_inputs(work: Path, args) -> tuple[Path, Path, Path]:
    """(SmolLM2's directory, pairs.jsonl, val.jsonl): the real model from the tests' cache, the pairs here."""
    import pytest
    import transformers

    from tests.real_model import smollm2_dir

    try:
        model_dir = smollm2_dir()
        tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)

        def fits(messages) -> bool:
            ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
            return len(ids) <= args.seq_len + 1

        paths = []
        for seed, (name, count) in enumerate((("pairs.jsonl", args.pairs), ("val.jsonl", 4)), start=1):
            path = work / name
            path.write_text("".join(json.dumps(record) + "\n" for record in wordnet_pairs(count, seed, fits)))
            paths.append(path)
    except pytest.skip.Exception as missing:
        raise SystemExit(f"--real needs the real model and WordNet: {missing}") from None
    return (model_dir, *paths)


def ddptrain_data(model_dir: Path, train: Path, val: Path, cache: Path) -> list[str]:
    return ["data=preference", "objective=dpo", f"data.paths=[{train}]", f"data.val_paths=[{val}]",
            f"data.cache_dir={cache}", f"data.tokenizer={model_dir / 'tokenizer.json'}"]


def training_pairs(args, data: list[str]):
    """ddptrain's training pairs (through its cache, which the runs then reuse)."""
    from ddptrain.config.compose import compose_config
    from ddptrain.data import load_splits

    return load_splits(compose_config(data).data, args.seq_len).train


# -- the contenders --------------------------------------------------------------------------------


def run_ddptrain(name: str, args, data: list[str], model_dir: Path, run_dir: Path, finetune: str) -> tuple[float, int]:
    """(pairs per second, rank 0's peak RSS in bytes)."""
    overrides = [*data, *LAYOUTS[name](args), *FINETUNES[finetune]]
    rate, _ = run_chat_ddptrain(args, model_dir, run_dir, overrides)  # with objective=dpo its "tokens" are pairs
    peak = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["peak_memory_bytes"]
    return rate, peak


def run_trl(args, model_dir: Path, train: Path, out: Path, finetune: str) -> dict:
    accumulation, remainder = divmod(args.global_batch, args.micro * args.world_size)
    if remainder or not accumulation:
        raise SystemExit(f"global batch {args.global_batch} must be divisible by micro {args.micro} x world size "
                         f"{args.world_size} for TRL's gradient accumulation")
    out.mkdir(parents=True)
    cmd = [*torchrun(args), str(WORKER), "--model-dir", str(model_dir), "--pairs", str(train), "--out", str(out),
           "--micro", str(args.micro), "--accumulation", str(accumulation), "--steps", str(args.steps),
           "--timed-from", str(args.log_every), "--seed", str(SEED), "--lr", str(LR), "--betas", *map(str, BETAS),
           "--weight-decay", str(WEIGHT_DECAY), "--grad-clip", str(GRAD_CLIP),
           *(["--lora-r", "16"] if finetune == "lora" else [])]
    execute(cmd, args, extra_env={"HF_DATASETS_CACHE": str(out / "datasets")})
    return json.loads((out / "result.json").read_text())


# -- the comparison --------------------------------------------------------------------------------


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_peer --mode dpo",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--real", action="store_true",
                        help="the real model (SmolLM2-135M-Instruct) on WordNet preference pairs")
    parser.add_argument("--contenders", default=",".join(CONTENDERS),
                        help=f"comma-separated, of {', '.join(CONTENDERS)}")
    parser.add_argument("--finetune", default="lora,full", help="lora and/or full, comma-separated")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=25, help="optimizer steps per run")
    parser.add_argument("--log-every", type=int, default=5, help="steps 1..log-every are warm-up, not timed")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--global-batch", type=int, default=16, help="pairs per optimizer step")
    parser.add_argument("--micro", type=int, default=4,
                        help="pairs per microbatch (TRL, ddptrain-micro); packed rows (ddptrain-pack)")
    parser.add_argument("--pairs", type=int, default=1000, help="pairs in pairs.jsonl")
    parser.add_argument("--words", type=int, default=1500, help="distinct pseudo-words")
    parser.add_argument("--vocab", type=int, default=2048, help="the BPE tokenizer's vocabulary")
    parser.add_argument("--width", type=int, default=256, help="the Llama's hidden size")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    args = parser.parse_args(argv)
    args.contenders = [name.strip() for name in args.contenders.split(",") if name.strip()]
    args.finetune = [name.strip() for name in args.finetune.split(",") if name.strip()]
    for name in args.contenders:
        if name not in CONTENDERS:
            parser.error(f"--contenders: {name!r} is not one of {', '.join(CONTENDERS)}")
    if "trl" not in args.contenders:
        parser.error("--contenders must include trl: every figure is reported as a ratio to it")
    for name in args.finetune:
        if name not in FINETUNES:
            parser.error(f"--finetune: {name!r} is not one of {', '.join(FINETUNES)}")
    return args


def describe(args, examples, weights_bytes: int) -> str:
    targets, lengths = examples.targets_per_example(), examples.lengths
    model = (f" --real: SmolLM2-135M-Instruct ({weights_bytes / 2**20:.0f} MiB of fp32 weights), WordNet pairs"
             if args.real else f": Llama {args.layers} x {args.width}, vocab {args.vocab} "
             f"({weights_bytes / 2**20:.1f} MiB of fp32 weights)")
    return (f"benchmarks.bench_peer --mode dpo{model}, {len(examples):,} pairs of {int(lengths.min())}.."
            f"{int(lengths.max())} padded positions as two rows (mean {lengths.mean():.0f}), "
            f"{int(targets.min())}..{int(targets.max())} completion tokens, seq_len {args.seq_len}, global batch "
            f"{args.global_batch} pairs, micro {args.micro} pairs (packed: rows), sigmoid DPO beta 0.1, "
            f"{args.world_size} gloo ranks x {args.threads} thread(s), fp32, steps {args.log_every + 1}..{args.steps} "
            f"of each run timed; peak: rank 0's peak RSS; contenders {', '.join(args.contenders)}")


def weights_size(model_dir: Path) -> int:
    return sum(path.stat().st_size for path in model_dir.glob("*.safetensors"))


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    figures: dict[str, dict[str, list[tuple[float, int]]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench_peer_dpo_") as tmp:
        work = Path(tmp)
        model_dir, train, val = (write_real_inputs if args.real else write_inputs)(work, args)
        data = ddptrain_data(model_dir, train, val, work / "cache")
        examples = training_pairs(args, data)
        print(describe(args, examples, weights_size(model_dir)), flush=True)
        for finetune in args.finetune:
            figures[finetune] = {name: [] for name in args.contenders}
            for round_index in range(args.rounds):
                for name in args.contenders if round_index % 2 == 0 else args.contenders[::-1]:
                    out = work / f"{finetune}-{name}-{round_index}"
                    if name != "trl":
                        figures[finetune][name].append(run_ddptrain(name, args, data, model_dir, out, finetune))
                        continue
                    result = run_trl(args, model_dir, train, out, finetune)
                    ours = (len(examples), examples.valid_targets())
                    if (result["dataset_pairs"], result["dataset_targets"]) != ours:
                        raise RuntimeError(f"TRL's dataset holds {result['dataset_pairs']} pairs with "
                                           f"{result['dataset_targets']} completion tokens, ddptrain's {ours[0]} with "
                                           f"{ours[1]}: they would not train the same")
                    figures[finetune][name].append((result["pairs"] / result["seconds"], result["peak_rss_bytes"]))
                print(f"{finetune} round {round_index + 1}: " + ", ".join(
                    f"{n} {figures[finetune][n][-1][0]:,.2f}" for n in args.contenders), flush=True)
    report(figures)


def report(figures: dict[str, dict[str, list[tuple[float, int]]]]) -> None:
    """Per fine-tuning mode: median pairs/s and peak RSS of each contender, both as ratios to TRL's
    (per-round rate ratios, their median); then each contender's LoRA peak beside its full one."""
    for finetune, contenders in figures.items():
        print(f"\n{finetune}: {'contender':18}{'pairs/s':>10}{'peak MiB':>10}{'x trl pairs/s':>15}"
              f"{'x trl peak':>12}   per-round pairs/s ratios")
        trl = contenders["trl"]
        for name, values in contenders.items():
            rates = [rate for rate, _ in values]
            ratios = [rate / peer for rate, (peer, _) in zip(rates, trl)]
            peak = statistics.median(peak for _, peak in values)
            print(f"{'':{len(finetune) + 2}}{name:18}{statistics.median(rates):10,.2f}{peak / 2**20:10,.0f}"
                  f"{statistics.median(ratios):15.2f}{peak / statistics.median(p for _, p in trl):12.2f}   "
                  + ", ".join(f"{ratio:.2f}" for ratio in ratios))
    if {"lora", "full"} <= set(figures):
        print("\npeak MiB, LoRA (reference: the adapter disabled) beside full fine-tuning (reference: a frozen copy)")
        for name in figures["lora"]:
            lora, full = (statistics.median(peak for _, peak in figures[mode][name]) for mode in ("lora", "full"))
            print(f"  {name:18}{lora / 2**20:10,.0f}{full / 2**20:10,.0f}   full - lora {(full - lora) / 2**20:,.0f}")


if __name__ == "__main__":
    main(sys.argv[1:])
