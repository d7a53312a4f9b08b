"""What bench_peer's modes share: the optimizer settings, the corpus, the model, and how a run is launched.

bench_peer (text), bench_peer_sft and bench_peer_step all train the same small Llama on examples
from ddptrain's own data pipeline with the same optimizer settings; they import these from here,
so that no mode imports another.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

LR, BETAS, WEIGHT_DECAY, GRAD_CLIP, SEED = 1e-3, (0.9, 0.95), 0.1, 1.0, 1234


def stdlib_glob() -> str:
    from ddptrain.data.sources import stdlib_root

    return str(stdlib_root() / "*.py")



def data_overrides(args) -> list[str]:
    return ["data=text", f"data.paths=[{args.data_glob}]", "data.split_by=paragraph", "data.tokenizer=byte"]



def training_examples(args):
    """ddptrain's training examples for `data_overrides` (through its cache): what every contender trains on."""
    from omegaconf import OmegaConf

    from ddptrain.config import DataConfig
    from ddptrain.data import load_splits

    data_cfg = OmegaConf.structured(DataConfig(name="text", paths=[args.data_glob], split_by="paragraph",
                                               tokenizer="byte"))
    return load_splits(data_cfg, args.seq_len).train



def packed_rows(args, examples) -> int:
    """Packed rows per step holding about as many valid targets as global_batch average examples."""
    mean_targets = examples.valid_targets() / len(examples)
    return max(args.world_size, round(args.global_batch * mean_targets / args.seq_len))



def write_model_dir(directory: Path, seq_len: int, width: int, layers: int) -> None:
    """config.json of a small Llama (GQA, RoPE, SwiGLU) over byte tokens; no weights."""
    import transformers

    transformers.LlamaConfig(vocab_size=256, hidden_size=width, intermediate_size=int(width * 8 / 3) // 8 * 8,
                             num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=seq_len, use_cache=False,
                             tie_word_embeddings=False).save_pretrained(directory)



def windowed_rates(run_dir: Path, log_every: int) -> tuple[float, float]:
    """(valid tokens per second, valid targets / positions computed) of a ddptrain run's windows after the first
    (warm-up); metrics.jsonl written before `valid_target_fraction` had that ratio as `padding_efficiency`."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    timed = [r for r in records if r["step"] > log_every and r.get("tokens_per_second")]
    if not timed:
        raise RuntimeError(f"{run_dir}/metrics.jsonl has no window after step {log_every}: {records}")
    # tokens_per_second = window tokens / window seconds: recombine the windows after the first.
    seconds = [r["step_time_s"] * log_every for r in timed]
    tokens = [r["tokens_per_second"] * s for r, s in zip(timed, seconds)]
    padded = [t / r.get("valid_target_fraction", r["padding_efficiency"]) for r, t in zip(timed, tokens)]
    return sum(tokens) / sum(seconds), sum(tokens) / sum(padded)



def torchrun(args) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.world_size}"]



def execute(cmd: list[str], args, extra_env: dict[str, str] | None = None) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "CUDA_VISIBLE_DEVICES": "",
           "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(Path.cwd()), **(extra_env or {})}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}\nfailed with exit code {done.returncode}:\n{done.stderr[-4000:]}")
