"""`torchrun -m ddptrain` / `python -m ddptrain`: compose config -> validate -> distributed setup ->
build -> fit -> close."""

from __future__ import annotations

import gc
import logging
import os
import sys
import time

if __name__ == "__main__":  # `python -m` / `torchrun -m ddptrain`; see _start_collecting
    gc.disable()

import hydra
from hydra.core.hydra_config import HydraConfig
import torch._dynamo  # noqa: F401  (torch.optim's first call imports it anyway: here, while gc pauses)

from ddptrain.config.compose import CONFIG_PATH, register_configs
from ddptrain.config.schema import ConfigError, TrainConfig
from ddptrain.config.validation import refuse_repeated_sources
from ddptrain.data import DataError
from ddptrain.distributed import (destroy_distributed, env_world_size, init_distributed, set_parent_death_signal,
                                  setup_logging)
from ddptrain.models.spec import ModelError
from ddptrain.train.builder import validate_run
from ddptrain.runs.store import CheckpointError
from ddptrain.train.preemption import Preempted
from ddptrain.runs.lock import RunDirError
from ddptrain.rl.rewards import RewardError
from ddptrain.train.trainer import Trainer


def _start_collecting() -> None:
    """Resume the garbage collector, paused while this process imported torch, DCP, dynamo and
    Hydra, and freeze what those imports left (gc.freeze: every later collection skips them).

    Those imports make about half a million objects that live as long as the process; collecting
    while they are made re-scans the growing heap again and again, and a frozen heap keeps the same
    scans out of the training loop's collections (what it saves: docs/benchmarks.md, "A launch's
    start-up"). The build that follows, data included, runs with the collector on."""
    gc.freeze()
    gc.enable()


if __name__ == "__main__":
    _start_collecting()

_KINDS = ((ConfigError, "config"), (DataError, "data"), (ModelError, "model"), (CheckpointError, "checkpoint"),
          (RunDirError, "run.dir"), (RewardError, "reward"))
"""Errors that are the user's to fix: a clear message on every rank and exit code 2. A ConfigError
here is a rule that needs the built model (strategy.shard_modules names its classes)."""


_PEER_GRACE_S = 3.0
"""Every rank validates the same config and fails alike, but torchrun stops the others as soon as
one exits: this long a wait lets each rank print its own message first."""


def _exit_with_the_other_ranks(code: int) -> None:
    if env_world_size() > 1:
        time.sleep(_PEER_GRACE_S)
    sys.exit(code)


def train(cfg: TrainConfig) -> None:
    setup_logging()
    try:
        if HydraConfig.initialized():  # the command line's text: what the composed mapping cannot show
            refuse_repeated_sources(list(HydraConfig.get().overrides.task))
        validate_run(cfg, env_world_size())  # before the process group: fails fast on every rank
    except ConfigError as error:
        logging.getLogger("ddptrain").error("config error: %s", error)
        _exit_with_the_other_ranks(2)
    if "TORCHELASTIC_RUN_ID" in os.environ:
        set_parent_death_signal()  # workers must not outlive torchrun (SIGTERM: they checkpoint and exit)
    trainer = Trainer(cfg, init_distributed(cfg.dist.timeout_s))
    together = False  # whether every rank reaches teardown alike (finished, or preempted together)
    try:
        trainer.build().fit()
        together = True
    except Preempted:
        together = True
        raise
    except tuple(kind for kind, _ in _KINDS) as error:
        name = next(name for kind, name in _KINDS if isinstance(error, kind))
        logging.getLogger("ddptrain").error("%s error: %s", name, error)
        sys.exit(2)
    finally:
        # A fixed order, so that a finished run exits 0: ddptrain's threads joined (prefetch in fit,
        # the preemption watchdog and the lock heartbeat in close), the wrapped model freed (a DDP
        # module alive at destroy_process_group() sometimes aborted the process at exit,
        # "terminate called without an active exception"), every rank done with the group before
        # any destroys it, then the group, then the logs.
        trainer.close()
        del trainer
        gc.collect()
        destroy_distributed(wait_for_peers=together)
        logging.shutdown()


def main() -> None:
    register_configs()
    hydra.main(config_path=CONFIG_PATH, config_name="config", version_base="1.3")(train)()


def _exit_skipping_finalization(code) -> None:
    """Exit with `code` (SystemExit's: None is 0, a message is printed and 1) without Python's
    finalization. Everything ddptrain holds is closed by then (train's finally: threads, files,
    process group, logs); what finalization would still do is tear down the ~2,000 modules that
    torch and its friends import, on every rank and for every launch (its cost:
    docs/benchmarks.md). It also runs no C++ static destructors, where a DeepSpeed build's op
    aborted the process after training had finished."""
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    try:
        main()
    except SystemExit as done:
        _exit_skipping_finalization(done.code)
    _exit_skipping_finalization(0)
