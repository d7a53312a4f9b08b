"""The step's layout is decided in one place, and the built-in GPT's defaults are declared once."""

from __future__ import annotations

import dataclasses

import pytest
from omegaconf import OmegaConf

from ddptrain.config import compose_config
from ddptrain.config.layout import BatchLayout, rows_vary
from ddptrain.config.schema import ConfigError, GPTModelConfig
from ddptrain.models.gpt import GPTConfig
from tests.helpers import REPO


@pytest.mark.parametrize("overrides, varies, accumulation", [
    (["batch.global_size=8", "batch.micro_size=2"], False, 2),
    (["batch.global_size=8", "batch.micro_size=2", "batch.pack=true"], True, None),
    (["batch.global_size=8", "batch.micro_tokens=512"], True, None),
])
def test_the_batch_layout_says_whether_rows_vary_and_the_accumulation(overrides, varies, accumulation):
    batch = compose_config(overrides).batch
    layout = BatchLayout.of(batch, 2)
    assert rows_vary(batch) == layout.rows_vary == varies
    assert layout.grad_accum_steps == accumulation
    assert layout.microbatches_per_step == (accumulation or 1)


def test_a_fixed_layout_that_does_not_divide_names_the_three_numbers():
    with pytest.raises(ConfigError, match=r"batch.global_size=10 must be divisible by batch.micro_size=2 x world "
                                          r"size 2 = 4"):
        BatchLayout.of(compose_config(["batch.global_size=10", "batch.micro_size=2"]).batch, 2)


def test_gpt_defaults_are_declared_once():
    """conf/model/gpt.yaml picks GPTModelConfig's defaults and spells none; GPTConfig's are the same."""
    defaults = dataclasses.asdict(GPTModelConfig())
    assert OmegaConf.to_container(compose_config([]).model) == defaults
    spelled = OmegaConf.load(REPO / "conf" / "model" / "gpt.yaml")
    assert set(spelled) == {"defaults"}, f"conf/model/gpt.yaml spells {sorted(set(spelled) - {'defaults'})}"
    architecture = dataclasses.asdict(GPTConfig())
    assert {key: architecture[key] for key in defaults if key != "name"} == \
        {key: value for key, value in defaults.items() if key != "name"}


PAIRS = ["data=preference", "objective=dpo", "data.paths=[pairs.jsonl]"]


@pytest.mark.parametrize("overrides, packed, why", [
    (["data=sft"], True, "packed conversations (the default for data=sft)"),
    (["data=sft", "batch.micro_size=2"], True, "packed conversations (the default for data=sft)"),
    (["data=sft", "batch.pack=false"], False, None),
    (["data=sft", "batch.micro_tokens=512"], False, "unpacked conversations under batch.micro_tokens"),
    (["data=sft", "model=custom", "model._target_=tests.toy_models.make_conv_lm"], False,
     "unpacked conversations: a model._target_ model packs"),
    ([], False, "unpacked rows: data=stdlib packed would draw other examples"),
    (PAIRS, True, "packed pairs (the default for data=preference)"),
    ([*PAIRS, "batch.micro_tokens=512"], False, "unpacked pairs under batch.micro_tokens"),
    (["batch.pack=true"], True, None),
])
def test_batch_pack_null_packs_conversations_and_pairs_unless_a_layout_or_the_model_says_otherwise(overrides, packed,
                                                                                                    why):
    from ddptrain.train.builder import resolve_layout

    cfg = compose_config(overrides)
    reason = resolve_layout(cfg)
    assert cfg.batch.pack is packed
    assert why is None or why in reason, reason
    assert resolve_layout(cfg) is None, "decided once"


@pytest.mark.parametrize("overrides, micro", [
    (["data=sft"], 1),  # packed conversations: one row per microbatch, each at its own width
    (PAIRS, 1),  # packed pairs likewise
    (["data=sft", "batch.pack=true"], 1),
    (["data=sft", "batch.pack=false"], 8),  # unpacked conversations, pairs, text, rollouts: 8 rows (pairs, prompts)
    ([*PAIRS, "batch.pack=false"], 8),
    ([], 8),
    (["batch.pack=true"], 8),  # a packed text stream: rows all seq_len wide, nothing to keep narrower
    (["data=sft", "batch.micro_tokens=512"], 8),
    (["objective=grpo", "data=prompts", "batch.pack=true"], 8),  # prompts per microbatch, as before
    (["data=sft", "batch.micro_size=4"], 4),  # what the user sets is kept
    (["batch.micro_size=2"], 2),
])
def test_batch_micro_size_null_is_one_packed_row_where_rows_are_packed_whole_else_8(overrides, micro):
    from ddptrain.config.layout import resolve_layout, resolved

    cfg = compose_config(overrides)
    assert cfg.batch.micro_size == (micro if any("micro_size" in o for o in overrides) else None)
    assert resolved(cfg).batch.micro_size == micro and (cfg.batch.micro_size is None) != any(
        "micro_size" in o for o in overrides), "resolved() decides on a copy"
    reason = resolve_layout(cfg)
    assert cfg.batch.micro_size == micro
    if not any("micro_size" in o for o in overrides):
        assert ("one packed row per microbatch" if micro == 1 else f"{micro} ") in reason, reason


@pytest.mark.parametrize("value", [0, -2])
def test_a_micro_size_below_one_is_refused_naming_the_value_and_rule(value):
    from ddptrain.config.validation import validate

    # packed by default, or not: the value is kept and refused
    for overrides in (["data=sft", "data.paths=[chats.jsonl]"], []):
        with pytest.raises(ConfigError, match=rf"batch.micro_size={value} must be > 0"):
            validate(compose_config([*overrides, f"batch.micro_size={value}"]), 1)


def test_the_default_layout_divides_where_the_old_default_did_not():
    """global 4 on 1 rank: micro 8 (the old default) does not divide it; the resolved default does or
    varies, and an unpacked run under a null micro_size is told the resolved value it cannot divide by."""
    from ddptrain.config.validation import validate

    chats = ["data=sft", "data.paths=[chats.jsonl]", "batch.global_size=4"]
    assert validate(compose_config(chats), 1) == 0  # packed, one row per microbatch: rows vary
    with pytest.raises(ConfigError, match=r"batch.global_size=4 must be divisible by batch.micro_size=8 x world "
                                          r"size 1 = 8"):
        validate(compose_config(["batch.global_size=4"]), 1)


def test_a_checkpoint_of_unpacked_conversations_or_pairs_resumes_packed_but_a_text_run_may_not_change_packing():
    from ddptrain.runs.resume import check_config
    from ddptrain.runs.store import CheckpointError

    sft = {"data": {"name": "sft"}}
    assert check_config({**sft, "batch": {"pack": False}}, {**sft, "batch": {"pack": True}}, {}) == \
        [("batch.pack", False, True)]
    pairs = {"data": {"name": "preference"}}  # packed pairs are the step's pairs too
    assert check_config({**pairs, "batch": {"pack": False, "micro_size": 8}},
                        {**pairs, "batch": {"pack": True, "micro_size": 1}}, {}) == \
        [("batch.micro_size", 8, 1), ("batch.pack", False, True)]
    text = {"data": {"name": "text"}}
    with pytest.raises(CheckpointError, match=r"batch.pack: False -> True"):
        check_config({**text, "batch": {"pack": False}}, {**text, "batch": {"pack": True}}, {})
    # written before batch.pack existed: it trained unpacked, whatever the default is now
    assert check_config(text, {**text, "batch": {"pack": False}}, {"batch.pack": None}) == []
