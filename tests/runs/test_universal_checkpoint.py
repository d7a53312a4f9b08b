"""Strategy-neutral checkpoints at the library level: what any strategy saved on 2 ranks, every
strategy loads on 1 or 2 ranks, weights and AdamW state, so the next step is the one the saving run
took. The CLI chains across strategies are in tests/runs/test_checkpoint.py."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import ddptrain
from ddptrain.strategies import state as neutral
from ddptrain.testing import run_distributed
from ddptrain.train.optim import build_optimizer
from tests.helpers import import_deepspeed, relative_difference, tiny_gpt
from tests.engine.reference import all_microbatches, case_microbatches

RAGGED = "ragged_with_empty_microbatch"
ZERO_OPTIONS = {"micro_batch_size": 3, "grad_accum_steps": 3}


def _engine(strategy: str, seed: int = 0) -> ddptrain.Engine:
    model = tiny_gpt(torch.float32, seed=seed)
    optimizer = build_optimizer(model, "adamw", 1e-2, 0.1, (0.9, 0.95), fused=False)
    return ddptrain.Engine(model, optimizer, strategy, precision="fp32",
                           strategy_options=ZERO_OPTIONS if strategy.startswith("zero") else None)


def _microbatches(world: int):
    return case_microbatches(RAGGED, ddptrain.get_rank()) if world == 2 else all_microbatches(RAGGED)


def _save_then_step(strategies: list[str], root: str) -> dict:
    """Per strategy on this world: one step, a save, a second step; the weights after it."""
    out = {}
    for strategy in strategies:
        engine = _engine(strategy)
        engine.step(_microbatches(ddptrain.get_world_size()))
        engine.save(os.path.join(root, strategy))
        engine.step(_microbatches(ddptrain.get_world_size()))
        out[strategy] = engine.model_state_dict()
    return out


def _load_then_step(strategies: list[str], sources: list[str], root: str) -> dict:
    """Per (target, source): a differently initialised engine loads the source's save and takes the step."""
    out = {}
    for strategy in strategies:
        for source in sources:
            engine = _engine(strategy, seed=1)
            engine.load(os.path.join(root, source))
            engine.step(_microbatches(ddptrain.get_world_size()))
            out[strategy, source] = engine.model_state_dict()
    return out


@pytest.mark.slow
def test_every_strategy_resumes_what_every_strategy_saved_on_any_world_size(tmp_path):
    import_deepspeed()
    strategies = ["ddp", "fsdp", "zero1", "zero2", "zero3"]
    after = run_distributed(_save_then_step, 2, strategies, str(tmp_path))[0]
    # fp32 rounding only: ZeRO-3's hooks keep the head's chunks checkpointed where the others take the
    # head's gradients in its forward (ddptrain/engine/chunked.py), the same sums in another order
    tolerance = 1e-5
    for source in strategies:  # the saving runs agree with each other: one objective
        assert relative_difference(after[source], after["ddp"]) < tolerance, source
        saved = neutral.read_full(tmp_path / source, collective=False)
        assert set(saved["optimizer"]["state"]) == {name for name, _ in tiny_gpt().named_parameters()}, source
        assert {"step", "exp_avg", "exp_avg_sq"} == set(saved["optimizer"]["state"]["tok_emb.weight"]), source
    for world in (1, 2):
        loaded = run_distributed(_load_then_step, world, strategies, strategies, str(tmp_path))[0]
        for (target, source), weights in loaded.items():
            difference = relative_difference(weights, after[source])
            assert difference < tolerance, f"{source} on 2 ranks -> {target} on {world}: {difference:.2e}"


def _fresh_optimizer_state(root: str) -> dict:
    engine = _engine("ddp")
    engine.save(root)  # before any step: AdamW has no state yet
    zero = _engine("zero2", seed=1)
    zero.load(root)
    zero.step(_microbatches(ddptrain.get_world_size()))
    plain = _engine("ddp")
    plain.step(_microbatches(ddptrain.get_world_size()))
    return {"zero": zero.model_state_dict(), "plain": plain.model_state_dict()}


@pytest.mark.slow
def test_a_checkpoint_saved_before_the_first_step_loads_into_zero(tmp_path):
    import_deepspeed()
    out = run_distributed(_fresh_optimizer_state, 2, str(tmp_path / "fresh"))[0]
    assert relative_difference(out["zero"], out["plain"]) < 2e-6


def test_one_process_reads_and_writes_the_neutral_layout_without_dcp_warning_of_it(tmp_path):
    """Without a process group, save/save_async/load_into/read_full run DCP with no_dist on purpose: DCP's warning that
    it assumes a single process is silenced there (and only that warning)."""
    saved = {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "optimizer": {"state": {}, "param_groups": []}}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        neutral.save(saved, tmp_path / "state")
        neutral.save_async(saved, tmp_path / "async").result()  # DCP warns from its own thread here
        into = {"model": {"w": torch.zeros(2, 3)}}
        neutral.load_into(into, tmp_path / "state")
        whole = neutral.read_full(tmp_path / "state", "model")
        warnings.warn("still shown", UserWarning)
    written = neutral.read_full(tmp_path / "async", "model")
    assert all(torch.equal(got["model"]["w"], saved["model"]["w"]) for got in (into, whole, written))
    assert [str(w.message) for w in seen] == ["still shown"]
