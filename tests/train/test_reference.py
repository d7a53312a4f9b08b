"""DPO's frozen reference held as the strategy holds weights: sharded like the policy under fsdp (the
losses and rewards of the whole copy every rank held before, 2 gloo ranks, fp64) and partitioned under
zero3 (the whole copy's reference log-probs and losses, fp32: DeepSpeed refuses fp64)."""

from __future__ import annotations

import math
import types
from pathlib import Path

import pytest
import torch

from ddptrain.testing import run_distributed
from tests.data.chats import save_chat_tokenizer, write_jsonl
from tests.data.pairs import random_pairs
from tests.helpers import import_deepspeed

STEPS = 3


def _data(directory: Path):
    from ddptrain.config import DataConfig
    from ddptrain.data import load_splits

    cfg = DataConfig(name="preference", paths=[str(directory / "pairs.jsonl")],
                     tokenizer=str(directory / "tok" / "tokenizer.json"), cache_dir=str(directory / "cache"),
                     val_percent=0.0)
    return load_splits(cfg, 64)


def _run(directory: Path, strategy: str, frozen: str) -> dict:
    """STEPS DPO steps of a tiny GPT under a token budget (ragged microbatch counts: fillers run);
    `frozen`: "whole", the reference as every rank held it before (a whole copy); "skeleton", as
    `strategy` takes and holds it (fsdp: shards filled from the policy's); "copy", a whole copy with
    weights of its own handed to `strategy` (fsdp shards those weights)."""
    import torch.distributed as dist

    from ddptrain.data import TrainBatches
    from ddptrain.engine.engine import Engine
    from ddptrain.engine.preference import DPOObjective
    from ddptrain.models import GPT, GPTConfig
    from ddptrain.strategies.base import Strategy
    from ddptrain.train.reference import Reference, frozen_copy

    data = _data(directory)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=data.vocab_size, n_layer=2, n_head=2, n_embd=32, max_seq_len=128))
    whole = frozen == "whole"
    frozen = frozen_copy(model, strategy) if frozen == "skeleton" else Strategy.frozen_copy(model)
    engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.5), strategy, precision="fp64",
                    objective=DPOObjective(0.1, "sigmoid"))
    if whole:
        engine.strategy.hold_frozen = types.MethodType(Strategy.hold_frozen, engine.strategy)
    reference = Reference(engine, model, frozen)
    batches = TrainBatches(data.train, 8, 8, seed=3, rank=dist.get_rank(), world_size=dist.get_world_size(),
                           seq_len=64, micro_tokens=128)
    curve, fillers = [], 0
    for step in range(STEPS):
        most = max(len(micro) for micro in batches.layout(step))
        stats = engine.step(reference.fill(batches.microbatches(step), most), max_microbatches=most)
        curve.append((stats.loss, dict(stats.metrics)))
        fillers += most - len(batches.microbatches(step))
    params = list(reference.model.parameters())
    return {"curve": curve, "fillers": fillers, "dtype": str(params[0].dtype),
            "held": sum(Strategy.local_tensor(p).numel() for p in params), "whole": sum(p.numel() for p in params)}


def _runs(directory: str) -> dict:
    runs = {"ddp": ("ddp", "whole"), "fsdp, whole copy": ("fsdp", "whole"), "fsdp, sharded": ("fsdp", "skeleton"),
            "fsdp, a copy sharded": ("fsdp", "copy")}
    return {name: _run(Path(directory), *how) for name, how in runs.items()}


@pytest.mark.slow  # one 2-rank spawn, 3 models x 3 steps
def test_the_sharded_reference_gives_the_whole_copys_losses_and_each_rank_holds_half(tmp_path):
    write_jsonl(tmp_path / "pairs.jsonl", random_pairs(48, seed=7))
    save_chat_tokenizer(tmp_path / "tok")
    _data(tmp_path)  # the data cache, once, before the ranks read it
    ranks = run_distributed(_runs, 2, str(tmp_path))
    assert sum(rank["fsdp, sharded"]["fillers"] for rank in ranks) > 0, "the budget must leave a rank short"
    for rank in ranks:
        assert rank["ddp"]["held"] == rank["fsdp, whole copy"]["held"] == rank["ddp"]["whole"]
        for name in ("fsdp, sharded", "fsdp, a copy sharded"):
            sharded = rank[name]
            assert sharded["held"] <= 0.55 * sharded["whole"], (name, "each of 2 ranks holds its half (shards padded)")
            assert sharded["dtype"] == "torch.float64"
        expected = rank["fsdp, whole copy"]["curve"]
        assert expected[-1][0] != expected[0][0], "it trained"
        for other in ("fsdp, sharded", "fsdp, a copy sharded", "ddp"):
            for (loss, metrics), (whole_loss, whole_metrics) in zip(rank[other]["curve"], expected, strict=True):
                assert math.isclose(loss, whole_loss, rel_tol=1e-9), (other, loss, whole_loss)
                for key, value in metrics.items():
                    if key != "reward_accuracy" or loss != expected[0][0]:  # step 1's rewards: 0 up to rounding
                        assert math.isclose(value, whole_metrics[key], rel_tol=1e-9, abs_tol=1e-12), (other, key)


ZERO3 = {"micro_batch_size": 2, "grad_accum_steps": 2,  # every weight partitioned (none kept whole once gathered)
         "deepspeed": {"zero_optimization": {"stage3_param_persistence_threshold": 0}}}


def held_elements(strategy, params) -> int:
    """Elements of `params` this rank holds under `strategy`: its shards or ZeRO-3 partitions (`ds_tensor`),
    and a partitioned parameter's whole data where DeepSpeed keeps it (gathered, or persisted once gathered)."""
    return sum(strategy.local_tensor(p).numel() + (p.data.numel() if hasattr(p, "ds_tensor") else 0) for p in params)


def _zero3_run(directory: Path, reference: str, held_as: str) -> dict:
    """STEPS DPO steps under zero3 in fp32 (ragged microbatch counts: fillers run), the reference
    `reference` ("initial": the policy's initial weights; "other": a GPT of another seed, weights of its
    own) held "whole" (as every rank held it before) or "partitioned" (ZeRO3.hold_frozen: the initial
    weights from a `frozen_copy` skeleton filled from the policy's partitions)."""
    import torch.distributed as dist

    from ddptrain.data import TrainBatches
    from ddptrain.engine.engine import Engine
    from ddptrain.engine.preference import DPOObjective
    from ddptrain.models import GPT, GPTConfig
    from ddptrain.strategies.base import Strategy
    from ddptrain.train.reference import Reference, frozen_copy

    data = _data(directory)
    config = GPTConfig(vocab_size=data.vocab_size, n_layer=2, n_head=2, n_embd=32, max_seq_len=128)
    torch.manual_seed(1)
    other = GPT(config)
    torch.manual_seed(0)
    model = GPT(config)
    frozen = (other if reference == "other" else
              frozen_copy(model, "zero3") if held_as == "partitioned" else Strategy.frozen_copy(model))
    engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.5), "zero3", precision="fp32",
                    objective=DPOObjective(0.1, "sigmoid"), strategy_options=ZERO3)
    if held_as == "whole":
        engine.strategy.hold_frozen = types.MethodType(Strategy.hold_frozen, engine.strategy)
    reference = Reference(engine, model, frozen)
    batches = TrainBatches(data.train, 8, 8, seed=3, rank=dist.get_rank(), world_size=dist.get_world_size(),
                           seq_len=64, micro_tokens=128)
    losses, logps, fillers = [], [], 0
    for step in range(STEPS):
        most = max(len(micro) for micro in batches.layout(step))
        filled = reference.fill(batches.microbatches(step), most)
        logps += [pairs.reference.tolist() for _, pairs in filled]
        losses.append(engine.step(filled, max_microbatches=most).loss)
        fillers += most - len(filled)
    params = list(reference.model.parameters())
    return {"losses": losses, "logps": logps, "fillers": fillers, "weights": reference.weights,
            "held": held_elements(engine.strategy, params), "whole": sum(getattr(p, "ds_numel", p.numel()) for p in params)}


def _zero3_runs(directory: str) -> dict:
    return {(reference, held_as): _zero3_run(Path(directory), reference, held_as)
            for reference in ("initial", "other") for held_as in ("whole", "partitioned")}


@pytest.mark.slow  # one 2-rank spawn, 4 DeepSpeed engines x 3 steps
def test_the_zero3_reference_is_partitioned_and_gives_the_whole_copys_log_probs(tmp_path):
    """DeepSpeed refuses fp64: fp32, to 1e-6. The initial weights' reference, filled from the policy's own
    partitions, and a reference of weights of its own, each against the same reference held whole."""
    import_deepspeed()
    write_jsonl(tmp_path / "pairs.jsonl", random_pairs(48, seed=7))
    save_chat_tokenizer(tmp_path / "tok")
    _data(tmp_path)
    ranks = run_distributed(_zero3_runs, 2, str(tmp_path), timeout_s=600)
    assert sum(rank["initial", "partitioned"]["fillers"] for rank in ranks) > 0, "the budget must leave a rank short"
    for rank in ranks:
        for reference in ("initial", "other"):
            whole, partitioned = rank[reference, "whole"], rank[reference, "partitioned"]
            assert whole["held"] == whole["whole"]
            assert 0.45 <= partitioned["held"] / partitioned["whole"] <= 0.55, (reference, "each of 2 ranks holds its half")
            assert partitioned["weights"] == whole["weights"], (reference, "the fingerprint gathers the partitions")
            assert whole["losses"][-1] != whole["losses"][0], "it trained"
            for got, want in zip(partitioned["logps"] + [partitioned["losses"]], whole["logps"] + [whole["losses"]],
                                 strict=True):
                assert got == pytest.approx(want, rel=1e-6, abs=1e-6), reference
        initial, other = rank["initial", "partitioned"], rank["other", "partitioned"]
        assert initial["weights"] != other["weights"]
        assert initial["logps"][0] != pytest.approx(other["logps"][0], rel=1e-3), "its own weights, not the policy's"


def test_the_memory_plan_divides_a_frozen_copy_by_the_ranks_that_shard_it():
    """Footprint.frozen_copy_shards: what a plan of DPO's full fine-tune divides the reference's bytes by."""
    from ddptrain.strategies import strategy_class
    from ddptrain.strategies.footprint import Layout, ParameterCounts

    counts = ParameterCounts(parameters=1000, trainable=1000, largest_unit=100)
    layout = Layout(world_size=4, ranks_per_node=2, replicate=2, micro_batch_size=1, seq_len=8, grad_accum_steps=1,
                    precision="fp32", optimizer="adamw")
    shards = {footprint.name: footprint.frozen_copy_shards
              for name in ("ddp", "fsdp", "zero2", "zero3")
              for footprint in strategy_class(name).memory_per_rank(counts, layout)}
    assert shards == {"ddp": 1, "fsdp": 4, "hsdp": 2, "zero2": 1, "zero3": 4}, "hsdp: sharded within a replica of 2 ranks"
