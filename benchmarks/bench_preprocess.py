"""Preprocessing throughput: ddptrain's sharded build on 1, 2 and 4 ranks against Hugging Face
`datasets` `map(batched=True, num_proc=2)`, the same BPE tokenizer on the same files.

    python -m benchmarks.bench_preprocess [--copies 1] [--tokenizer PATH/tokenizer.json]

The corpus: WordNet 3.0's synset lines (Debian's wordnet-base, /usr/share/wordnet/data.*) as JSONL
records, one file per part of speech (uneven sizes: the sharded build cuts them at line starts),
`--copies` times. The tokenizer: SmolLM2's (tests/real_model.py builds its directory; BPE, 49,152
ids), through `tokenizers` on both sides. Each contender starts from an empty cache: ddptrain's is
load_splits (read, tokenize, write tokens.npy and the document index, checksums) on N real ranks
(ddptrain.testing.run_distributed, one process group, collective=True), timed inside rank 0 from
the call to the loaded splits; datasets' is load_dataset("json") + map, timed the same way in one
process. Each rank's share of the bytes is the build's own count (its log line per shard). A figure,
not a test: the machine's load moves it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from ddptrain.config import DataConfig
from ddptrain.testing import run_distributed

WORDNET = Path("/usr/share/wordnet")


def write_corpus(directory: Path, copies: int, limit: int | None = None) -> list[Path]:
    paths = []
    for part in ("noun", "verb", "adj", "adv"):
        lines = [line for line in (WORDNET / f"data.{part}").read_text(errors="replace").splitlines()
                 if not line.startswith("  ")][:limit]  # the license header
        path = directory / f"wordnet-{part}.jsonl"
        with path.open("w") as handle:
            for _ in range(copies):
                handle.writelines(json.dumps({"text": line}) + "\n" for line in lines)
        paths.append(path)
    return paths


def ddptrain_build(cfg: DataConfig) -> dict:
    """On every rank: the build through the team; rank 0 returns its time and the shares it logged."""
    from ddptrain.data import load_splits

    shares: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: shares.append(record.getMessage())
    logging.getLogger("ddptrain").addHandler(handler)
    logging.getLogger("ddptrain").setLevel(logging.INFO)
    started = time.perf_counter()
    data = load_splits(cfg, 1024, collective=True)
    seconds = time.perf_counter() - started
    tokens = int(len(data.train.tokens))
    return {"seconds": seconds, "tokens": tokens, "shares": [s for s in shares if s.startswith("data: shard ")],
            "threads": os.environ.get("RAYON_NUM_THREADS")}


def datasets_build(paths: list[Path], tokenizer_file: str, cache: Path, num_proc: int) -> dict:
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    import datasets
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=tokenizer_file)
    started = time.perf_counter()
    dataset = datasets.load_dataset("json", data_files=[str(p) for p in paths], split="train", cache_dir=str(cache))
    tokenized = dataset.map(lambda batch: tokenizer(batch["text"], add_special_tokens=False), batched=True,
                            num_proc=num_proc, remove_columns=["text"])
    seconds = time.perf_counter() - started
    tokens = sum(len(ids) for batch in tokenized.iter(batch_size=10_000) for ids in batch["input_ids"])
    return {"seconds": seconds, "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--copies", type=int, default=1, help="copies of WordNet in each file")
    parser.add_argument("--tokenizer", default=None, help="a tokenizer.json (default: SmolLM2's, built by "
                                                          "tests/real_model.py)")
    parser.add_argument("--ranks", default="1,2,4")
    parser.add_argument("--lines", type=int, default=None, help="only the first LINES synsets of each file")
    args = parser.parse_args()
    tokenizer = args.tokenizer
    if tokenizer is None:
        from tests.real_model import smollm2_dir
        tokenizer = str(smollm2_dir() / "tokenizer.json")
    work = Path(tempfile.mkdtemp(prefix="bench_preprocess-"))
    try:
        paths = write_corpus(work, args.copies, args.lines)
        size = sum(p.stat().st_size for p in paths)
        print(f"benchmarks.bench_preprocess: WordNet synsets as JSONL, {len(paths)} files, {size / 1e6:.1f} MB "
              f"({', '.join(f'{p.stat().st_size / 1e6:.1f}' for p in paths)} MB), tokenizer {tokenizer}, "
              f"{len(os.sched_getaffinity(0))} CPU cores")
        rows = []
        peer = datasets_build(paths, tokenizer, work / "hf-cache", 2)
        rows.append(("datasets map(batched, num_proc=2)", peer["seconds"], peer["tokens"]))
        for ranks in (int(r) for r in args.ranks.split(",")):
            cfg = DataConfig(name="jsonl", paths=[str(p) for p in paths], field="text", tokenizer=tokenizer,
                             cache_dir=str(work / f"cache-{ranks}"), val_percent=1.0)
            result = run_distributed(ddptrain_build, ranks, cfg, timeout_s=3600)[0]
            # tokens.npy holds both splits: the peer's count is of every record
            entry = next(p for p in (work / f"cache-{ranks}").iterdir() if p.is_dir() and "." not in p.name)
            tokens = json.loads((entry / "meta.json").read_text())["tokens"]
            rows.append((f"ddptrain, {ranks} rank(s) (RAYON_NUM_THREADS={result['threads']})", result["seconds"],
                         tokens))
            for share in result["shares"]:
                print("   ", share)
        print(f"{'contender':55s} {'seconds':>8s} {'tokens':>11s} {'tokens/s':>10s} {'vs datasets':>11s}")
        for name, seconds, tokens in rows:
            print(f"{name:55s} {seconds:8.2f} {tokens:11d} {tokens / seconds:10.0f} {peer['seconds'] / seconds:10.2f}x")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
