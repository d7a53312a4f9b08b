"""train_on_rollouts on real gloo ranks: the SAME rollouts (saved, replayed) give the exact GRPO update
(tests/engine/grpo_reference.py) for every loss aggregation on 2 ranks x 2 prompts per microbatch,
2 ranks under a token budget, 2 ranks with packed rows, and fsdp, in fp64 to 1e-9; zero2 (DeepSpeed
refuses fp64) in fp32 equals ddp in fp32 to 1e-6, and so does zero3 with its KL reference partitioned; a LoRA
policy's reference is its base. Each layout runs on-policy, and with 2 updates, the
KL term, clipping and masked truncation."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import ddptrain
from ddptrain.engine.engine import Engine
from ddptrain.engine.grpo import LOSS_AGGREGATIONS, GRPOSettings
from ddptrain.rl.batches import RolloutLayout, rollout_microbatches, split_parts
from ddptrain.rl.rollout import load_rollouts
from ddptrain.rl.update import train_on_rollouts
from ddptrain.testing import run_distributed
from ddptrain.train.reference import Reference
from tests.engine.grpo_reference import (LR, VARIANTS, exact_update, grpo_material, relative_update_difference,
                                        tiny_llama)
from tests.helpers import import_deepspeed, import_optional

LAYOUTS = {  # name -> RolloutLayout's keywords besides `prompts`
    "2 x 2 prompts": dict(micro_size=2),
    "2 x token budget": dict(micro_tokens=60),
    "2 x packed rows, budget": dict(pack=True, seq_len=40, micro_tokens=80),
}
ZERO = {"micro_batch_size": 2, "grad_accum_steps": 2}
MULTI_RANK_VARIANTS = {name: extra for name, extra in VARIANTS.items() if extra.get("updates_per_rollout", 1) > 1}
"""The variant with everything on (2 updates, KL, clipping, masked truncation): 2 CPU cores run the rest
(on-policy, one rank) in tests/engine/test_grpo.py."""


def _updates(path: str, prompts: int, vocab_size: int, layouts: dict, strategy: str = "ddp",
             options: dict | None = None, precision: str = "fp64") -> dict:
    """{(layout, aggregation, variant): (per-update (loss, kl, clip_ratio, tokens), weights after)} on this rank,
    which takes every other prompt, whole groups (so both ranks hold prompts of each update's part)."""
    rank, world = ddptrain.get_rank(), ddptrain.get_world_size()
    share = [r for r in load_rollouts(path) if r.prompt_index % world == rank]
    dtype = torch.float64 if precision == "fp64" else torch.float32
    results = {}
    for layout_name, layout in layouts.items():
        for aggregation in LOSS_AGGREGATIONS:
            for variant, extra in MULTI_RANK_VARIANTS.items():
                settings = GRPOSettings(aggregation, max_new_tokens=9, **extra)
                model = tiny_llama(vocab_size, dtype=dtype)
                engine = Engine(model, torch.optim.SGD(model.parameters(), lr=LR[aggregation]), strategy,
                                precision=precision, strategy_options=options)
                reference = Reference(engine, model, tiny_llama(vocab_size, seed=1, dtype=dtype)) \
                    if settings.beta else None
                stats = train_on_rollouts(engine, share, settings, RolloutLayout(prompts, **layout), reference)
                results[layout_name, aggregation, variant] = (
                    [(s.loss, s.metrics["kl"], s.metrics["clip_ratio"], s.tokens) for s in stats],
                    engine.model_state_dict())
    return results


def _exact(material) -> dict:
    """{(aggregation, variant): (per-update values, weights after)} of the exact fp64 GRPO."""
    exact = {}
    for aggregation in LOSS_AGGREGATIONS:
        for variant, extra in MULTI_RANK_VARIANTS.items():
            settings = GRPOSettings(aggregation, max_new_tokens=material.max_new_tokens, **extra)
            parts = split_parts(material.rollouts, material.prompts, settings.updates_per_rollout)
            exact[aggregation, variant] = exact_update(
                tiny_llama(material.vocab_size), material.rollouts, settings, parts,
                copy.deepcopy(tiny_llama(material.vocab_size, seed=1)), LR[aggregation])
    return exact


def _assert_exact(results: dict, exact: dict, initial: dict, tolerance: float) -> None:
    for (layout, aggregation, variant), (updates, weights) in results.items():
        want, want_weights = exact[aggregation, variant]
        for (loss, kl, clip_ratio, _), values in zip(updates, want, strict=True):
            for got, key in ((loss, "loss"), (kl, "kl"), (clip_ratio, "clip_ratio")):
                assert math.isclose(got, values[key], rel_tol=tolerance, abs_tol=1e-12), \
                    (layout, aggregation, variant, key, got, values[key])
        difference = relative_update_difference(weights, want_weights, initial)
        assert difference <= tolerance, (layout, aggregation, variant, difference)


def test_layouts_split_whole_groups_and_count_completion_tokens_only(tmp_path):
    material = grpo_material(tmp_path)
    rollouts = material.rollouts
    for name, layout in LAYOUTS.items():
        microbatches = rollout_microbatches(rollouts, RolloutLayout(material.prompts, **layout), mask_truncated=True)
        counted = sum(int((targets.tokens != -100).sum()) for _, targets in microbatches)
        assert counted == sum(len(r.completion_ids) for r in rollouts if not r.truncated), name
        assert sum(targets.count for _, targets in microbatches) == len(rollouts), name
        if "budget" in name:
            assert len(microbatches) > 2, "the budget cuts the rank's groups into several microbatches"
        if "packed" in name:
            inputs, _ = microbatches[0]
            assert int(inputs["segments"].max()) >= 1, "a packed row holds several completions"
    parts = split_parts(rollouts, material.prompts, 3)
    assert [sorted({r.prompt_index for r in part}) for part in parts] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    with pytest.raises(ValueError, match="updates_per_rollout 9 must be <= the step's prompts \\(8\\)"):
        split_parts(rollouts, material.prompts, 9)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_two_ranks_give_the_exact_update_on_every_layout_and_aggregation(tmp_path):
    material = grpo_material(tmp_path)
    results = run_distributed(_updates, 2, str(material.path), material.prompts, material.vocab_size, LAYOUTS,
                              timeout_s=1500)
    _assert_exact(results[0], _exact(material), material.initial, 1e-9)


BUDGET = {"2 x token budget": LAYOUTS["2 x token budget"]}
"""Ranks with different microbatch counts: fillers where the strategy communicates in every microbatch."""


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_fsdp_gives_the_exact_update(tmp_path):
    material = grpo_material(tmp_path)
    fsdp = run_distributed(_updates, 2, str(material.path), material.prompts, material.vocab_size, BUDGET, "fsdp",
                           timeout_s=1500)
    _assert_exact(fsdp[0], _exact(material), material.initial, 1e-9)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_zero2_in_fp32_gives_ddps_update_in_fp32(tmp_path):
    """DeepSpeed refuses fp64: zero2 against ddp, both fp32, to 1e-6. The loss, KL and clip ratio are sums
    of terms of either sign of size ~|A| ~ 1, so their fp32 rounding is absolute (1e-6), not relative."""
    material = grpo_material(tmp_path)
    import_deepspeed()
    runs = {name: run_distributed(_updates, 2, str(material.path), material.prompts, material.vocab_size, BUDGET,
                                  strategy, options, "fp32", timeout_s=1500)[0]
            for name, strategy, options in (("ddp", "ddp", None), ("zero2", "zero2", ZERO))}
    initial = {k: v.float() for k, v in material.initial.items()}
    for key, (ddp_updates, ddp_weights) in runs["ddp"].items():
        zero_updates, zero_weights = runs["zero2"][key]
        for ours, theirs in zip(zero_updates, ddp_updates, strict=True):
            for got, want in zip(ours, theirs):
                assert math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-6), (key, ours, theirs)
        difference = relative_update_difference(zero_weights, ddp_weights, initial)
        print(f"\nzero2 vs ddp, fp32, {key[1]}: relative update difference {difference:.1e}")
        assert difference <= 1e-6, key


def _kl_updates(path: str, prompts: int, vocab_size: int, strategy: str, options: dict | None) -> dict:
    """token_mean with the KL term, 2 updates, under the token budget (fillers), fp32, the reference the
    initial weights as GRPO's builder takes them (`frozen_copy(model, strategy)`): the per-update (loss, kl),
    the weights after, and the elements of the reference this rank holds, of how many."""
    from ddptrain.train.reference import frozen_copy
    from tests.train.test_reference import held_elements

    rank, world = ddptrain.get_rank(), ddptrain.get_world_size()
    share = [r for r in load_rollouts(path) if r.prompt_index % world == rank]
    settings = GRPOSettings("token_mean", max_new_tokens=9, updates_per_rollout=2, beta=0.5)
    model = tiny_llama(vocab_size, dtype=torch.float32)
    frozen = frozen_copy(model, strategy)
    engine = Engine(model, torch.optim.SGD(model.parameters(), lr=LR["token_mean"]), strategy, precision="fp32",
                    strategy_options=options)
    reference = Reference(engine, model, frozen)
    stats = train_on_rollouts(engine, share, settings, RolloutLayout(prompts, **BUDGET["2 x token budget"]), reference)
    params = list(reference.model.parameters())
    return {"updates": [(s.loss, s.metrics["kl"]) for s in stats], "weights": engine.model_state_dict(),
            "held": held_elements(engine.strategy, params),
            "whole": sum(getattr(p, "ds_numel", p.numel()) for p in params)}


@pytest.mark.slow
def test_zero3_partitions_the_kl_reference_and_gives_ddps_update_in_fp32(tmp_path):
    """rl.beta > 0, full fine-tuning: under zero3 each of 2 ranks holds half of the reference (filled from the
    policy's partitions), and the loss, KL and update equal ddp's (a whole copy) in fp32, to 1e-6."""
    material = grpo_material(tmp_path)
    import_deepspeed()
    zero3 = {**ZERO, "deepspeed": {"zero_optimization": {"stage3_param_persistence_threshold": 0}}}
    runs = {name: run_distributed(_kl_updates, 2, str(material.path), material.prompts, material.vocab_size,
                                  strategy, options, timeout_s=600)
            for name, strategy, options in (("ddp", "ddp", None), ("zero3", "zero3", zero3))}
    initial = {k: v.float() for k, v in material.initial.items()}
    for ddp, ours in zip(runs["ddp"], runs["zero3"], strict=True):
        assert ddp["held"] == ddp["whole"] and ours["whole"] == ddp["whole"]
        assert 0.45 <= ours["held"] / ours["whole"] <= 0.55, "each of 2 ranks holds its half"
        assert ddp["updates"][-1][1] > 0, "the policy moved away from the reference"
        for got, want in zip(ours["updates"], ddp["updates"], strict=True):
            assert got == pytest.approx(want, rel=1e-6, abs=1e-6)
        assert relative_update_difference(ours["weights"], ddp["weights"], initial) <= 1e-6


def _lora(model):
    peft = import_optional("peft")
    return peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"],
                                                      init_lora_weights=False))


@pytest.mark.slow
def test_a_lora_policy_takes_its_base_as_the_reference(tmp_path):
    """beta > 0 with LoRA: the reference is the policy with its adapter disabled (no copy), so the KL is
    to the base weights; the loss, KL and the adapter's update equal the exact GRPO's with the base as
    the reference model, to 1e-9."""
    material = grpo_material(tmp_path)
    settings = GRPOSettings("token_mean", beta=0.5, updates_per_rollout=2, max_new_tokens=material.max_new_tokens)
    parts = split_parts(material.rollouts, material.prompts, 2)
    exact_model = _lora(tiny_llama(material.vocab_size))
    before = {k: v.detach().clone() for k, v in exact_model.state_dict().items()}
    exact, exact_weights = exact_update(exact_model, material.rollouts, settings, parts,
                                        tiny_llama(material.vocab_size), lr=0.5)
    model = _lora(tiny_llama(material.vocab_size))
    engine = Engine(model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5), "ddp",
                    precision="fp64", device=torch.device("cpu"))
    stats = train_on_rollouts(engine, material.rollouts, settings, RolloutLayout(material.prompts, micro_size=3),
                              Reference(engine, model))
    for got, want in zip(stats, exact, strict=True):
        assert math.isclose(got.loss, want["loss"], rel_tol=1e-9) and math.isclose(got.metrics["kl"], want["kl"],
                                                                                     rel_tol=1e-9)
    assert exact[0]["kl"] > 0, "the adapter moves the policy away from its base"
    trained = {k: v for k, v in engine.model_state_dict(trainable_only=True).items() if "lora_" in k}
    assert trained and relative_update_difference(trained, {k: exact_weights[k] for k in trained},
                                                  {k: before[k] for k in trained}) <= 1e-9
