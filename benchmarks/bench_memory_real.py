"""Peak memory of a full fine-tuning step of the real model, ddptrain beside a bare transformers loop:
`python -m benchmarks.bench_memory_real` (on CPU).

    python -m benchmarks.bench_memory_real                            # 4 x 1024 tokens, both vocabularies
    python -m benchmarks.bench_memory_real --shapes 4x1024,2x4096 --steps 2

Models: SmolLM2-135M-Instruct (tests/real_model.py: vocabulary 49,152, tied embeddings), and the same
shape with Qwen2.5's vocabulary of 151,936 built from its config (random weights, SmolLM2's
tokenizer beside it): the logits' share of the step grows with the vocabulary.

Contenders, each step in a fresh process (a process's peak is its own), fp32, AdamW, one thread:

- ddptrain: the training command's own build (`ddptrain.train.builder.build`: model=hf, data=stdlib
  with the model's tokenizer, packed into rows of T tokens, global batch = micro batch = B rows, one rank) and `--steps`
  Engine steps: whatever loss path the Engine takes by default is the one measured.
- transformers: `model(ids, labels=ids).loss.backward()`, `AdamW.step()`, `zero_grad()` on random
  (B, T) ids, the loop a user writes first.

The figure: peak resident set size (VmHWM: this process's own, where ru_maxrss would keep its
launcher's) less the process's resident set just before the
model is built (after imports, and ddptrain's data), so what the interpreter, torch and the data
hold counts on neither side. A figure, not a test.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

QWEN_VOCAB = 151_936
"""Qwen2.5's vocabulary (its config.json's vocab_size)."""
CONTENDERS = ("ddptrain", "transformers")


def resident_bytes() -> int:
    """This process's resident set now (/proc/self/statm: pages)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_bytes() -> int:
    import torch

    from ddptrain.train.metrics import peak_memory_bytes

    return peak_memory_bytes(torch.device("cpu"))  # VmHWM


# -- one contender in its own process -------------------------------------------------------------


def ddptrain_step(model_dir: Path, rows: int, seq_len: int, steps: int) -> dict:
    from ddptrain.config.compose import compose_config
    from ddptrain.distributed import init_distributed
    from ddptrain.train import builder

    cfg = compose_config(["model=hf", f"model.path={model_dir}", "data=stdlib", "data.max_docs=400", "batch.pack=true",
                          f"batch.seq_len={seq_len}",
                          f"batch.global_size={rows}", f"batch.micro_size={rows}", "trainer.precision=fp32",
                          "optim.warmup_steps=0", f"trainer.max_steps={steps}"])
    builder.validate_run(cfg, 1)
    dist_info = init_distributed()
    builder.load_data(cfg, dist_info)  # the sources' tokenization, which the build repeats, counts on neither side
    baseline = resident_bytes()
    built = builder.build(cfg, dist_info)
    shapes = []
    for step in range(steps):
        microbatches = built.batches.microbatches(step)
        shapes += [tuple(targets.shape) for _, targets in microbatches]
        float(built.engine.step(microbatches).loss)
    return {"baseline": baseline, "peak": peak_bytes(), "shapes": shapes}


def transformers_step(model_dir: Path, rows: int, seq_len: int, steps: int) -> dict:
    import torch
    import transformers

    baseline = resident_bytes()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        ids = torch.randint(0, model.config.vocab_size, (rows, seq_len), generator=generator)
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {"baseline": baseline, "peak": peak_bytes(), "shapes": [(rows, seq_len)] * steps}


def worker(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--contender", choices=CONTENDERS, required=True)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--rows", type=int, required=True)
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    args = parser.parse_args(argv)
    if args.contender == "ddptrain":
        result = ddptrain_step(args.model_dir, args.rows, args.seq_len, args.steps)
    else:
        result = transformers_step(args.model_dir, args.rows, args.seq_len, args.steps)
    print("RESULT " + json.dumps(result), flush=True)


# -- the comparison -------------------------------------------------------------------------------


def qwen_vocabulary_dir(smollm2: Path, directory: Path) -> Path:
    """SmolLM2's config with Qwen2.5's vocabulary, saved with random weights, and SmolLM2's tokenizer."""
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(smollm2)
    config.vocab_size = QWEN_VOCAB
    torch.manual_seed(0)
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed, where installed, says "Setting accelerator" there
        transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (smollm2 / name).is_file():
            shutil.copy(smollm2 / name, directory / name)
    return directory


def measure(contender: str, model_dir: Path, rows: int, seq_len: int, args) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "CUDA_VISIBLE_DEVICES": "",
           "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(Path.cwd())}
    cmd = [sys.executable, "-m", "benchmarks.bench_memory_real", "--worker", "--contender", contender,
           "--model-dir", str(model_dir), "--rows", str(rows), "--seq-len", str(seq_len), "--steps", str(args.steps)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}\nfailed with exit code {done.returncode}:\n{done.stderr[-4000:]}")
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_memory_real", description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="4x1024", help="comma-separated ROWSxTOKENS, e.g. 4x1024,1x4096")
    parser.add_argument("--vocabularies", default="smollm2,qwen", help="smollm2 (49,152) and/or qwen (151,936)")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps per process (the peak is the max)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per process")
    args = parser.parse_args(argv)
    try:
        args.shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.shapes.split(",")]
    except ValueError:
        parser.error(f"--shapes {args.shapes}: ROWSxTOKENS, comma-separated, e.g. 4x1024")
    args.vocabularies = args.vocabularies.split(",")
    if any(name not in ("smollm2", "qwen") for name in args.vocabularies):
        parser.error(f"--vocabularies {','.join(args.vocabularies)}: of smollm2, qwen")
    if args.steps < 1:
        parser.error(f"--steps {args.steps} must be >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    if argv is None and "--worker" in sys.argv:
        return worker([arg for arg in sys.argv[1:] if arg != "--worker"])
    args = parse(argv)
    import pytest

    from tests.real_model import smollm2_dir

    try:
        smollm2 = smollm2_dir()
    except pytest.skip.Exception as missing:
        raise SystemExit(f"needs the real model: {missing}") from None
    print(f"benchmarks.bench_memory_real: full fine-tuning, fp32, AdamW, {args.steps} step(s) per process, "
          f"{args.threads} thread(s); peak RSS less the RSS before the model is built", flush=True)
    print(f"\n{'model':28}{'rows x tokens':>14}{'ddptrain MiB':>14}{'transformers MiB':>18}{'ratio':>8}")
    with tempfile.TemporaryDirectory(prefix="bench_memory_real_") as tmp:
        work = Path(tmp)
        models = {"smollm2": ("SmolLM2-135M (V 49,152)", smollm2)}
        if "qwen" in args.vocabularies:
            models["qwen"] = ("same, V 151,936 (Qwen2.5)", qwen_vocabulary_dir(smollm2, work / "qwen-vocab"))
        for key in args.vocabularies:
            label, model_dir = models[key]
            for rows, seq_len in args.shapes:
                used = {}
                for contender in CONTENDERS:
                    result = measure(contender, model_dir, rows, seq_len, args)
                    used[contender] = (result["peak"] - result["baseline"]) / 2**20
                print(f"{label:28}{f'{rows} x {seq_len}':>14}{used['ddptrain']:14,.0f}{used['transformers']:18,.0f}"
                      f"{used['ddptrain'] / used['transformers']:8.2f}", flush=True)


if __name__ == "__main__":
    main()
