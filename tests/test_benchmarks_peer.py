"""bench_peer's modes still run (tiny sizes, one rank): ddptrain beside the Hugging Face Trainer and TRL; they
print figures, the tests check only the shape."""

from __future__ import annotations

import re

import pytest

from tests.helpers import import_optional
from tests.helpers import run_benchmark as _run

pytestmark = pytest.mark.slow

def test_peer_benchmark_compares_packed_rows_with_the_trainers_group_by_length():
    import_optional("transformers")
    # Two contenders on one rank each keep it short: the others print the same rows, and what is
    # checked (the rows, the ratios, packing's efficiency beside group_by_length's) needs no second rank.
    out = _run("benchmarks.bench_peer", "--contenders", "ddptrain-pack,hf-group", "--rounds", "1", "--steps", "4",
               "--log-every", "2", "--seq-len", "128", "--width", "32", "--layers", "1", "--world-size", "1")
    assert out.startswith("benchmarks.bench_peer: Llama 1 x 32, seq_len 128, "), out
    lines = out.splitlines()
    rows = {line.split()[0]: line.split()[1:] for line in lines
            if line.split()[:1] in (["ddptrain-pack"], ["hf-group"]) and "/" not in line}
    rate = {name: float(values[0].replace(",", "")) for name, values in rows.items()}
    efficiency = {name: float(values[1]) for name, values in rows.items()}
    assert sorted(rows) == ["ddptrain-pack", "hf-group"] and all(r > 0 for r in rate.values()), out
    assert 0 < efficiency["hf-group"] <= efficiency["ddptrain-pack"] <= 1, out
    line = next(line for line in lines if line.startswith("ddptrain-pack / hf-group: median ratio "))
    assert float(line.split()[5]) == pytest.approx(rate["ddptrain-pack"] / rate["hf-group"], abs=0.006), out
    assert float(line.split()[-1]) == pytest.approx(efficiency["ddptrain-pack"] / efficiency["hf-group"], abs=0.006)


def test_peer_benchmark_compiles_the_contenders_named_with_plus_compile(tmp_path):
    """`+compile` is trainer.compile=true for ddptrain and torch_compile=True for the Trainer (whose
    worker fails if that compiled nothing); both write Inductor's cache, here a fresh directory."""
    import_optional("transformers")
    cache = tmp_path / "inductor"
    # One rank each: what is checked is the compiling, which two ranks would do twice.
    out = _run("benchmarks.bench_peer", "--contenders", "ddptrain-pack+compile,hf-group+compile", "--rounds", "1",
               "--steps", "4", "--log-every", "2", "--seq-len", "64", "--global-batch", "4", "--micro", "2",
               "--width", "32", "--layers", "1", "--world-size", "1", env={"TORCHINDUCTOR_CACHE_DIR": str(cache)})
    lines = out.splitlines()
    rows = [line.split()[0] for line in lines[lines.index("") + 2:] if "/" not in line]
    assert rows == ["ddptrain-pack+compile", "hf-group+compile"], out
    assert any(line.startswith("ddptrain-pack+compile / hf-group+compile: median ratio ") for line in lines), out
    assert any(path.is_file() for path in cache.rglob("*")), "nothing compiled into TORCHINDUCTOR_CACHE_DIR"


def test_peer_benchmark_sft_mode_compares_ddptrain_layouts_with_trl():
    import_optional("trl")
    # Two contenders keep it short (each is a 2-rank torchrun); the other layouts print the same rows.
    out = _run("benchmarks.bench_peer", "--mode", "sft", "--contenders", "ddptrain-pack,trl", "--rounds", "1",
               "--steps", "2", "--log-every", "1", "--world-size", "1",
               "--seq-len", "128", "--global-batch", "2", "--micro", "1", "--chats", "40", "--words", "200",
               "--vocab", "400", "--width", "32", "--layers", "1", "--heads", "2")
    assert out.startswith("benchmarks.bench_peer --mode sft: Llama 1 x 32, vocab 400, 40 chats"), out
    lines = out.splitlines()
    assert lines[lines.index("") + 1].split() == ["valid", "targets/s", "round", "1", "median", "padding", "eff."], out
    rows = {line.split()[0]: line.split()[1:] for line in lines if "/" not in line and len(line.split()) == 4}
    assert "ddptrain-micro" not in rows and "ddptrain-budget" not in rows, out
    for name in ("ddptrain-pack", "trl"):
        rate, median, efficiency = (float(value.replace(",", "")) for value in rows[name])
        assert rate == median > 0 and 0 < efficiency <= 1, out
        if name != "trl":
            ratio = float(next(line for line in lines if line.startswith(f"{name} / trl ")).split()[-1])
            assert ratio == pytest.approx(rate / float(rows["trl"][0].replace(",", "")), rel=0.01, abs=0.006), out
    assert lines[-1].startswith("best ddptrain layout: ddptrain-") and lines[-1].endswith("(target >= 1.3)"), out


def test_peer_benchmark_dpo_mode_prints_pairs_per_second_and_peak_memory_beside_trl():
    import_optional("trl")
    import_optional("peft")
    out = _run("benchmarks.bench_peer", "--mode", "dpo", "--contenders", "ddptrain-pack,trl", "--rounds", "1",
               "--steps", "2", "--log-every", "1", "--seq-len", "128", "--global-batch", "2", "--micro", "1",
               "--pairs", "40", "--words", "200", "--vocab", "400", "--width", "32", "--layers", "1", "--heads", "2",
               "--world-size", "1")
    lines = out.splitlines()
    assert lines[0].startswith("benchmarks.bench_peer --mode dpo: Llama 1 x 32, vocab 400 ("), out
    assert re.search(r", 40 pairs of \d+\.\.\d+ padded positions", lines[0]), out
    for finetune in ("lora", "full"):
        round_line = rf"{finetune} round 1: ddptrain-pack [\d.,]+, trl [\d.,]+"
        assert any(re.fullmatch(round_line, line) for line in lines), out
        header = lines.index(next(line for line in lines if line.startswith(f"{finetune}: contender")))
        rows = {line.split()[0]: line.split()[1:] for line in lines[header + 1 : header + 3]}
        for name in ("ddptrain-pack", "trl"):
            rate, peak, ratio, peak_ratio, per_round = (float(value.replace(",", "")) for value in rows[name])
            assert rate > 0 and peak > 100 and ratio == per_round > 0 and peak_ratio > 0, out
        assert [float(value) for value in rows["trl"][2:4]] == [1.0, 1.0], out
    memory = lines.index(next(line for line in lines if line.startswith("peak MiB, LoRA")))
    for line, name in zip(lines[memory + 1 :], ("ddptrain-pack", "trl"), strict=True):
        row = line.split()
        lora, full, difference = (float(value.replace(",", "")) for value in (row[1], row[2], row[-1]))
        assert row[0] == name and row[3:6] == ["full", "-", "lora"] and difference == pytest.approx(full - lora, abs=1)


def test_peer_benchmark_step_mode_times_packed_rows_beside_group_by_length_in_one_process():
    import_optional("transformers")
    out = _run("benchmarks.bench_peer", "--mode", "step", "--seq-len", "64", "--width", "32", "--layers", "1",
               "--steps", "2", "--passes", "2", "--warmup", "1")
    assert out.startswith("benchmarks.bench_peer --mode step: Llama 1 x 32, seq_len 64, one rank of 2: 8 seq"), out
    lines = out.splitlines()
    rows = {line.split()[0]: line.split()[1:] for line in lines if "/" not in line and line.split()[:1] and
            line.split()[0] in ("engine-pack", "engine-group", "hand-group")}
    assert sorted(rows) == ["engine-group", "engine-pack", "hand-group"], out
    rate = {name: float(values[0].replace(",", "")) for name, values in rows.items()}
    efficiency = {name: float(values[1]) for name, values in rows.items()}
    assert all(len(values) == 4 for values in rows.values()), "tok/s, padding eff., one rate per pass"
    # both group loops train on the same microbatches; packing computes fewer padded positions
    assert efficiency["engine-group"] == efficiency["hand-group"] < efficiency["engine-pack"] <= 1, out
    line = next(line for line in lines if line.startswith("engine-pack / hand-group: "))
    assert float(line.split()[3].rstrip(";")) == pytest.approx(rate["engine-pack"] / rate["hand-group"], abs=0.006), out
    assert float(line.split()[-1]) == pytest.approx(efficiency["engine-pack"] / efficiency["hand-group"], abs=0.006)


def _real_peer(mode: str, contenders: tuple[str, str], examples: tuple[str, str]) -> tuple[str, list[str], dict]:
    """bench_peer's --real `mode` on one rank at tiny sizes (skips, saying what is missing, without the
    real model, WordNet or TRL): (output, its lines, the report's rows by contender); each contender's
    rate, peak, ratios and per-round ratio are checked here."""
    from tests.real_model import smollm2_dir
    from tests.real_text import wordnet_glosses

    import_optional("trl")
    smollm2_dir(), wordnet_glosses()  # or skip, saying what is missing
    out = _run("benchmarks.bench_peer", "--mode", mode, "--real", "--contenders", ",".join(contenders),
               "--finetune", "lora", "--rounds", "1", "--steps", "2", "--log-every", "1", *examples,
               "--global-batch", "2", "--micro", "1", "--seq-len", "128", "--world-size", "1")
    lines = out.splitlines()
    assert lines[0].startswith(f"benchmarks.bench_peer --mode {mode} --real: SmolLM2-135M-Instruct"), out
    rows = {line.split()[0]: line.split()[1:] for line in lines[lines.index("") + 2:] if line.strip()}
    for name in contenders:
        rate, peak, ratio, peak_ratio, per_round = (float(value.replace(",", "")) for value in rows[name])
        assert rate > 0 and peak > 100 and ratio == per_round > 0 and peak_ratio > 0, out
    return out, lines, rows


def test_peer_benchmark_sft_real_mode_prints_rates_and_peak_memory_beside_trl():
    out, lines, rows = _real_peer("sft", ("ddptrain-default", "trl"), ("--chats", "40"))
    assert re.fullmatch(r"trl-pack keeps documents apart: (yes|NO) \(.*\)", lines[1]), out
    assert [float(value) for value in rows["trl"][2:4]] == [1.0, 1.0], out


def test_peer_benchmark_dpo_real_mode_prints_pairs_per_second_and_peak_memory_beside_trl():
    _real_peer("dpo", ("ddptrain-pack", "trl"), ("--pairs", "24"))


def test_peer_benchmark_grpo_mode_prints_seconds_per_step_and_peak_memory_beside_trl():
    import_optional("trl")
    import_optional("peft")
    out = _run("benchmarks.bench_peer", "--mode", "grpo", "--finetune", "lora", "--rounds", "1", "--steps", "2",
               "--log-every", "1", "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "8",
               "--prompts", "16", "--width", "32", "--layers", "1", "--heads", "2", "--world-size", "1")
    lines = out.splitlines()
    assert lines[0].startswith("benchmarks.bench_peer --mode grpo: Llama 1 x 32, vocab 400, two-digit sums, "
                               "exact_match; 2 prompts x 2 completions of <= 8 tokens per step"), out
    assert any(re.fullmatch(r"lora round 1: ddptrain [\d.]+ s/step, trl [\d.]+ s/step", line) for line in lines), out
    header = lines.index(next(line for line in lines if line.startswith("lora: contender")))
    rows = {line.split()[0]: line.split()[1:] for line in lines[header + 1 : header + 3]}
    assert sorted(rows) == ["ddptrain", "trl"], out
    for name in ("ddptrain", "trl"):
        seconds, peak, ratio, peak_ratio, per_round = (float(value.replace(",", "")) for value in rows[name])
        assert seconds > 0 and peak > 100 and ratio == per_round > 0 and peak_ratio > 0, out
    assert [float(value) for value in rows["trl"][2:4]] == [1.0, 1.0], out
