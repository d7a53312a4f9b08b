"""The benchmarks in benchmarks/ still run (tiny sizes): they print figures, the tests check only the shape.
bench_peer's modes are in tests/test_benchmarks_peer.py (a file runs on one pytest-xdist worker: two
files share the benchmarks' minutes between the workers)."""

from __future__ import annotations

import re

import pytest

from tests.helpers import import_deepspeed, import_optional
from tests.helpers import run_benchmark as _run

pytestmark = pytest.mark.slow


def test_engine_throughput_benchmark_runs_on_two_ranks():
    out = _run("benchmarks.bench", "--rounds", "2", "--steps-per-round", "1", "--max-docs", "20", "--seq-len", "32",
               "--global-batch", "4", "--micro-batch", "1", "--n-layer", "1", "--n-head", "2", "--n-embd", "32")
    assert out.startswith("benchmarks.bench: world 2 on cpu, GPT 1x32"), out
    assert "median" in out and "(target >= 0.97)" in out, out


def test_padding_benchmark_compares_the_three_layouts():
    out = _run("benchmarks.bench_data", "--seq-len", "32", "--global-batch", "4", "--micro-size", "2", "--steps", "2",
               "--rounds", "1", "--steps-per-round", "1")
    assert out.startswith("benchmarks.bench_data: stdlib data"), out
    for layout in ("micro_size=2", "micro_tokens=64", "pack, micro_size=2"):
        assert f"\n{layout} " in out, out


def test_mixture_benchmark_prints_the_bookkeeping_beside_the_step():
    out = _run("benchmarks.bench_mixture", "--sources", "3", "--examples", "1000", "--global-batch", "4",
               "--micro-size", "2", "--seq-len", "16", "--steps", "3", "--train-steps", "1")
    assert out.startswith("benchmarks.bench_mixture: 3 sources x 1,000 examples"), out
    for row in ("mixture bookkeeping", "plain plan", "default run step", "bookkeeping / step:"):
        assert row in out, out


def test_memory_benchmark_compares_ddp_and_zero1():
    import_deepspeed()
    out = _run("benchmarks.bench_memory", "--n-layer", "1", "--n-embd", "32", "--seq-len", "16", "--strategies",
               "ddp,zero1")
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("strategy"))
    columns = re.split(r"\s{2,}", header.strip())  # ... "opt state", then its "vs ddp"
    rows = [line.split() for line in lines if line.startswith(("ddp ", "zero1 "))]
    assert [row[:2] for row in rows] == [["ddp", "0"], ["zero1", "0"], ["ddp", "1"], ["zero1", "1"]], out
    ratio = columns.index("opt state") + 1
    assert float(rows[1][ratio]) == pytest.approx(0.5, abs=0.05), "zero1 holds about half of ddp's optimizer state"
    # the memory plan (python -m ddptrain.plan) beside each measured figure: within 10% (activations 25%)
    for row in rows:
        for measured, tolerance in (("weights", 0.1), ("opt state", 0.1), ("act", 0.25)):
            at = columns.index(measured)
            plan = at + 1 if measured == "act" else at + 2  # after its "vs ddp", where there is one
            assert columns[plan] == "plan", columns
            assert float(row[plan]) == pytest.approx(float(row[at]), rel=tolerance), (row, measured)
    lora = [line.split() for line in lines if line.startswith(("ddp+lora ", "zero1+lora "))]
    assert [row[:2] for row in lora] == [["ddp+lora", "0"], ["zero1+lora", "0"], ["ddp+lora", "1"], ["zero1+lora", "1"]]
    assert float(lora[0][ratio]) < 0.5 and float(lora[1][ratio]) < float(lora[0][ratio]), \
        "LoRA's optimizer state is the adapter's, and zero1 partitions it"


def test_reference_benchmark_prints_the_whole_copy_beside_the_sharded_one_per_rank():
    out = _run("benchmarks.bench_reference", "--world-sizes", "2", "--n-layer", "1", "--n-embd", "256",
               "--vocab-size", "256", "--seq-len", "16")
    assert out.startswith("benchmarks.bench_reference: fsdp, DPO full fine-tuning"), out
    rows = [line.replace("|", " ").split() for line in out.splitlines() if line.lstrip().startswith("2 ")]
    assert [row[:2] for row in rows] == [["2", "0"], ["2", "1"]], out
    for row in rows:
        whole, sharded = float(row[2]), float(row[3])
        assert sharded == pytest.approx(whole / 2, rel=0.1), "each of 2 ranks holds half of the reference"


def test_checkpoint_benchmark_prints_the_stall_with_and_without_async_save():
    out = _run("benchmarks.bench_checkpoint", "--mb", "8", "--rounds", "1")
    assert out.startswith("checkpoint of "), out
    table = out.split("training stall per save", 1)[1].splitlines()
    assert table[1].split()[:4] == ["sync", "async", "start", "commit"], out
    sync, asynchronous, start, commit, steps = (float(value) for value in table[2].split())
    assert asynchronous == pytest.approx(start + commit, abs=2e-3) and sync > 0 and steps >= 0, out


def test_startup_benchmark_prints_launches_with_and_without_the_import_pause():
    out = _run("benchmarks.bench_startup", "--rounds", "1", "--steps", "1")
    assert out.startswith("benchmarks.bench_startup: 1 rank(s)"), out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()
            if line.split()[:1] in (["ddptrain"], ["baseline"]) and "/" not in line}
    assert set(rows) == {"ddptrain", "baseline"}, out
    assert all(float(wall) > 0 and float(cpu) > 0 for wall, cpu, *_ in rows.values()), out
    assert "ddptrain / baseline CPU:" in out, out


def test_attention_benchmark_prints_every_backend_beside_causal_sdpa():
    out = _run("benchmarks.bench_attention", "--seq-lens", "64,128", "--rows", "1", "--heads", "2", "--head-dim", "8",
               "--rounds", "1", "--repeats", "1")
    assert out.startswith("benchmarks.bench_attention: cpu"), out
    lines = out.splitlines()
    assert "varlen: n/a here:" in out and "flex: n/a here: FlexAttention has no backward on CPU" in out, out
    header = lines[lines.index("time, ms (x causal)") + 1].split()
    assert header[-5:] == ["causal", "mask", "gather", "varlen", "flex"], out
    rows = [line.split() for line in lines if line.split()[:2] in (["64", "short"], ["64", "long"], ["128", "short"],
                                                                   ["128", "long"])]
    assert len(rows) == 8, "4 rows of times, 4 of memory"
    timed = rows[0]
    assert timed[-2:] == ["n/a", "n/a"] and timed[-3].endswith("x") and timed[-5].endswith("x"), out
    # corpus: fresh microbatches of packed stdlib paragraphs, several documents a row on average
    out = _run("benchmarks.bench_attention", "--seq-lens", "128", "--mixes", "corpus", "--rows", "2", "--heads", "2",
               "--head-dim", "8", "--rounds", "1", "--repeats", "1", "--no-memory")
    corpus = [line.split() for line in out.splitlines() if line.split()[:2] == ["128", "corpus"]]
    assert len(corpus) == 1 and float(corpus[0][2]) > 1 and corpus[0][-3].endswith("x"), out


def test_packed_memory_benchmark_prints_the_dense_mask_beside_the_default_backend():
    out = _run("benchmarks.bench_memory_ac", "--packed", "--models", "gpt", "--n-layer", "1", "--n-embd", "16",
               "--seq-len", "256,1024", "--batch", "1")
    assert out.startswith("benchmarks.bench_memory_ac --packed: one fp32 AdamW step on 1 packed rows"), out
    rows = [line.split() for line in out.splitlines() if line.startswith("gpt ")]
    assert [row[1] for row in rows] == ["256", "1024"] and all(row[5] == "gather" for row in rows), out
    (mask_short, auto_short), (mask_long, auto_long) = ((float(row[2]), float(row[3])) for row in rows)
    assert float(rows[1][4]) == pytest.approx(auto_long / mask_long, abs=0.006), out
    # 4x the tokens: the dense mask's step grows with T^2 (its (B, 1, T, T) mask dominates at this
    # width: 16x), the boundaries' with T (the gather buffers and the activations: 4x)
    assert mask_long / mask_short > 6 and auto_long / auto_short < 5 and auto_long < mask_long, out


def test_real_memory_benchmark_prints_ddptrain_beside_a_bare_loop():
    from tests.real_model import smollm2_dir

    smollm2_dir()  # or skip, saying what is missing
    out = _run("benchmarks.bench_memory_real", "--shapes", "1x128", "--steps", "1", "--vocabularies", "smollm2")
    lines = out.splitlines()
    assert lines[0].startswith("benchmarks.bench_memory_real: full fine-tuning"), out
    assert lines[2].split() == ["model", "rows", "x", "tokens", "ddptrain", "MiB", "transformers", "MiB", "ratio"], out
    figures = lines[3].split()
    assert lines[3].startswith("SmolLM2-135M (V 49,152)") and figures[-5:-3] == ["x", "128"], out
    ours, theirs, ratio = (float(value.replace(",", "")) for value in figures[-3:])
    assert ours > 0 and theirs > 0 and ratio == pytest.approx(ours / theirs, abs=0.01), out


def test_eval_benchmark_prints_task_time_per_token_beside_the_validation_loss():
    out = _run("benchmarks.bench_eval", "--items", "8", "--val-examples", "4", "--rounds", "1", "--max-docs", "20")
    assert out.startswith("benchmarks.bench_eval: default GPT on cpu"), out
    assert "validation loss" in out and "\ntasks " in out and "(target <= 1)" in out, out


def test_data_scale_benchmark_reports_load_and_steps(tmp_path):
    out = _run("benchmarks.bench_data_scale", "--tokens", "1e5", "--dir", str(tmp_path / "scale"))
    rows = [line.split() for line in out.splitlines() if line.strip().startswith("1e+05")]
    assert [row[1:4] for row in rows] == [["this", "False", "cold"], ["this", "False", "warm"],
                                          ["this", "True", "cold"], ["this", "True", "warm"]], out
    assert not (tmp_path / "scale").exists(), "the token file and the cache are deleted"


def test_preprocess_benchmark_reports_each_ranks_share(tmp_path):
    from tests.real_text import WORDNET

    if not (WORDNET / "data.noun").is_file():
        pytest.skip(f"WordNet is not installed ({WORDNET}/data.*): apt-get install -y wordnet-base")
    tokenizers = import_optional("tokenizers")
    import_optional("datasets")
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel()
    tokenizer.train_from_iterator(["the synsets of wordnet"], tokenizers.trainers.BpeTrainer(vocab_size=300,
                                                                                             special_tokens=["[UNK]"]))
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    out = _run("benchmarks.bench_preprocess", "--lines", "200", "--ranks", "1,2", "--tokenizer",
               str(tmp_path / "tokenizer.json"))
    assert "datasets map(batched, num_proc=2)" in out and "ddptrain, 2 rank(s) (RAYON_NUM_THREADS=1)" in out, out
    shares = re.findall(r"data: shard (\d) \(rank \d\): \d+ bytes \((\d+\.\d)% of the corpus", out)
    assert [shard for shard, _ in shares] == ["0", "1"] and all(abs(float(p) - 50) < 5 for _, p in shares), out
    counts = {line.split()[-3] for line in out.splitlines() if line.startswith(("datasets", "ddptrain"))}
    assert len(counts) == 1, f"every contender counts the same tokens: {out}"


def test_grpo_learning_benchmark_prints_the_held_out_reward_along_the_run():
    from tests.real_model import smollm2_dir

    smollm2_dir()  # or skip, saying what is missing
    out = _run("benchmarks.bench_grpo_learning", "--segments", "1", "--steps", "1", "--held-out", "2", "--nproc", "1",
               "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "4")
    lines = out.splitlines()
    assert lines[0].startswith("benchmarks.bench_grpo_learning: SmolLM2-135M-Instruct + LoRA"), out
    assert lines[1].split() == ["step", "train", "reward", "held-out", "reward", "seconds"], out
    assert [line.split()[0] for line in lines[2:]] == ["0", "1"], out
    assert 0 <= float(lines[3].split()[2]) <= 1, out


def test_lora_memory_benchmark_prints_each_layouts_peak_and_live_memory_per_step():
    from tests.real_model import smollm2_dir
    from tests.real_text import wordnet_glosses

    smollm2_dir(), wordnet_glosses()  # or skip, saying what is missing
    out = _run("benchmarks.bench_memory_lora", "--steps", "1", "--global-batch", "2", "--seq-len", "64",
               "--layouts", "batch.micro_size=2;batch.micro_size=1", "--profile", "5")
    assert "aten::mm" in out, out  # the profiler's table of the last (here: only) step
    lines = out.splitlines()
    assert lines[0].startswith("benchmarks.bench_memory_lora: SmolLM2-135M-Instruct, LoRA r=16"), out
    steps = [line for line in lines if line.strip().startswith("step 0:")]
    assert len(steps) == 2, out
    for line in steps:
        peak, live = (int(re.search(rf"{key} ([\d,]+)", line)[1].replace(",", "")) for key in ("peak", "live"))
        assert 0 < live <= peak, out


def test_mfu_benchmark_prints_each_steps_mfu_against_the_probe_and_where_the_time_goes():
    out = _run("benchmarks.bench_mfu", "--runs", "default", "--steps", "3")
    assert out.startswith("benchmarks.bench_mfu: one rank's step in one process, 1 thread(s), fp32, cpu"), out
    mfus = [float(value) for value in re.findall(r"\| MFU ([\d.]+)%", out)]
    assert len(mfus) == 2 and all(0 < mfu <= 100 for mfu in mfus), out
    for part in ("matmuls", "attention", "the rest", "matmul FLOPs run / FLOPs counted"):
        assert f"    {part}" in out, out
    assert re.search(r"MFU median of steps 1..1: [\d.]+% \(by CPU time [\d.]+%\)", out), out
