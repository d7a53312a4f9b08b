"""Peak memory of a training step with and without activation checkpointing, side by side; or,
with --packed, of a step on packed rows with the dense-mask attention against the default backend.

    python -m benchmarks.bench_memory_ac                      # GPT and a small Llama, CPU or GPU
    python -m benchmarks.bench_memory_ac --models gpt --n-layer 12 --seq-len 1024
    python -m benchmarks.bench_memory_ac --packed --seq-len 1024,2048,4096 --batch 2

--packed: the microbatch is `batch` packed rows of documents of 20 to 120 tokens (as the corpus'
short ones; ddptrain.data.packing, boundaries and all), and the two columns are the same step with
trainer.attention=mask (the dense (B, 1, T, T) mask, what packed rows paid before per-document
attention) and with the backend trainer.attention=auto picks here (ddptrain/models/attention.py).

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
import subprocess
import sys
import tempfile
import time
import warnings

import torch

MODELS = ("gpt", "llama")


def _build(kind: str, n_layer: int, n_embd: int, seq_len: int, vocab: int, directory: str):
    from ddptrain.models.adapters import adapter_for

    if kind == "gpt":
        model_cfg = {"name": "gpt", "n_layer": n_layer, "n_head": 4, "n_embd": n_embd}
        return adapter_for(model_cfg).build(model_cfg, vocab, seq_len)
    import transformers

    transformers.LlamaConfig(vocab_size=vocab, hidden_size=n_embd, intermediate_size=int(n_embd * 8 / 3) // 8 * 8,
                             num_hidden_layers=n_layer, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=seq_len, use_cache=False).save_pretrained(directory)
    model_cfg = {"name": "hf", "path": directory, "attn_implementation": "sdpa"}
    return adapter_for(model_cfg).build(model_cfg, vocab, seq_len)


def _peak_rss_bytes() -> int:
    from ddptrain.train.metrics import peak_memory_bytes

    return peak_memory_bytes(torch.device("cpu"))  # VmHWM: this process's own, not its launcher's


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


def packed_microbatch(batch: int, seq_len: int, vocab: int) -> tuple[dict, torch.Tensor]:
    """`batch` packed rows of seq_len tokens of documents of 20 to 120 tokens, as collation makes them."""
    import numpy as np

    from ddptrain.data.dataset import TokenExamples
    from ddptrain.data.packing import PackedExamples

    rng = np.random.default_rng(0)
    documents, total = [], 0
    while total < batch * (seq_len + 1) * 1.2:
        documents.append(rng.integers(0, vocab, size=int(rng.integers(20, 121))).astype(np.uint8))
        total += len(documents[-1])
    packed = PackedExamples.from_examples(TokenExamples.from_documents(documents, seq_len), seq_len)
    return packed.collate(np.arange(batch))


def measure(kind: str, checkpointing: bool, n_layer: int, n_embd: int, seq_len: int, batch: int,
            attention: str | None = None) -> dict:
    """One child process: build, one step (AdamW state), then measure a second step. `attention`:
    packed rows through trainer.attention=`attention` (None: plain rows)."""
    import ddptrain
    from ddptrain.models.adapters import adapter_of, enable_activation_checkpointing
    from ddptrain.models.attention import select_backend

    vocab = 256
    device = ddptrain.init_distributed().device
    with tempfile.TemporaryDirectory() as directory:
        torch.manual_seed(0)
        model, spec = _build(kind, n_layer, n_embd, seq_len, vocab, directory)
    if checkpointing:
        enable_activation_checkpointing(model, spec)
    backend = None
    if attention is not None:
        requested = select_backend(attention, device.type, "fp32")
        backend = adapter_of(spec).use_attention(model, requested, forced=attention != "auto")
    parameters = sum(p.numel() for p in model.parameters())
    engine = ddptrain.Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-3), "ddp", grad_clip=1.0)
    if attention is None:
        generator = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, vocab, (batch, seq_len + 1), generator=generator)
        microbatches = second = [(tokens[:, :-1], tokens[:, 1:])]
    else:  # the same rows again, but new boundaries: what a backend caches on them is built in each step
        microbatches = [packed_microbatch(batch, seq_len, vocab)]
        second = [packed_microbatch(batch, seq_len, vocab)]
    rss_before = _peak_rss_bytes()
    started = time.perf_counter()
    engine.step(microbatches)
    first_step_s = time.perf_counter() - started
    rss_growth = _peak_rss_bytes() - rss_before
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        engine.step(second)
        step_peak, method = torch.cuda.max_memory_allocated(device) - start, "cuda allocator"
    else:
        step_peak, method = _profiled_peak_bytes(lambda: engine.step(second)), "profiler timeline"
    return {"model": kind, "checkpointing": checkpointing, "parameters": parameters, "step_peak": step_peak,
            "rss_growth": rss_growth, "first_step_s": first_step_s, "method": method, "backend": backend}


def _child(args) -> None:
    torch.set_num_threads(args.threads)
    result = measure(args.model, args.checkpointing, args.n_layer, args.n_embd, int(args.seq_len), args.batch,
                     args.attention)
    print("RESULT " + json.dumps(result))


def _spawn(kind: str, checkpointing: bool, args, seq_len: int | None = None, attention: str | None = None) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.bench_memory_ac", "--child", "--model", kind,
           "--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd), "--seq-len", str(seq_len or args.seq_len),
           "--batch", str(args.batch), "--threads", str(args.threads)]
    if checkpointing:
        cmd.append("--checkpointing")
    if attention is not None:
        cmd += ["--attention", attention]
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
    parser.add_argument("--seq-len", default="512", help="--packed: a comma-separated list")
    parser.add_argument("--batch", type=int, default=8, help="sequences (--packed: rows) in the one microbatch")
    parser.add_argument("--packed", action="store_true",
                        help="packed rows: trainer.attention=mask against auto, instead of activation checkpointing")
    parser.add_argument("--attention", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="gpt", help=argparse.SUPPRESS)
    parser.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return _child(args)
    if args.packed:
        return _packed_table(args)
    args.seq_len = int(args.seq_len)
    rows = [(kind, [_spawn(kind, flag, args) for flag in (False, True)]) for kind in args.models.split(",")]
    print(f"benchmarks.bench_memory_ac: one fp32 AdamW step, batch {args.batch} x seq_len {args.seq_len}, "
          f"n_layer={args.n_layer} n_embd={args.n_embd}; step peak: {rows[0][1][0]['method']}; MiB")
    print(f"{'model':6} {'params':>10} {'step peak':>10} {'with AC':>9} {'ratio':>6}   "
          f"{'RSS +1st':>9} {'with AC':>9} {'1st s':>7} {'with AC':>7}")
    for kind, (plain, ckpt) in rows:
        print(f"{kind:6} {plain['parameters']:>10,} {_mib(plain['step_peak']):>10} {_mib(ckpt['step_peak']):>9} "
              f"{ckpt['step_peak'] / max(plain['step_peak'], 1):6.2f}   {_mib(plain['rss_growth']):>9} "
              f"{_mib(ckpt['rss_growth']):>9} {plain['first_step_s']:7.2f} {ckpt['first_step_s']:7.2f}")


def _packed_table(args) -> None:
    seq_lens = [int(length) for length in args.seq_len.split(",")]
    rows = [(kind, length, _spawn(kind, False, args, length, "mask"), _spawn(kind, False, args, length, "auto"))
            for kind in args.models.split(",") for length in seq_lens]
    print(f"benchmarks.bench_memory_ac --packed: one fp32 AdamW step on {args.batch} packed rows of documents of "
          f"20-120 tokens, n_layer={args.n_layer} n_embd={args.n_embd}; step peak: {rows[0][2]['method']}; MiB")
    print(f"{'model':6} {'seq_len':>7} {'mask (B,1,T,T)':>15} {'auto':>9} {'ratio':>6}   auto's backend   "
          f"{'RSS +1st':>9} {'auto':>9}")
    for kind, length, mask, auto in rows:
        print(f"{kind:6} {length:>7} {_mib(mask['step_peak']):>15} {_mib(auto['step_peak']):>9} "
              f"{auto['step_peak'] / max(mask['step_peak'], 1):6.2f}   {auto['backend']:<16} "
              f"{_mib(mask['rss_growth']):>9} {_mib(auto['rss_growth']):>9}")


if __name__ == "__main__":
    main()
