"""Composition: where conf/ is, the typed defaults in Hydra's ConfigStore, and the config of a
list of overrides for commands that are not `@hydra.main` (verify, plan, tests)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from hydra.core.config_store import ConfigStore

from ddptrain.config.schema import GPTModelConfig, TrainConfig

# conf/ sits at the top of a source checkout; an installed wheel carries it as ddptrain.conf.
_SOURCE_CONF = Path(__file__).resolve().parents[2] / "conf"
CONFIG_PATH = str(_SOURCE_CONF) if (_SOURCE_CONF / "config.yaml").is_file() else "pkg://ddptrain.conf"
"""Hydra's config path for every command: conf/ of a checkout, else the wheel's ddptrain.conf."""


def register_configs() -> None:
    store = ConfigStore.instance()
    store.store(name="base_config", node=TrainConfig)
    # conf/model/gpt.yaml picks these: the built-in GPT's defaults, declared once (GPTModelConfig), as a
    # plain dict so that the model node stays free-form (validate checks it against its kind's schema)
    store.store(group="model", name="gpt_defaults", node=dataclasses.asdict(GPTModelConfig()))


def compose_config(overrides: list[str]) -> TrainConfig:
    """The training config for these Hydra overrides (conf/ and the typed defaults), not validated: a
    DictConfig structured by TrainConfig, read by attribute as one."""
    from hydra import compose, initialize_config_dir, initialize_config_module

    register_configs()
    if CONFIG_PATH.startswith("pkg://"):
        context = initialize_config_module(config_module=CONFIG_PATH.removeprefix("pkg://"), version_base="1.3")
    else:
        context = initialize_config_dir(config_dir=CONFIG_PATH, version_base="1.3")
    with context:
        return compose(config_name="config", overrides=list(overrides))
