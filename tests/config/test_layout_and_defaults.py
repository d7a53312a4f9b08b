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


@pytest.mark.parametrize("overrides, packed, why", [
    (["data=sft"], True, "packed conversations (the default for data=sft)"),
    (["data=sft", "batch.micro_size=2"], True, "packed conversations (the default for data=sft)"),
    (["data=sft", "batch.pack=false"], False, None),
    (["data=sft", "batch.micro_tokens=512"], False, "unpacked conversations under batch.micro_tokens"),
    (["data=sft", "model=custom", "model._target_=tests.toy_models.make_conv_lm"], False,
     "unpacked conversations: a model._target_ model packs"),
    ([], False, "unpacked rows: data=stdlib packed would draw other examples"),
    (["data=preference", "objective=dpo", "data.paths=[pairs.jsonl]"], False, "unpacked pairs, two rows each"),
    (["batch.pack=true"], True, None),
])
def test_batch_pack_null_packs_conversations_unless_a_layout_or_the_model_says_otherwise(overrides, packed, why):
    from ddptrain.train.builder import resolve_layout

    cfg = compose_config(overrides)
    reason = resolve_layout(cfg)
    assert cfg.batch.pack is packed
    assert (reason is None) == (why is None) and (why is None or reason.startswith(why) or why in reason), reason
    assert resolve_layout(cfg) is None, "decided once"


def test_a_checkpoint_of_unpacked_conversations_resumes_packed_but_a_text_run_may_not_change_packing():
    from ddptrain.runs.resume import check_config
    from ddptrain.runs.store import CheckpointError

    sft = {"data": {"name": "sft"}}
    assert check_config({**sft, "batch": {"pack": False}}, {**sft, "batch": {"pack": True}}, {}) == \
        [("batch.pack", False, True)]
    text = {"data": {"name": "text"}}
    with pytest.raises(CheckpointError, match=r"batch.pack: False -> True"):
        check_config({**text, "batch": {"pack": False}}, {**text, "batch": {"pack": True}}, {})
    # written before batch.pack existed: it trained unpacked, whatever the default is now
    assert check_config(text, {**text, "batch": {"pack": False}}, {"batch.pack": None}) == []
