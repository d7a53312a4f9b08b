"""`torchrun -m ddptrain` / `python -m ddptrain`: config -> distributed setup -> Trainer."""

from __future__ import annotations

import gc
import logging
import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from ddptrain.config.schema import ConfigError, register_configs, validate
from ddptrain.train.checkpoint import CheckpointError
from ddptrain.data import DataError
from ddptrain.models.build import ModelError
from ddptrain.train.rundir import RunDirLocked
from ddptrain.distributed import (destroy_distributed, env_world_size, init_distributed, set_parent_death_signal,
                                  setup_logging)
from ddptrain.train.trainer import Trainer

# conf/ sits at the top of a source checkout; an installed wheel carries it as ddptrain.conf.
_SOURCE_CONF = Path(__file__).resolve().parent.parent / "conf"
CONFIG_PATH = str(_SOURCE_CONF) if (_SOURCE_CONF / "config.yaml").is_file() else "pkg://ddptrain.conf"

_KINDS = ((DataError, "data"), (ModelError, "model"), (CheckpointError, "checkpoint"), (RunDirLocked, "run.dir"))


def train(cfg: DictConfig) -> None:
    setup_logging()
    try:
        validate(cfg, env_world_size())  # before the process group: fails fast on every rank
    except ConfigError as error:
        logging.getLogger("ddptrain").error("config error: %s", error)
        sys.exit(2)
    if "TORCHELASTIC_RUN_ID" in os.environ:
        set_parent_death_signal()  # workers must not outlive torchrun (SIGTERM: they checkpoint and exit)
    dist_info = init_distributed(cfg.dist.timeout_s)
    trainer = Trainer(cfg, dist_info)
    try:
        trainer.build().fit()
    except (DataError, ModelError, CheckpointError, RunDirLocked) as error:  # a clear message on every rank
        kind = next(name for kind, name in _KINDS if isinstance(error, kind))
        logging.getLogger("ddptrain").error("%s error: %s", kind, error)
        sys.exit(2)
    finally:
        trainer.close()
        # A DDP module still alive at destroy_process_group() sometimes aborts the process at exit
        # ("terminate called without an active exception", ~1 run in 8 here): free it first.
        del trainer
        gc.collect()
        destroy_distributed()


def main() -> None:
    register_configs()
    hydra.main(config_path=CONFIG_PATH, config_name="config", version_base="1.3")(train)()


if __name__ == "__main__":
    main()
