"""The memory plan: it runs for real model shapes on the meta device without allocating them, and
its collective payloads per step are the ones real gloo ranks send (FSDP's own calls included)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import ddptrain
from ddptrain.testing import record_collectives, run_distributed
from ddptrain.train.memory_plan import Layout, count_model, formula_activation_bytes, meta_device, parse_bytes, plan_strategies
from ddptrain.models import GPT, GPTConfig
from tests.helpers import REPO, SEQ, VOCAB, import_optional, microbatch, save_pretrained_llama, tiny_gpt

GPT2_SMALL = ["model.n_layer=12", "model.n_head=12", "model.n_embd=768", "data.vocab_size=50304",
              "batch.seq_len=1024", "batch.global_size=64", "batch.micro_size=4"]
LLAMA_1B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
            "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
            "vocab_size": 128256, "max_position_embeddings": 4096, "rms_norm_eps": 1e-05, "tie_word_embeddings": True,
            "hidden_act": "silu"}


# The plan run under a wrapper that prints its own peak resident memory (VmHWM) at exit. The wait4
# and RUSAGE_CHILDREN figures are not the child's own: Python starts children by vfork, and exec
# records the parent's high-water mark (a pytest worker that ran a real model reads 2.5 GB) in them.
_PEAK_AT_EXIT = """
import atexit, runpy, sys
def _peak():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                sys.stderr.write(f"\\npeak-kib {line.split()[1]}\\n")
atexit.register(_peak)
sys.argv = ["ddptrain.plan", *sys.argv[1:]]
runpy.run_module("ddptrain.plan", run_name="__main__", alter_sys=True)
"""


def _plan_cli(args: list[str]) -> tuple[subprocess.CompletedProcess, float, int]:
    """`python -m ddptrain.plan ARGS`: its output, seconds and its own peak resident memory (bytes)."""
    import os

    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", _PEAK_AT_EXIT, *args], cwd=REPO, capture_output=True, text=True,
                            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, timeout=300)
    seconds = time.monotonic() - started
    peaks = [int(line.split()[1]) for line in result.stderr.splitlines() if line.startswith("peak-kib ")]
    assert peaks, result.stderr[-3000:]
    return result, seconds, peaks[-1] * 1024


@pytest.mark.slow
def test_the_plan_of_gpt2_small_and_a_1b_llama_prints_in_seconds_without_allocating_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_1B))
    cases = {"124,373,760 parameters": ["--world-size", "16", "--ranks-per-node", "8", "--device-memory", "80GiB",
                                        *GPT2_SMALL],
             "1,235,814,400 parameters": ["--world-size", "16", "--ranks-per-node", "8", "--device-memory", "24GiB",
                                          "--bandwidth", "200GB/s", "--inter-node-bandwidth", "25GB/s", "model=hf",
                                          f"model.path={tmp_path}", "data.vocab_size=128256", "data.tokenizer=byte",
                                          "batch.seq_len=2048", "batch.global_size=32", "batch.micro_size=1",
                                          "trainer.precision=bf16", "trainer.activation_checkpointing=true"]}
    for expected, args in cases.items():
        result, seconds, peak = _plan_cli(args)
        assert result.returncode == 0, result.stderr[-3000:]
        out = result.stdout
        assert expected in out and "hsdp 2x8" in out and "pick: " in out, out
        for name in ("ddp", "zero1", "zero2", "zero3", "fsdp"):
            assert f"\n{name} " in out, name
        assert "inter-node" in out and "2(n-1)/n" in out
        print(f"{expected}: planned in {seconds:.1f} s")  # a figure: the bound is the command's limit (300 s)
        # fp32 weights alone would be 0.5 GB (GPT-2 small) and 4.9 GB (1B): none were allocated
        assert peak < 1.5e9, peak


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.slow  # over 4 s (a process launch or ranks): out of the fast tier
def test_a_directory_with_weights_is_planned_from_its_config_without_reading_them(tmp_path, lora):
    """A weighted model directory (and a LoRA adapter over it) is planned with the real model's
    parameter counts, and the weights file is never opened: garbage in its place breaks loading, not
    the plan."""
    transformers = import_optional("transformers")
    from ddptrain.models.adapters import HFAdapter

    model_dir = save_pretrained_llama(tmp_path / "llama")
    model_cfg = {"name": "hf", "path": str(model_dir), "attn_implementation": "sdpa",
                 "lora": {"r": 4 if lora else 0, "alpha": 8.0, "dropout": 0.0, "target_modules": "all-linear"}}
    real, _ = HFAdapter().build(model_cfg, 290, 64)
    trainable, parameters = real.get_nb_trainable_parameters() if lora else (real.num_parameters(),) * 2
    weights = model_dir / "model.safetensors"
    weights.write_bytes(b"\xff" * weights.stat().st_size)
    with pytest.raises(Exception):  # noqa: B017 - whatever transformers raises: the file is unreadable
        transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    result, _, _ = _plan_cli(["model=hf", f"model.path={model_dir}", f"model.lora.r={model_cfg['lora']['r']}",
                              "batch.seq_len=64", "batch.global_size=8", "batch.micro_size=2"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"memory plan: {parameters:,} parameters ({trainable:,} train)" in result.stdout, result.stdout
    assert "\nzero3 " in result.stdout and "communication per optimizer step" in result.stdout
    if lora:
        assert 0 < trainable < parameters


def test_measured_activations_follow_checkpointing_and_precision():
    def counts(precision: str, checkpointed: bool):
        from ddptrain.models.adapters import GPTAdapter

        with meta_device():
            model = tiny_gpt(torch.float32)
        if checkpointed:
            GPTAdapter().enable_activation_checkpointing(model)
        return count_model(model, {"Block"}, 4, SEQ, precision, VOCAB).activations

    plain, checkpointed, bf16 = counts("fp32", False), counts("fp32", True), counts("bf16", False)
    assert plain.how == checkpointed.how == bf16.how == "measured"
    assert 0 < checkpointed.bytes < plain.bytes and 0 < bf16.bytes < plain.bytes
    with meta_device():  # the formula, where the meta forward cannot run; 4 blocks, one recomputed at a time
        model = GPT(GPTConfig(vocab_size=VOCAB, max_seq_len=SEQ, n_layer=4, n_head=2, n_embd=16))
    assert 0 < formula_activation_bytes(model, 4, SEQ, "fp32", VOCAB, checkpointed=True) < \
        formula_activation_bytes(model, 4, SEQ, "fp32", VOCAB)
    assert parse_bytes("80GiB") == 80 * 2**30 and parse_bytes("50GB/s") == 50e9


# -- payloads against real gloo ranks -------------------------------------------------------------

CASES = [("ddp", 1, 1), ("ddp", 1, 4), ("fsdp", 1, 1), ("fsdp", 1, 4), ("fsdp", 2, 1), ("fsdp", 2, 4)]
"""(strategy, replicas, microbatches per rank): fsdp with 2 replicas is HSDP 2x2."""


def _recorded_payloads() -> list[dict]:
    out = []
    for strategy, replicate, accumulation in CASES:
        model = tiny_gpt(torch.float64)
        options = {"replicate": replicate} if strategy == "fsdp" else None
        engine = ddptrain.Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy, precision="fp64",
                                 strategy_options=options)
        microbatches = [microbatch(2, [SEQ, 5], seed) for seed in range(accumulation)]
        with record_collectives() as calls:
            engine.step(microbatches)
        out.append(_by_kind(calls))
    return out


def _by_kind(calls: list[dict]) -> dict:
    """Bytes per (collective kind, ranks) over one step, leaving out the Engine's scalars (token
    counts, loss, norm: a few bytes each)."""
    totals: dict = {}
    for call in calls:
        if call["bytes"] > 64:
            kind = call["name"].replace("_into_tensor", "").replace("_single", "").replace("_tensor", "")
            totals[(kind, call["group_size"])] = totals.get((kind, call["group_size"]), 0) + call["bytes"]
    return totals


@pytest.mark.slow  # over 4 s (a process launch or ranks): out of the fast tier
def test_a_model_directory_that_is_not_there_is_a_model_error_not_a_traceback(tmp_path):
    result = subprocess.run([sys.executable, "-m", "ddptrain.plan", "model=hf", f"model.path={tmp_path / 'nope'}"],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"model error: model.path={tmp_path / 'nope'}: no such directory" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("flags, message", [
    (["--world-size", "0"], "--world-size=0 must be an integer >= 1"),
    (["--world-size", "-2"], "--world-size=-2 must be an integer >= 1"),
    (["--ranks-per-node", "0"], "--ranks-per-node=0 must be an integer >= 1"),
    (["--ranks-per-node", "-8"], "--ranks-per-node=-8 must be an integer >= 1"),
    (["--world-size", "16", "--ranks-per-node", "5"], "--ranks-per-node=5 must divide --world-size=16"),
])
def test_a_bad_world_size_or_ranks_per_node_names_the_flag_the_value_and_the_rule(flags, message, capsys):
    from ddptrain.plan import main

    assert main([*flags, "batch.global_size=160", "batch.micro_size=2"]) == 2
    error = capsys.readouterr()
    assert f"config error: {message}" in error.err and not error.out, error


@pytest.mark.parametrize("world_size", [4, pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.slow  # every case over 4 s (ranks): out of the fast tier
def test_plan_payloads_equal_those_counted_on_gloo_ranks(world_size):
    """4 ranks: ddp, fsdp 1x4, HSDP 2x2; 2 ranks: ddp, fsdp 1x2, HSDP 2x1 (replicas only)."""
    measured = run_distributed(_recorded_payloads, world_size)[0]
    with meta_device():
        model = tiny_gpt(torch.float64)
    counts = count_model(model, {"Block"}, 2, SEQ, "fp64", VOCAB)
    for (strategy, replicate, accumulation), recorded in zip(CASES, measured):
        layout = Layout(world_size=world_size, ranks_per_node=world_size // replicate, replicate=replicate,
                        micro_batch_size=2, seq_len=SEQ, grad_accum_steps=accumulation, precision="fp64",
                        optimizer="sgd")
        name = "hsdp" if replicate > 1 else strategy
        plan = next(p for p in plan_strategies(counts, layout) if p.name == name)
        planned: dict = {}
        for c in plan.collectives:
            planned[(c.kind, c.ranks)] = planned.get((c.kind, c.ranks), 0) + c.payload * c.calls
        assert set(planned) == set(recorded), (strategy, replicate, accumulation, planned, recorded)
        for key, value in planned.items():
            assert abs(value - recorded[key]) <= 0.05 * recorded[key], (strategy, replicate, accumulation, key,
                                                                         value, recorded[key])


@pytest.mark.parametrize("micro_tokens", [32, 48, 63, 64])
def test_a_token_budget_is_planned_as_rows_that_hold_every_microbatch_it_makes(micro_tokens):
    """batch.micro_tokens is planned as rows of seq_len that hold any microbatch the budget makes:
    48 tokens of rows of 32 is 3 rows of 16 (48 positions), more than one row of 32."""
    from ddptrain.config import compose_config
    from ddptrain.config.validation import validate
    from ddptrain.data.batches import budget_microbatches
    from ddptrain.train.memory_plan import plan_for_config

    seq_len = 32
    cfg = compose_config(["model.n_layer=1", "model.n_head=2", "model.n_embd=16", f"batch.seq_len={seq_len}",
                          f"batch.micro_tokens={micro_tokens}", "batch.global_size=8"])
    validate(cfg, 1)
    _, counts, layout = plan_for_config(cfg, 1)
    lengths = np.random.default_rng(0).integers(1, seq_len + 1, size=200)
    lengths[:20] = seq_len // 2  # rows of half seq_len fill a budget that is no multiple of seq_len
    largest = max(len(group) * int(lengths[group].max())
                  for group in budget_microbatches(np.arange(len(lengths)), lengths, micro_tokens))
    assert largest <= micro_tokens
    assert layout.micro_batch_size * layout.seq_len >= largest, (layout.micro_batch_size, largest)
    assert layout.micro_batch_size * layout.seq_len < micro_tokens + seq_len  # not more rows than that takes
    assert counts.activations.bytes > 0


def _plan(overrides: list[str]):
    from ddptrain.config import compose_config
    from ddptrain.config.validation import validate
    from ddptrain.train.memory_plan import format_plan, plan_for_config

    cfg = compose_config(overrides)
    validate(cfg, 2)
    plans, counts, layout = plan_for_config(cfg, 2)
    return {plan.label: plan for plan in plans}, counts, layout, format_plan(plans, counts, layout, None)


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_a_dpo_plan_counts_two_rows_per_pair_and_the_frozen_reference_of_a_full_fine_tune(tmp_path, packed):
    """A microbatch of k pairs is planned as the 2k rows a token objective's microbatch of 2k rows
    is; a full fine-tune adds the frozen reference's weights to every strategy's total, whole, or
    divided by the ranks that shard it where the strategy shards it as the policy (fsdp and zero3: halved
    on the 2 ranks here); with precomputed log-probs, or LoRA's adapter disabled, nothing is added."""
    model = ["model.n_layer=2", "model.n_head=2", "model.n_embd=32", "data.vocab_size=256", "batch.seq_len=32",
             f"batch.pack={str(packed).lower()}"]
    dpo = ["objective=dpo", "data=preference", "data.paths=[p.jsonl]", "batch.global_size=8"]
    k = 2  # 8 pairs a step, 2 a microbatch: 16 rows a step, 4 a microbatch
    token_2k, token_counts, _, _ = _plan([*model, "batch.global_size=16", f"batch.micro_size={2 * k}"])
    token_k, _, _, _ = _plan([*model, "batch.global_size=16", f"batch.micro_size={k}"])
    plans, counts, layout, table = _plan([*model, *dpo, f"batch.micro_size={k}"])
    assert layout.micro_batch_size == 2 * k
    assert counts.parameters == token_counts.parameters
    assert counts.reference_bytes == counts.parameters * 4  # fp32 weights, whole
    for label, plan in plans.items():
        assert plan.activations.bytes == token_2k[label].activations.bytes > token_k[label].activations.bytes
        assert plan.reference == counts.reference_bytes / plan.frozen_copy_shards
        assert plan.total == pytest.approx(token_2k[label].total + plan.reference), label
    assert " reference " in table.splitlines()[2] and "2 pair(s) per microbatch are 4 rows" in table, table
    assert plans["fsdp"].reference == plans["zero3"].reference == counts.reference_bytes / 2
    assert plans["zero2"].reference == counts.reference_bytes
    assert "frozen copy of the weights, sharded as fsdp and zero3 shard the policy" in table

    precomputed, counts, _, table = _plan([*model, *dpo, f"batch.micro_size={k}", "objective.precompute_reference=true"])
    assert counts.reference_bytes == 0 and all(plan.reference == 0 for plan in precomputed.values())
    assert " reference " not in table.splitlines()[2] and "log-probs are precomputed" in table
    assert all(plan.activations.bytes == token_2k[label].activations.bytes for label, plan in precomputed.items())


def test_the_plan_of_the_default_layout_is_of_the_layout_the_run_resolves():
    """batch.pack and batch.micro_size left null: a DPO plan is of one packed row of 2 x seq_len per
    microbatch (planned as 2 rows), a text run's of 8 unpacked rows, as the run itself resolves them."""
    model = ["model.n_layer=2", "model.n_head=2", "model.n_embd=32", "data.vocab_size=256", "batch.seq_len=32"]
    _, _, layout, table = _plan([*model, "objective=dpo", "data=preference", "data.paths=[p.jsonl]",
                                 "batch.global_size=8"])
    assert layout.micro_batch_size == 2 and "1 pair(s) per microbatch are 2 rows" in table, table
    _, _, layout, _ = _plan([*model, "batch.global_size=16"])
    assert (layout.micro_batch_size, layout.grad_accum_steps) == (8, 1)


@pytest.mark.slow  # peft and a transformers model
def test_a_lora_dpo_plan_holds_no_reference_copy(tmp_path):
    import_optional("peft")
    model_dir = save_pretrained_llama(tmp_path / "llama")
    _, counts, layout, table = _plan(["model=hf", f"model.path={model_dir}", "model.lora.r=4", "objective=dpo",
                                      "data=preference", "data.paths=[p.jsonl]", "batch.seq_len=32",
                                      "batch.global_size=8", "batch.micro_size=2"])
    assert layout.micro_batch_size == 4 and counts.reference_bytes == 0
    assert "base with the LoRA adapter disabled" in table and " reference " not in table.splitlines()[2]
