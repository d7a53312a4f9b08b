"""Packed attention per backend against plain causal SDPA of the same shape: fwd+bwd, side by side.

    python -m benchmarks.bench_attention [--seq-lens 256,1024,4096] [--rows 2] [--heads 4] [--head-dim 64]

For each T and each document mix, q, k, v of shape (rows, heads, T, head_dim) go through forward
and backward of:

- causal: plain causal SDPA over whole rows, no documents (it attends across them): the time to match;
- every backend of ddptrain/models/attention.py with the rows' boundaries (computed on the host
  beforehand, as collation does): mask (the dense (B, 1, T, T) reference), gather, varlen and flex
  (CUDA only: "n/a" elsewhere; varlen in bf16/fp16 only).

Document mixes: `short`, documents of 20 to 120 tokens (the corpus' short documents, as in issue
22's microbenchmark), and `long`, one document per row, each one layout used by every call (its
per-microbatch work, such as the dense mask, built once, as a model's layers share it); `corpus`
(not by default), rows packed from the standard library's paragraphs (`data=text
data.split_by=paragraph`, byte tokens, as bench_peer trains on), a fresh microbatch in every call,
as training sees them: what a backend does once per new layout (a mask, a block mask, a kernel
plan for new shapes) counts in every call, as for a model of one layer. `work` is the sum of
squared document lengths over T^2: the share of causal attention's scores that per-document
attention needs.

Times are medians over rounds, contenders interleaved (order reversed every other round), after a
warm-up (flex compiles there). Memory: on GPU the peak allocated during one fwd+bwd above what was
allocated before; on CPU the peak of live tensor bytes of one fwd+bwd from the profiler's memory
timeline (benchmarks/bench_memory_ac.py), with q, k, v and their gradients' buffers not counted.
A figure, not a test.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
import warnings

import numpy as np
import torch

from ddptrain.config.choices import attention_refusal
from ddptrain.contract.boundaries import DocumentBoundaries
from ddptrain.models import attention

BACKENDS = ("mask", "gather", "varlen", "flex")
MIXES = ("short", "long")
CORPUS = "corpus"


def segments_of(mix: str, rows: int, seq_len: int, seed: int) -> np.ndarray:
    """Segment ids (rows, T): documents of 20-120 tokens laid end to end (short), or one per row (long)."""
    if mix == "long":
        return np.zeros((rows, seq_len), dtype=np.int64)
    rng = np.random.default_rng(seed)
    segments = np.zeros((rows, seq_len), dtype=np.int64)
    for row in range(rows):
        lengths = rng.integers(20, 121, size=seq_len // 20 + 1)
        ids = np.repeat(np.arange(len(lengths)), lengths)[:seq_len]
        segments[row] = ids
    return segments


def corpus_segments(rows: int, seq_len: int, count: int, seed: int) -> list[np.ndarray]:
    """`count` microbatches of `rows` packed rows of the stdlib paragraphs, each padded to seq_len."""
    from benchmarks.peer_common import stdlib_glob, training_examples
    from ddptrain.data.packing import PackedExamples

    examples = training_examples(argparse.Namespace(data_glob=stdlib_glob(), seq_len=seq_len))
    packed = PackedExamples.from_examples(examples, seq_len)
    rng = np.random.default_rng(seed)
    layouts = []
    for _ in range(count):
        segments = packed.collate(rng.choice(len(packed), rows, replace=False))[0]["segments"].numpy()
        layouts.append(np.pad(segments, ((0, 0), (0, seq_len - segments.shape[1])), constant_values=-1))
    return layouts


def work_share(segments: np.ndarray) -> float:
    _, counts = np.unique(segments + np.arange(len(segments))[:, None] * (segments.max() + 1), return_counts=True)
    return float((counts.astype(np.float64) ** 2).sum() / (len(segments) * segments.shape[1] ** 2))


def contenders(device: torch.device, precision: str) -> dict[str, str | None]:
    """name -> why it cannot run here (None: it runs)."""
    out = {"causal": None}
    for backend in BACKENDS:
        out[backend] = attention_refusal(backend, device.type, precision)
    return out


def fwd_bwd(name: str, q, k, v, documents: DocumentBoundaries, grad: torch.Tensor):
    if name == "causal":
        out = attention.causal(q, k, v)
    else:
        out = attention.attend(q, k, v, documents.using(name))
    return torch.autograd.grad(out, (q, k, v), grad)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_bytes(run, device: torch.device) -> int:
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        run()
        synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    from benchmarks.bench_memory_ac import _profiled_peak_bytes

    return _profiled_peak_bytes(run)


def measure(seq_len: int, mix: str, args, device: torch.device, dtype: torch.dtype, runnable: list[str]) -> dict:
    if mix == CORPUS:  # a fresh microbatch in every call, warm-up included
        layouts = corpus_segments(args.rows, seq_len, 2 + args.rounds * args.repeats, seed=seq_len)
    else:
        layouts = [segments_of(mix, args.rows, seq_len, seed=seq_len)]
    boundaries = [DocumentBoundaries.from_segments(segments).to(device) for segments in layouts]
    documents = boundaries[0]
    gen = torch.Generator().manual_seed(0)
    shape = (args.rows, args.heads, seq_len, args.head_dim)
    q, k, v = (torch.randn(shape, generator=gen).to(device, dtype).requires_grad_() for _ in range(3))
    grad = torch.randn(args.rows, seq_len, args.heads, args.head_dim, generator=gen).to(device, dtype)
    if mix == CORPUS:
        def fresh(name):
            turn = itertools.cycle(boundaries)  # each contender sees the same microbatches in turn
            return lambda: fwd_bwd(name, q, k, v, next(turn).to(device), grad)  # .to: an empty cache

        calls = {name: fresh(name) for name in runnable}
    else:
        calls = {name: (lambda name=name: fwd_bwd(name, q, k, v, documents, grad)) for name in runnable}
    for call in calls.values():  # warm-up (flex compiles here); masks are cached per microbatch, as in training
        for _ in range(2):
            call()
    times: dict[str, list[float]] = {name: [] for name in runnable}
    for index in range(args.rounds):
        for name in runnable if index % 2 == 0 else reversed(runnable):
            synchronize(device)
            start = time.perf_counter()
            for _ in range(args.repeats):
                calls[name]()
            synchronize(device)
            times[name].append((time.perf_counter() - start) / args.repeats)
    memory = {}
    if not args.no_memory:
        for name in runnable:
            fresh = documents.to(device)  # an empty per-microbatch cache: the mask's build counts
            memory[name] = peak_bytes(lambda name=name: fwd_bwd(name, q, k, v, fresh, grad), device)
    return {"docs_per_row": statistics.mean(len(b.cu_seqlens) - 1 for b in boundaries) / args.rows,
            "work": statistics.mean(work_share(segments) for segments in layouts),
            "ms": {name: 1000 * statistics.median(values) for name, values in times.items()}, "bytes": memory}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-lens", default="256,1024,4096")
    parser.add_argument("--mixes", default=",".join(MIXES))
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2, help="fwd+bwd calls per timed round")
    parser.add_argument("--precision", default=None, help="fp32 | bf16 | fp16 (default: bf16 on CUDA, fp32 on CPU)")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory column")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    precision = args.precision or ("bf16" if device.type == "cuda" else "fp32")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    names = contenders(device, precision)
    runnable = [name for name, refusal in names.items() if refusal is None]
    where = f"{device.type}" + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else
                                f", {torch.get_num_threads()} threads")
    print(f"benchmarks.bench_attention: {where}, {precision}, rows {args.rows} x heads {args.heads} x head_dim "
          f"{args.head_dim}, fwd+bwd, median of {args.rounds} rounds x {args.repeats}")
    for name, refusal in names.items():
        if refusal is not None:
            print(f"  {name}: n/a here: {refusal.split('(')[1].split(')')[0]}")
    results = {}
    for seq_len in (int(x) for x in args.seq_lens.split(",")):
        for mix in args.mixes.split(","):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                results[seq_len, mix] = measure(seq_len, mix, args, device, dtype, runnable)
    columns = list(names)
    head = f"{'T':>5} {'docs':>5} {'docs/row':>8} {'work':>5} |"
    print()
    print("time, ms (x causal)")
    print(head + "".join(f" {name:>16}" for name in columns))
    for (seq_len, mix), result in results.items():
        cells = []
        for name in columns:
            if name not in result["ms"]:
                cells.append(f" {'n/a':>16}")
                continue
            ms, base = result["ms"][name], result["ms"]["causal"]
            cells.append(f" {ms:>9.2f} {'' if name == 'causal' else f'{ms / base:.2f}x':>6}")
        print(f"{seq_len:>5} {mix:>5} {result['docs_per_row']:>8.1f} {result['work']:>5.2f} |" + "".join(cells))
    if not args.no_memory:
        print()
        print("peak memory of one fwd+bwd, MiB" + (" (CPU: live tensors, profiler timeline)"
                                                    if device.type == "cpu" else ""))
        print(head + "".join(f" {name:>10}" for name in columns))
        for (seq_len, mix), result in results.items():
            cells = "".join(f" {result['bytes'][name] / 2**20:>10.1f}" if name in result["bytes"] else f" {'n/a':>10}"
                            for name in columns)
            print(f"{seq_len:>5} {mix:>5} {result['docs_per_row']:>8.1f} {result['work']:>5.2f} |" + cells)
    print("targets: short documents, T >= 1024: the default backend at or below causal; long (one document): "
          "within 5% of causal")


if __name__ == "__main__":
    main()
