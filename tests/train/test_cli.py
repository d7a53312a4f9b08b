"""`python -m ddptrain` and `torchrun -m ddptrain` end to end: layouts, run dir, config errors."""

from __future__ import annotations

import math

import pytest

from tests.helpers import TINY_RUN, read_metrics, run_cli

pytestmark = pytest.mark.slow

# (ranks, micro size) with global batch 8: accumulation 1, 2, 2 and 4.
LAYOUTS = [(1, 8), (1, 4), (2, 2), (2, 1)]
LAYOUT_RUN = [*TINY_RUN, "batch.global_size=8", "batch.seq_len=256", "trainer.max_steps=20"]


def _train_layouts(tmp_path, precision: str) -> dict[tuple[int, int], list[dict]]:
    curves = {}
    for ranks, micro in LAYOUTS:
        run_dir = tmp_path / f"{precision}-{ranks}x{micro}"
        result = run_cli([*LAYOUT_RUN, f"batch.micro_size={micro}", f"trainer.precision={precision}",
                          f"run.dir={run_dir}"], nproc=ranks)
        assert result.returncode == 0, result.stderr[-3000:]
        curves[(ranks, micro)] = read_metrics(run_dir)
    return curves


@pytest.mark.parametrize("precision, tolerance", [("fp64", 1e-9), ("fp32", 1e-4)])
def test_layouts_give_the_same_loss_curve(tmp_path, precision, tolerance):
    curves = _train_layouts(tmp_path, precision)
    reference = curves[LAYOUTS[0]]
    assert [m["step"] for m in reference] == list(range(1, 21))
    full = 8 * 256
    assert any(m["tokens"] < full for m in reference), "no ragged step: the test would not show the objective"
    assert reference[-1]["loss"] < reference[0]["loss"], "the loss should fall"
    for layout, curve in curves.items():
        assert [m["tokens"] for m in curve] == [m["tokens"] for m in reference], layout
        for mine, ref in zip(curve, reference):
            assert math.isclose(mine["loss"], ref["loss"], rel_tol=tolerance), (layout, mine["step"], mine["loss"], ref["loss"])
        assert math.isclose(curve[-1]["val_loss"], reference[-1]["val_loss"], rel_tol=tolerance), layout


def test_token_budgets_and_packing_keep_the_loss_curve_through_the_cli(tmp_path):
    base = [*TINY_RUN, "batch.global_size=8", "batch.seq_len=256", "trainer.max_steps=6", "trainer.precision=fp64"]
    families = {
        "unpacked": {"1x8": (1, ["batch.micro_size=8"]), "budget_2_ranks": (2, ["batch.micro_tokens=512"]),
                     "budget_1_rank": (1, ["batch.micro_tokens=1024"])},
        "packed": {"pack_1x8": (1, ["batch.pack=true", "batch.micro_size=8"]),
                   "pack_2x1": (2, ["batch.pack=true", "batch.micro_size=1"]),
                   "pack_budget_1_rank": (1, ["batch.pack=true", "batch.micro_tokens=768"])},
    }
    for family, runs in families.items():
        curves = {}
        for name, (ranks, extra) in runs.items():
            run_dir = tmp_path / name
            result = run_cli([*base, *extra, f"run.dir={run_dir}"], nproc=ranks)
            assert result.returncode == 0, result.stderr[-3000:]
            curves[name] = read_metrics(run_dir)
        reference = next(iter(curves.values()))
        for name, curve in curves.items():
            assert [m["tokens"] for m in curve] == [m["tokens"] for m in reference], name
            for mine, ref in zip(curve, reference):
                assert math.isclose(mine["loss"], ref["loss"], rel_tol=1e-9), (family, name, mine["step"])
            # eval microbatches follow the layout (micro_size rows or the micro_tokens budget): same token mean
            assert math.isclose(curve[-1]["val_loss"], reference[-1]["val_loss"], rel_tol=1e-9), (family, name)
        if family == "packed":
            assert all(m["padding_efficiency"] > 0.99 for m in reference)


def test_run_dir_is_shared_and_written_by_rank_zero_only(tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli([*TINY_RUN, "trainer.max_steps=3", "batch.global_size=4", "batch.micro_size=1",
                      "batch.seq_len=64", f"run.dir={run_dir}"], nproc=2, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"], "Hydra must not create outputs/ or .hydra/"
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoints", "config.yaml", "final", "metrics.jsonl",
                                                         "train.log"]
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for key in ("step", "loss", "tokens", "lr", "grad_norm", "tokens_per_second"):
        assert all(key in m for m in metrics), key
    assert "rank1" not in result.stdout + result.stderr.replace("[rank1]", ""), "rank 1 must stay silent"
    assert "batch:\n  global_size: 4" in (run_dir / "config.yaml").read_text()


BAD_CONFIGS = [
    (["strategy=zero7"], 1, ["strategy/zero7"]),  # Hydra's refusal: its own exit
    (["optim.weight_decay=-0.1"], 1, ["config error: optim.weight_decay=-0.1 must be a finite number >= 0"]),
    (["strategy=zero2", "++strategy.deepspeed.gradient_clipping=0.5"], 2,
     ["config error: strategy.deepspeed.gradient_clipping=0.5 contradicts trainer.grad_clip"]),
    (["batch.global_size=6", "batch.micro_size=4"], 2,
     ["batch.global_size=6 must be divisible by batch.micro_size=4 x world size 2"]),
]
"""A launch per kind of exit: Hydra's, and validate_run's ConfigError on one rank and on two."""


@pytest.mark.parametrize("overrides, ranks, messages", BAD_CONFIGS, ids=[" ".join(c[0]) for c in BAD_CONFIGS])
def test_bad_config_fails_before_training_on_every_rank(tmp_path, overrides, ranks, messages):
    run_dir = tmp_path / "run"
    result = run_cli([*TINY_RUN, f"run.dir={run_dir}", *overrides], nproc=ranks, timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    for message in messages:
        assert output.count(message) >= ranks, f"{message!r} not reported by all {ranks} ranks:\n{output[-3000:]}"
    assert not run_dir.exists(), "a config error must fail before the run dir is made"


IN_PROCESS_BAD_CONFIGS = [
    (["batch.micro_size=0"], "batch.micro_size=0 must be > 0"),
    (["trainer.max_steps=-3"], "trainer.max_steps=-3 must be > 0"),
    (["trainer.precision=fp8"], "trainer.precision='fp8' is not one of fp32, fp64, bf16, fp16"),
    (["trainer.max_stepz=3"], "max_stepz"),
    (["batch.micro_tokens=100", "batch.seq_len=128"], "batch.micro_tokens=100 must be >= batch.seq_len=128"),
    (["trainer.precision=fp64", "strategy=zero2"], "trainer.precision=fp64 is not supported with strategy=zero2"),
]


@pytest.mark.parametrize("overrides, message", IN_PROCESS_BAD_CONFIGS,
                         ids=[" ".join(c[0]) for c in IN_PROCESS_BAD_CONFIGS])
def test_bad_config_is_refused_by_the_checks_the_command_runs_first(overrides, message):
    """The command's first two steps, composing and validate_run, in this process: what reaches a user
    through them is what BAD_CONFIGS' launches show (Hydra's exit, or "config error: ..." and exit 2)."""
    from ddptrain.config.compose import compose_config
    from ddptrain.train.builder import validate_run

    with pytest.raises(Exception) as error:  # Hydra's composition error, or a ConfigError
        validate_run(compose_config([*TINY_RUN, *overrides]), 1)
    assert message in str(error.value), str(error.value)
