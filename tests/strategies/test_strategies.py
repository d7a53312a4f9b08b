"""Every strategy, one interface: FSDP2, and ranks with different numbers of microbatches on ZeRO
and FSDP (filler microbatches), against one process that saw everything; sharded checkpoints."""

from __future__ import annotations

import math
import shutil

import pytest
import torch

import ddptrain
from ddptrain.testing import run_distributed
from tests.helpers import (TINY_RUN, import_deepspeed, read_metrics, relative_difference, requires_deepspeed, run_cli,
                           tiny_gpt)
from tests.strategies.curves import assert_same_curves, loss_curve
from tests.engine.reference import all_microbatches, case_microbatches, reference_step, update

RAGGED = "ragged_with_empty_microbatch"  # rank 1 holds one microbatch fewer than rank 0


def _step(strategy: str, case: str, precision: str, grad_clip: float | None = None):
    dtype = torch.float64 if precision == "fp64" else torch.float32
    model = tiny_gpt(dtype)
    engine = ddptrain.Engine(model, torch.optim.SGD(model.parameters(), lr=1.0), strategy, precision=precision,
                             grad_clip=grad_clip, strategy_options={"micro_batch_size": 3, "grad_accum_steps": 3}
                             if strategy.startswith("zero") else None)
    stats = engine.step(case_microbatches(case, ddptrain.get_rank()))
    weights = engine.model_state_dict()
    try:
        engine.state_dict()
        in_memory = "returned"
    except NotImplementedError as error:
        in_memory = str(error)
    return stats, weights, in_memory


def _check_against_reference(results, case: str, tolerance: float, grad_clip: float | None = None) -> None:
    ref_loss, ref_tokens, before, ref_params = reference_step(all_microbatches(case))
    if grad_clip is not None:  # the reference with clipping by the global norm
        model = tiny_gpt(torch.float64)
        from ddptrain.contract.targets import IGNORE_INDEX
        from ddptrain.engine.objective import token_loss_sum

        microbatches = all_microbatches(case)
        loss = torch.stack([token_loss_sum(model(x), y) for x, y in microbatches]).sum()
        (loss / sum(int((y != IGNORE_INDEX).sum()) for _, y in microbatches)).backward()
        ref_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip))
        torch.optim.SGD(model.parameters(), lr=1.0).step()
        ref_params = {k: v.detach().clone() for k, v in model.state_dict().items()}
        assert ref_norm > grad_clip, "the clip must bite"
    for rank, (stats, params, _) in enumerate(results):
        assert stats.tokens == ref_tokens
        assert math.isclose(stats.loss, ref_loss, rel_tol=tolerance), (rank, stats.loss, ref_loss)
        assert relative_difference(params, ref_params) < tolerance, rank
        assert relative_difference(update(params, before), update(ref_params, before)) < tolerance * 100, rank
        if grad_clip is not None:
            assert math.isclose(stats.grad_norm, ref_norm, rel_tol=tolerance)


@pytest.mark.parametrize("case", [RAGGED, pytest.param("rank_without_valid_targets", marks=pytest.mark.slow)])
@pytest.mark.slow  # a trained run or a process launch (seconds): out of the fast tier
def test_fsdp_in_fp64_equals_one_process(case):
    results = run_distributed(_step, 2, "fsdp", case, "fp64")
    _check_against_reference(results, case, 1e-9)
    fillers = 1 if case == RAGGED else 0
    assert all(stats.filler_microbatches == fillers for stats, _, _ in results)
    assert "sharded" in results[0][2], "Engine.state_dict() must not return state without the optimizer"


def _fillers_told_the_most(case: str) -> list[int]:
    """filler_microbatches of 4 fsdp steps told `max_microbatches` as the trainer tells it (from the global
    layout), so that no step waits for the counts before its first forward."""
    model = tiny_gpt(torch.float64)
    engine = ddptrain.Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), "fsdp", precision="fp64")
    most = max(len(case_microbatches(case, rank)) for rank in range(ddptrain.get_world_size()))
    return [engine.step(case_microbatches(case, ddptrain.get_rank()), max_microbatches=most).filler_microbatches
            for _ in range(4)]


@pytest.mark.slow
def test_fillers_are_counted_from_the_reduced_counts_when_the_trainer_gives_the_most():
    """All ranks' fillers: 1 where rank 1 holds one microbatch fewer, 0 where both hold two. Counted before
    the counts' all-reduce was waited for, a rank read its own count alone (2 x 3 - 3 and 2 x 3 - 2 here)."""
    assert run_distributed(_fillers_told_the_most, 2, RAGGED) == [[1] * 4, [1] * 4]
    assert run_distributed(_fillers_told_the_most, 2, "rank_without_valid_targets") == [[0] * 4, [0] * 4]


@pytest.mark.slow
def test_fsdp_clips_by_the_global_norm_of_sharded_gradients():
    results = run_distributed(_step, 2, "fsdp", RAGGED, "fp64", 0.1)
    _check_against_reference(results, RAGGED, 1e-9, grad_clip=0.1)


@pytest.mark.parametrize("strategy", ["fsdp", pytest.param("zero1", marks=pytest.mark.slow),
                                      pytest.param("zero2", marks=pytest.mark.slow),
                                      pytest.param("zero3", marks=pytest.mark.slow)])
@pytest.mark.slow  # every case over 4 s (ranks): out of the fast tier
def test_ranks_with_one_microbatch_fewer_equal_one_process_in_fp32(strategy):
    if strategy.startswith("zero"):
        import_deepspeed()  # skips only when DeepSpeed is not installed
    results = run_distributed(_step, 2, strategy, RAGGED, "fp32")
    _check_against_reference(results, RAGGED, 2e-5)
    fillers = [stats.filler_microbatches for stats, _, _ in results]
    assert fillers == [1, 1] if strategy != "zero1" else fillers == [0, 0], fillers
    if strategy != "zero1":
        assert "sharded" in results[0][2]


# -- through the CLI ------------------------------------------------------------------------------

@pytest.mark.slow
def test_fsdp_layouts_give_the_same_loss_curve_in_fp64(tmp_path):
    fp64 = ["trainer.precision=fp64"]
    curves = {"ddp 1x8": loss_curve(tmp_path, "ddp", 1, [*fp64, "batch.micro_size=8"]),
              "fsdp 1x4": loss_curve(tmp_path, "fsdp1", 1, [*fp64, "strategy=fsdp", "batch.micro_size=4"]),
              "fsdp 2x2": loss_curve(tmp_path, "fsdp2", 2, [*fp64, "strategy=fsdp", "batch.micro_size=2"]),
              "fsdp 2x1 no reshard": loss_curve(tmp_path, "fsdp3", 2, [*fp64, "strategy=fsdp", "batch.micro_size=1",
                                                                          "strategy.reshard_after_forward=false"]),
              "fsdp budget": loss_curve(tmp_path, "fsdp4", 2, [*fp64, "strategy=fsdp", "batch.micro_tokens=256"])}
    assert_same_curves(curves, 1e-9)
    packed = {"ddp pack 1x8": loss_curve(tmp_path, "pack-ddp", 1, [*fp64, "batch.pack=true", "batch.micro_size=8"]),
              "fsdp pack 2x1": loss_curve(tmp_path, "pack-fsdp", 2, [*fp64, "strategy=fsdp", "batch.pack=true",
                                                                      "batch.micro_size=1"])}
    assert_same_curves(packed, 1e-9)


@pytest.fixture(scope="module")
def ddp_budget_curves(tmp_path_factory) -> dict:
    """ddp's curves on 2 ranks with a token budget, unpacked and packed: the zero runs' references."""
    tmp_path = tmp_path_factory.mktemp("ddp_budget")  # the zero runs use its corpus too
    return {"dir": tmp_path, "ddp budget": loss_curve(tmp_path, "ddp", 2, ["batch.micro_tokens=160"]),
            "ddp pack": loss_curve(tmp_path, "ddp-pack", 2, ["batch.pack=true", "batch.micro_tokens=384"])}


@pytest.mark.slow
@requires_deepspeed
@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_token_budgets_and_packing_run_under_zero(strategy, ddp_budget_curves):
    tmp_path = ddp_budget_curves["dir"]
    curves = {"ddp budget": ddp_budget_curves["ddp budget"],
              f"{strategy} budget": loss_curve(tmp_path, strategy, 2,
                                               [f"strategy={strategy}", "batch.micro_tokens=160"])}
    assert_same_curves(curves, 2e-5)
    assert curves[f"{strategy} budget"][-1]["filler_microbatches"] > 0, "the budget layout must be ragged in counts"
    packed = {"ddp pack": ddp_budget_curves["ddp pack"],
              f"{strategy} pack": loss_curve(tmp_path, f"{strategy}-pack", 2,
                                             [f"strategy={strategy}", "batch.pack=true", "batch.micro_tokens=384"])}
    assert_same_curves(packed, 2e-5)


@pytest.mark.slow  # over 4 s (a process launch or ranks): out of the fast tier
def test_an_unknown_shard_module_is_refused_before_the_process_group_naming_the_classes_there_are(tmp_path):
    """strategy.shard_modules names classes of the built model: before, a typo was a ValueError traceback
    (exit code 1) after the process group and the device mesh had started, naming no valid class."""
    import torch.distributed as dist

    from ddptrain.config.schema import ConfigError
    from ddptrain.strategies.fsdp import FSDPStrategy

    model = tiny_gpt()
    strategy = FSDPStrategy(shard_modules=["Blok"])
    strategy.configure(grad_clip=None, precision="fp64")
    with pytest.raises(ConfigError, match=r"strategy.shard_modules=\['Blok'\] names Blok, which GPT does not contain; "
                                          r"its module classes are Block, CausalSelfAttention, .*shards its blocks: Block"):
        strategy.setup(model, torch.optim.SGD(model.parameters(), lr=1.0), torch.device("cpu"))
    assert not dist.is_initialized()
    result = run_cli([*TINY_RUN, "batch.seq_len=32", "batch.global_size=2", "batch.micro_size=1", "trainer.max_steps=1",
                      "strategy=fsdp", "strategy.shard_modules=[Blok]", f"run.dir={tmp_path / 'run'}"])
    assert result.returncode == 2, result.stderr[-3000:]
    assert "config error: strategy.shard_modules=['Blok'] names Blok" in result.stderr
    assert "Traceback" not in result.stderr


# -- sharded checkpoints --------------------------------------------------------------------------


@pytest.mark.slow
def test_fsdp_resumes_bitwise_and_load_model_reads_its_checkpoint(tmp_path):
    args = [*TINY_RUN, "strategy=fsdp", "trainer.precision=fp64", "batch.global_size=8", "batch.seq_len=128",
            "batch.micro_size=2", "optim.decay_steps=8"]
    straight = tmp_path / "straight"  # its checkpoint of step 4 is the one the other run resumes from
    assert run_cli([*args, "trainer.max_steps=8", "checkpoint.every=4", f"run.dir={straight}"], nproc=2).returncode == 0
    same = tmp_path / "same"  # the straight run as it stood after step 4, not trained a second time
    shutil.copytree(straight, same)
    shutil.rmtree(same / "checkpoints" / "step_00000008")
    shutil.rmtree(same / "final")
    (same / "metrics.jsonl").write_text("".join(line + "\n" for line in
                                                (same / "metrics.jsonl").read_text().splitlines()[:4]))
    result = run_cli([*args, "trainer.max_steps=8", "checkpoint.every=4", f"run.dir={same}"], nproc=2)
    assert result.returncode == 0 and "resumed from" in result.stderr, result.stderr[-3000:]
    assert [m["loss"] for m in read_metrics(same)] == [m["loss"] for m in read_metrics(straight)]  # bitwise
    # Resharding to other world sizes and strategies: tests/runs/test_transitions.py and tests/strategies/test_hsdp.py.
    reference = ddptrain.load_model(straight)
    assert relative_difference(ddptrain.load_model(same).state_dict(), reference.state_dict()) == 0
    shutil.rmtree(same / "final")  # load_model reads the DCP checkpoint itself
    assert relative_difference(ddptrain.load_model(same).state_dict(), reference.state_dict()) == 0


def _save_with_a_nan_on_rank_one(strategy: str, directory: str):
    """One step, then a NaN in rank 1's own part of one weight (its shard, where sharded), then a save."""
    import os

    model = tiny_gpt(torch.float32)
    engine = ddptrain.Engine(model, torch.optim.SGD(model.parameters(), lr=1.0), strategy,
                             strategy_options={"micro_batch_size": 3, "grad_accum_steps": 3}
                             if strategy.startswith("zero") else None)
    engine.step(case_microbatches(RAGGED, ddptrain.get_rank()))
    if ddptrain.get_rank() == 1:
        with torch.no_grad():
            param = next(p for p in engine.strategy.model.parameters() if engine.strategy.local_tensor(p).numel())
            engine.strategy.local_tensor(param).view(-1)[0] = float("nan")
    target = os.path.join(directory, f"rank{ddptrain.get_rank()}")
    try:
        engine.save(target)
    except FloatingPointError as error:
        return str(error), os.path.exists(target)
    return None, os.path.exists(target)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", pytest.param("zero2", marks=pytest.mark.slow),
                                      pytest.param("zero3", marks=pytest.mark.slow)])
@pytest.mark.slow  # every case over 4 s (ranks): out of the fast tier
def test_non_finite_weights_are_refused_at_save_on_every_rank(strategy, tmp_path):
    """The check runs on each rank's own weights (ZeRO-3 and FSDP shards too), so a NaN that only rank 1
    holds stops the save on both ranks before anything is written."""
    if strategy.startswith("zero"):
        import_deepspeed()
    results = run_distributed(_save_with_a_nan_on_rank_one, 2, strategy, str(tmp_path))
    for rank, (error, written) in enumerate(results):
        assert error is not None and "are not finite" in error and "previous one is kept" in error, (rank, error)
        assert not written, f"rank {rank} wrote {tmp_path}/rank{rank} although a weight is NaN"
