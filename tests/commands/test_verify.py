"""`python -m ddptrain.verify`: the configured layout against one process over the whole global batch,
and the modules that make the arithmetic differ although the objective is the same."""

from __future__ import annotations

import logging
import math
import os
import subprocess

import pytest
import torch
from torch import nn

from ddptrain.models import GPT, GPTConfig
from ddptrain.testing import run_distributed
from ddptrain.verify import (Report, StepComparison, compose_config, disable_dropout, equivalence_caveats,
                             format_report, log_equivalence_caveats, main, relative_difference, verify)
from tests.helpers import REPO, VERIFY_RUN, python_command

BATCHNORM = ["model=custom", "model._target_=tests.commands.test_verify.make_batchnorm_lm"]


class BatchNormLM(nn.Module):
    """Embeddings, BatchNorm over (rows, positions), a head: each row's logits depend on the other rows."""

    def __init__(self, vocab_size: int, width: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.norm = nn.BatchNorm1d(width)
        self.head = nn.Linear(width, vocab_size)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.embed(idx).transpose(1, 2)).transpose(1, 2)  # (B, T, C), normalised over B and T
        return self.head(x)


def make_batchnorm_lm(vocab_size: int, width: int = 16) -> BatchNormLM:
    return BatchNormLM(vocab_size, width)


def _verify(overrides: list[str], steps: int = 2, **options):
    return verify(compose_config(overrides), steps=steps, **options)


@pytest.mark.parametrize("layout", [
    ["batch.micro_size=2"],  # accumulation of 4 microbatches
    ["batch.micro_tokens=96"],  # microbatches of different row counts, by padded tokens
    ["batch.pack=true", "batch.micro_size=4"],  # packed rows, attention per document
], ids=["accumulate", "token_budget", "packed"])
@pytest.mark.slow  # a trained run or a process launch (seconds): out of the fast tier
def test_the_default_model_agrees_to_1e_9_in_fp64(layout):
    report = _verify([*VERIFY_RUN, *layout])
    assert report.precision == "fp64" and report.tolerance == 1e-9
    assert report.caveats == [] and report.dropout_disabled == []
    assert report.agrees, format_report(report)
    assert all(step.tokens > 0 and max(step.grad_norm_difference, step.parameter_difference) <= 1e-9
               for step in report.steps)
    assert report.steps[-1].loss != report.steps[0].loss  # the weights really moved


def _verify_on_rank(overrides: list[str]):
    report = _verify(overrides)
    return report.layout, report.agrees, report.worst


@pytest.mark.slow
def test_two_ranks_with_accumulation_agree_with_one_process():
    results = run_distributed(_verify_on_rank, 2, [*VERIFY_RUN, "batch.micro_size=2"])
    for layout, agrees, worst in results:
        assert "micro 2 x accumulation 2 x world 2" in layout
        assert agrees and worst <= 1e-9, worst
    assert results[0] == results[1]  # every rank reports the same


def test_batchnorm_makes_the_layout_differ_and_is_named():
    report = _verify([*BATCHNORM, *VERIFY_RUN, "batch.micro_size=2"])
    assert not report.agrees and report.worst > 1e-6
    assert len(report.caveats) == 1 and report.caveats[0].startswith("batch-dependent: norm (BatchNorm1d)")
    text = format_report(report)
    assert "verdict: DIFFERENT" in text and "batch-dependent modules above" in text
    # With the whole global batch in one microbatch the same model agrees: the layout made the difference.
    assert _verify([*BATCHNORM, *VERIFY_RUN, "batch.micro_size=8"]).agrees


@pytest.mark.slow  # a trained run or a process launch (seconds): out of the fast tier
def test_dropout_is_named_and_turned_off_for_the_comparison():
    report = _verify([*VERIFY_RUN, "model.n_layer=1", "model.dropout=0.1", "batch.micro_size=4"])
    named = " ".join(report.caveats)
    assert all(caveat.startswith("stochastic: ") for caveat in report.caveats)
    for module in ("drop (Dropout)", "blocks.0.attn (CausalSelfAttention) drops activations with dropout=0.1",
                   "blocks.0.mlp.dropout (Dropout)"):
        assert module in named
    assert "blocks.0.attn.dropout" in report.dropout_disabled and "drop.p" in report.dropout_disabled
    assert report.agrees, format_report(report)
    assert "dropout is off (p=0) in both runs" in format_report(report)


def test_caveats_name_batch_dependent_and_stochastic_modules_only():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.GroupNorm(2, 4), nn.InstanceNorm1d(4),
                          nn.InstanceNorm1d(4, track_running_stats=True), nn.SyncBatchNorm(4), nn.BatchNorm2d(4),
                          nn.Dropout(0.0), nn.Dropout(0.2), nn.AlphaDropout(0.1))
    caveats = equivalence_caveats(model, extra_batch_dependent=["Linear"])
    named = [caveat.split(" (")[0] for caveat in caveats]
    assert named == ["batch-dependent: 0", "batch-dependent: 4", "batch-dependent: 5", "batch-dependent: 6",
                     "stochastic: 8", "stochastic: 9"]
    assert "gathered over ranks" in caveats[2] and "listed as batch-dependent" in caveats[0]
    assert equivalence_caveats(model.eval()) == caveats[1:]  # the module, not its mode, decides
    assert disable_dropout(model) == ["8.p", "9.p"] and not any(c.startswith("stochastic") for c in
                                                                 equivalence_caveats(model))
    gpt = GPT(GPTConfig(vocab_size=16, max_seq_len=8, n_layer=1, n_head=2, n_embd=8))
    assert equivalence_caveats(gpt) == []
    assert equivalence_caveats(gpt, ["blocks.0.mlp"])[0].startswith("batch-dependent: blocks.0.mlp (MLP)")


def test_the_trainer_hook_warns_once_on_rank_zero(caplog):
    with caplog.at_level(logging.WARNING, logger="ddptrain"):
        gpt = GPT(GPTConfig(vocab_size=16, max_seq_len=8, n_layer=1, n_head=2, n_embd=8))
        assert log_equivalence_caveats(gpt) == []
        assert caplog.records == []
        caveats = log_equivalence_caveats(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
    assert len(caveats) == 1
    assert [r.getMessage() for r in caplog.records][0] == f"same objective, not the same arithmetic: {caveats[0]}"


def test_cli_exit_codes_say_agree_differ_or_bad_config(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--steps", "1", *BATCHNORM, *VERIFY_RUN, "batch.micro_size=2"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 1 and "verdict: DIFFERENT" in out and "norm (BatchNorm1d)" in out
    with pytest.raises(SystemExit) as exit_info:
        main([*VERIFY_RUN, "batch.micro_size=3"])
    assert exit_info.value.code == 2
    assert "batch.global_size=8 must be divisible by batch.micro_size=3 x world size 1" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_under_torchrun_prints_one_report_that_agrees():
    command = python_command(["-m", "ddptrain.verify", "--steps", "2", *VERIFY_RUN, "batch.micro_size=2"], nproc=2)
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("verdict: AGREE") == 1  # printed once, by rank 0
    assert "micro 2 x accumulation 2 x world 2" in result.stdout


def test_every_precision_has_a_tolerance():
    from ddptrain.config.choices import PRECISIONS
    from ddptrain.verify import TOLERANCES

    assert set(TOLERANCES) == set(PRECISIONS)


@pytest.mark.slow  # over 4 s (a process launch or ranks): out of the fast tier
def test_fp16_on_the_configured_device_agrees(capsys):
    """fp16 used to crash verify with a KeyError (no tolerance), and the reference only autocast bf16.
    Now the reference autocasts fp16 too, and the engine's dynamic loss scale does not change the update.
    SGD, not AdamW: Adam's first steps move every weight by about lr whatever its gradient's size, so a
    gradient near zero that fp16 rounds to the other sign differs by 2 lr in the weights, which says
    nothing about the objective (bf16 with AdamW shows the same)."""
    with pytest.raises(SystemExit) as exited:
        main(["--steps", "2", *VERIFY_RUN, "batch.micro_size=2", "optim=sgd", "trainer.precision=fp16", "--device",
              "configured"])
    output = capsys.readouterr().out
    assert exited.value.code == 0, output
    assert "| fp16 on cpu" in output and "verdict: AGREE" in output and "<= 0.01" in output


@pytest.mark.parametrize("where", ["loss", "grad_norm", "parameter"])
@pytest.mark.parametrize("step", [0, 1])
def test_a_nan_difference_on_any_step_never_agrees(where, step):
    """Python's max() drops a NaN that follows a number (max(0.0, nan) == 0.0): a layout whose loss or
    parameters turn NaN must still be DIFFERENT, whichever step and quantity holds it."""
    rows = [dict(loss_difference=1e-12, grad_norm_difference=1e-12, parameter_difference=1e-12) for _ in range(2)]
    rows[step][f"{where}_difference"] = math.nan
    report = Report("2 ranks", "fp64", "cpu", 1e-9, [], [],
                    [StepComparison(i + 1, 5.0, 5.0, 10, **row) for i, row in enumerate(rows)])
    assert math.isnan(report.worst) and not report.agrees
    weights = {"a": torch.ones(3), "b": torch.ones(2)}
    assert math.isnan(relative_difference({"a": torch.ones(3), "b": torch.tensor([1.0, math.nan])}, weights))
    assert math.isnan(relative_difference({"a": torch.tensor([math.nan, 1, 1]), "b": torch.ones(2)}, weights))
    assert relative_difference({"a": torch.ones(3), "b": torch.tensor([1.0, 1.5])}, weights) == 0.5


@pytest.mark.parametrize("tolerance", ["-1", "inf", "nan"])
def test_a_tolerance_that_nothing_could_meet_or_everything_meets_is_refused(tolerance, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--tolerance", tolerance])
    assert exit_info.value.code == 2 and "must be a finite relative difference >= 0" in capsys.readouterr().err
