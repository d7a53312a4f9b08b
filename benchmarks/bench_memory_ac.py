"""Peak memory of a training step with and without activation checkpointing, side by side.

    python -m benchmarks.bench_memory_ac                      # GPT and a small Llama, CPU or GPU
    python -m benchmarks.bench_memory_ac --models gpt --n-layer 12 --seq-len 1024

Every (model, checkpointing) pair runs in a fresh process, so nothing one measurement allocated
is still resident in the next. Each builds the model from the same seed, takes one AdamW
`ddptrain.Engine` step (which creates the optimizer state) and measures the second step:

- GPU: torch.cuda.max_memory_allocated over the step, minus what was allocated before it.
- CPU: PyTorch has no allocator statistics for CPU memory, so the step runs under torch.profiler
  with profile_memory=True and its memory timeline (every tensor allocation and free, by size) is
  replayed: the figure is the peak of live tensor bytes during the step minus the bytes live at
  its start. That counts tensors only (no allocator slack or fragmentation), exactly.
- Both: the process's peak resident set size (RSS) grown during the FIRST step (it includes the
  new AdamW state, the same in both columns). A coarser, allocator-level cross-check; on GPU it
  is host memory and says little.

The peak is reached at the start of backward, when every block's saved activations are alive;
checkpointing keeps one input per block instead, and one block's activations at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import warnings

import torch

MODELS = ("gpt", "llama")


def _build(kind: str, n_layer: int, n_embd: int, seq_len: int, vocab: int, directory: str):
    from ddptrain.models.build import build_model

    if kind == "gpt":
        return build_model({"name": "gpt", "n_layer": n_layer, "n_head": 4, "n_embd": n_embd}, vocab, seq_len)
    import transformers

    transformers.LlamaConfig(vocab_size=vocab, hidden_size=n_embd, intermediate_size=int(n_embd * 8 / 3) // 8 * 8,
                             num_hidden_layers=n_layer, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=seq_len, use_cache=False).save_pretrained(directory)
    return build_model({"name": "hf", "path": directory, "attn_implementation": "sdpa"}, vocab, seq_len)


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _profiled_peak_bytes(step) -> int:
    """Peak live CPU tensor bytes during `step()` above those live when it starts (profiler timeline)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        step()
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated for CUDA's memory snapshots; the CPU has none
        path = os.path.join(tmp, "timeline.json")
        prof.export_memory_timeline(path, device="cpu")
        with open(path) as file:
            _, sizes = json.load(file)  # [times, [bytes by category] per time]
    totals = [sum(row) for row in sizes]
    return max(totals) - totals[0] if totals else 0


def measure(kind: str, checkpointing: bool, n_layer: int, n_embd: int, seq_len: int, batch: int) -> dict:
    """One child process: build, one step (AdamW state), then measure a second step."""
    import ddptrain
    from ddptrain.models.adapters import enable_activation_checkpointing

    vocab = 256
    device = ddptrain.init_distributed().device
    with tempfile.TemporaryDirectory() as directory:
        torch.manual_seed(0)
        model, spec = _build(kind, n_layer, n_embd, seq_len, vocab, directory)
    if checkpointing:
        enable_activation_checkpointing(model, spec)
    parameters = sum(p.numel() for p in model.parameters())
    engine = ddptrain.Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-3), "ddp", grad_clip=1.0)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (batch, seq_len + 1), generator=generator)
    microbatches = [(tokens[:, :-1], tokens[:, 1:])]
    rss_before = _peak_rss_bytes()
    started = time.perf_counter()
    engine.step(microbatches)
    first_step_s = time.perf_counter() - started
    rss_growth = _peak_rss_bytes() - rss_before
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        engine.step(microbatches)
        step_peak, method = torch.cuda.max_memory_allocated(device) - start, "cuda allocator"
    else:
        step_peak, method = _profiled_peak_bytes(lambda: engine.step(microbatches)), "profiler timeline"
    return {"model": kind, "checkpointing": checkpointing, "parameters": parameters, "step_peak": step_peak,
            "rss_growth": rss_growth, "first_step_s": first_step_s, "method": method}


def _child(args) -> None:
    torch.set_num_threads(args.threads)
    result = measure(args.model, args.checkpointing, args.n_layer, args.n_embd, args.seq_len, args.batch)
    print("RESULT " + json.dumps(result))


def _spawn(kind: str, checkpointing: bool, args) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.bench_memory_ac", "--child", "--model", kind,
           "--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd), "--seq-len", str(args.seq_len),
           "--batch", str(args.batch), "--threads", str(args.threads)]
    if checkpointing:
        cmd.append("--checkpointing")
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def _mib(count: int) -> str:
    return f"{count / 2**20:9.1f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help="gpt,llama")
    parser.add_argument("--n-layer", type=int, default=6)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8, help="sequences in the one microbatch")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="gpt", help=argparse.SUPPRESS)
    parser.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return _child(args)
    rows = [(kind, [_spawn(kind, flag, args) for flag in (False, True)]) for kind in args.models.split(",")]
    print(f"benchmarks.bench_memory_ac: one fp32 AdamW step, batch {args.batch} x seq_len {args.seq_len}, "
          f"n_layer={args.n_layer} n_embd={args.n_embd}; step peak: {rows[0][1][0]['method']}; MiB")
    print(f"{'model':6} {'params':>10} {'step peak':>10} {'with AC':>9} {'ratio':>6}   "
          f"{'RSS +1st':>9} {'with AC':>9} {'1st s':>7} {'with AC':>7}")
    for kind, (plain, ckpt) in rows:
        print(f"{kind:6} {plain['parameters']:>10,} {_mib(plain['step_peak']):>10} {_mib(ckpt['step_peak']):>9} "
              f"{ckpt['step_peak'] / max(plain['step_peak'], 1):6.2f}   {_mib(plain['rss_growth']):>9} "
              f"{_mib(ckpt['rss_growth']):>9} {plain['first_step_s']:7.2f} {ckpt['first_step_s']:7.2f}")


if __name__ == "__main__":
    main()
