"""HSDP: FSDP2 on a 2-D mesh (replicas x shards), against one process that saw every microbatch;
its mesh checks; its checkpoints resharded to other meshes and strategies."""

from __future__ import annotations

import math

import pytest
import torch

import ddptrain
from ddptrain.config.schema import ConfigError
from ddptrain.distributed import replicate_degree
from ddptrain.testing import record_collectives, run_distributed
from tests.helpers import microbatch, read_metrics, relative_difference, run_cli, tiny_gpt
from tests.engine.reference import reference_step, update
from tests.strategies.curves import RAGGED_RUN, assert_same_curves, loss_curve, ragged_corpus

FOUR_RANKS = {  # ragged rows, an all-ignored microbatch, and rank 3 with one microbatch fewer
    0: [(2, [12, 3], 1), (1, [0], 2), (3, [5, 12, 1], 3)],
    1: [(2, [7, 2], 4), (2, [12, 12], 5), (1, [6], 6)],
    2: [(1, [11], 7), (2, [4, 9], 8), (2, [1, 2], 9)],
    3: [(3, [2, 12, 8], 10), (1, [10], 11)],
}


def _microbatches(rank: int):
    return [microbatch(rows, lengths, seed) for rows, lengths, seed in FOUR_RANKS[rank]]


def _hsdp_step(replicate):
    model = tiny_gpt(torch.float64)
    engine = ddptrain.Engine(model, torch.optim.SGD(model.parameters(), lr=1.0), "fsdp", precision="fp64",
                             strategy_options={"replicate": replicate})
    with record_collectives() as calls:
        stats = engine.step(_microbatches(ddptrain.get_rank()))
    mesh = engine.strategy.mesh
    return stats, engine.model_state_dict(), tuple(mesh.shape), mesh.mesh_dim_names, calls


@pytest.mark.parametrize("replicate", [2, pytest.param("auto", marks=pytest.mark.slow),
                                       pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.slow  # every case over 4 s (ranks): out of the fast tier
def test_hsdp_on_a_two_by_two_mesh_equals_one_process_in_fp64(replicate):
    # "auto" on 4 ranks of 2 "nodes" (GROUP_WORLD_SIZE 2): a 2x2 mesh again; 4: a 4x1 mesh (replicas only)
    env = {"GROUP_WORLD_SIZE": "2"} if replicate == "auto" else None
    results = run_distributed(_hsdp_step, 4, replicate, env=env)
    ref_loss, ref_tokens, before, ref_params = reference_step([mb for r in range(4) for mb in _microbatches(r)])
    replicas = 4 if replicate == 4 else 2
    for rank, (stats, params, shape, names, calls) in enumerate(results):
        assert shape == (replicas, 4 // replicas) and names == ("replicate", "shard"), (shape, names)
        assert stats.tokens == ref_tokens
        assert math.isclose(stats.loss, ref_loss, rel_tol=1e-9), (rank, stats.loss, ref_loss)
        assert relative_difference(params, ref_params) < 1e-9, rank
        assert relative_difference(update(params, before), update(ref_params, before)) < 1e-7, rank
        assert stats.filler_microbatches == 1  # rank 3 ran one (the count is global)
        # Gradients: reduce-scattered over the 2 shards, then all-reduced over the 2 replicas, both
        # SUMs (an average would halve the update, which the comparison above would catch too),
        # once per step: only the last microbatch's backward reduces.
        reductions = [(c["name"], c["group_size"], c["op"]) for c in calls if c["name"].startswith("reduce_scatter")
                      or (c["name"] == "all_reduce" and c["group_size"] == replicas)]
        assert reductions and all(op == "SUM" for _, _, op in reductions), reductions
        expected = {"reduce_scatter_single", "all_reduce"} if replicas < 4 else {"all_reduce"}  # 1 shard: no scatter
        assert {name for name, _, _ in reductions} == expected, reductions
        # FSDP's all-gathers stay inside a replica (one node's ranks; none with one shard)
        gathers = {c["group_size"] for c in calls if c["name"].startswith("all_gather")}
        assert gathers == ({4 // replicas} if replicas < 4 else set()), gathers


def test_a_mesh_that_does_not_tile_the_world_is_a_config_error():
    with pytest.raises(ValueError, match="strategy.replicate=3 .* world size 4"):
        replicate_degree(3, 4)
    assert replicate_degree(2, 4) == 2 and replicate_degree(1, 3) == 1
    from ddptrain.config import compose_config, validate

    cfg = compose_config(["strategy=fsdp", "strategy.replicate=3", "batch.global_size=12", "batch.micro_size=1"])
    with pytest.raises(ConfigError, match=r"strategy.replicate=3 \(3 replicas\) must be a positive divisor of the "
                                          r"world size 4"):
        validate(cfg, 4)
    validate(cfg, 6)


# -- through the CLI ------------------------------------------------------------------------------

FP64 = ["trainer.precision=fp64", "optim.decay_steps=6"]
HSDP = ["strategy=fsdp", "strategy.replicate=2"]


@pytest.mark.slow
def test_hsdp_layouts_and_an_hsdp_checkpoint_resumed_on_fewer_ranks_and_ddp_give_one_loss_curve(tmp_path):
    """1 rank x micro 8 (the straight run), fsdp 4 x 1, and a run that changes layout at each restart:
    HSDP 2x2 x micro 1 for steps 1-2, fsdp on 2 ranks (replicate=auto: one node, so 1x2) for
    steps 3-4, HSDP 4x1 (replicas only) for step 5, ddp on 1 rank for step 6. The same losses
    (fp64, 1e-9): DCP reshards the 2-D mesh's DTensors to every other mesh and to ddp."""
    straight = loss_curve(tmp_path, "ddp", 1, [*FP64, "batch.micro_size=8"])
    fsdp = loss_curve(tmp_path, "fsdp4", 4, [*FP64, "strategy=fsdp", "batch.micro_size=1"])
    moved = tmp_path / "moved"
    for ranks, args in ((4, [*HSDP, "batch.micro_size=1", "trainer.max_steps=2"]),
                        (2, ["strategy=fsdp", "strategy.replicate=auto", "batch.micro_size=1", "trainer.max_steps=4"]),
                        (4, ["strategy=fsdp", "strategy.replicate=4", "batch.micro_size=2", "trainer.max_steps=5"]),
                        (1, ["strategy=ddp", "batch.micro_size=8"])):
        result = run_cli([*RAGGED_RUN, *ragged_corpus(tmp_path), *FP64, *args, f"run.dir={moved}"], nproc=ranks)
        assert result.returncode == 0, result.stderr[-3000:]
        assert "trainer.max_steps=2" in args or "resumed from" in result.stderr, result.stderr[-3000:]
    assert [m["step"] for m in read_metrics(moved)] == [m["step"] for m in straight]
    assert_same_curves({"ddp 1x8": straight, "fsdp 4x1": fsdp,
                        "hsdp 2x2 -> fsdp 1x2 -> hsdp 4x1 -> ddp 1": read_metrics(moved)}, 1e-9)


@pytest.mark.slow
def test_hsdp_on_packed_rows_equals_one_rank(tmp_path):
    packed = ["batch.pack=true", "batch.micro_size=1"]
    curves = {"ddp pack 1x8": loss_curve(tmp_path, "ddp", 1, [*FP64, "batch.pack=true", "batch.micro_size=8"]),
              "hsdp pack 2x2 x 1": loss_curve(tmp_path, "hsdp", 4, [*FP64, *HSDP, *packed])}
    assert_same_curves(curves, 1e-9)
