"""Test isolation shared by every test file."""

from __future__ import annotations

import logging
import os

import pytest

# Nothing in the tests reaches the hub, and the benchmarks set these for their workers: with the whole
# session's the same (set here, before any test module imports transformers), the benchmarks' launches
# fork from the fork server too, which imports transformers (tests/zygote.py).
os.environ.update({"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})


@pytest.fixture(autouse=True)
def _ddptrain_logger_as_it_was():
    """Entry points called in-process (`ddptrain.verify.main`, the CLI's `train`) run
    ddptrain.distributed.setup_logging: a handler on the stream of that moment (pytest's capture of
    that test, closed after it) and propagate=False, so that caplog sees nothing later. Each test
    gets the ddptrain logger back as it found it, whichever tests ran before it in this process
    (pytest-xdist changes that order)."""
    logger = logging.getLogger("ddptrain")
    saved = (list(logger.handlers), logger.propagate, logger.level)
    yield
    logger.handlers[:], logger.propagate, logger.level = saved[0], saved[1], saved[2]


@pytest.fixture(autouse=True)
def _no_process_group_or_environment_left_behind():
    """A test that joins a process group in this process (DeepSpeed's init_distributed does, and
    sets MASTER_ADDR and the rest in os.environ) would leave later tests in a world that
    `ddptrain.is_distributed()` sees. Each test gets the environment back as it found it, and a
    default group it created is destroyed."""

    import torch.distributed as dist

    environment = dict(os.environ)
    had_group = dist.is_available() and dist.is_initialized()
    yield
    if dist.is_available() and dist.is_initialized() and not had_group:
        dist.destroy_process_group()
    if dict(os.environ) != environment:
        os.environ.clear()
        os.environ.update(environment)


@pytest.fixture(autouse=True)
def _float32_matmul_precision_as_it_was():
    """Trainer.build sets torch.set_float32_matmul_precision("high") for fp32 runs on CUDA (TF32
    matmuls), process-wide, and tests build Trainers in-process (on CUDA wherever a GPU is). Left
    set, it would put every later test of the same worker on TF32, compiled flex attention's fp32
    kernel included: TF32's rounding alone moves attention by 4e-4 to 7e-4 (relative), and the CUDA
    exactness tests ask for 1e-5. Each test gets the precision back as it found it."""
    import torch

    saved = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(saved)


@pytest.fixture(autouse=True)
def _cudnn_attention_as_it_was():
    """Trainer.build switches SDPA's cuDNN backend off, process-wide, on CUDA when the run's microbatches
    change shape (ddptrain.train.builder.keep_sdpa_off_cudnn_if_shapes_change). Each test gets it
    back as it found it."""
    import torch

    saved = torch.backends.cuda.cudnn_sdp_enabled()
    yield
    torch.backends.cuda.enable_cudnn_sdp(saved)


@pytest.fixture(scope="session", autouse=True)
def _fork_server():
    """One fork server per test process (tests/zygote.py), for run_cli's launches: started here
    without waiting for it, so that launches before it is up run plainly."""
    import shutil
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    from tests.zygote import ENV_VAR

    if os.environ.get("DDPTRAIN_TEST_NO_ZYGOTE"):
        yield
        return
    folder = tempfile.mkdtemp(prefix="ddptrain-zygote-")
    path = os.path.join(folder, "server.sock")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    with open(path + ".log", "w") as log:
        server = subprocess.Popen([sys.executable, str(Path(__file__).parent / "zygote.py"), "serve", path], env=env,
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log)
    os.environ[ENV_VAR] = path
    yield
    os.environ.pop(ENV_VAR, None)
    server.terminate()
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
    shutil.rmtree(folder, ignore_errors=True)


LONGEST_FIRST = ("tests/models/test_real_model.py", "tests/train/test_dpo.py", "tests/test_benchmarks_peer.py",
                 "tests/test_benchmarks.py", "tests/test_readme.py", "tests/system/test_slurm.py",
                 "tests/serving/test_serve.py", "tests/models/test_lora.py", "tests/strategies/test_strategies.py",
                 "tests/runs/test_checkpoint.py", "tests/train/test_tasks.py", "tests/data/test_sft.py",
                 "tests/models/test_models.py", "tests/strategies/test_zero.py", "tests/rl/test_grpo.py",
                 "tests/train/test_mixture_cli.py", "tests/runs/test_rundir.py", "tests/models/test_attention.py",
                 "tests/data/test_sharded_build.py", "tests/train/test_cli.py", "tests/train/test_observability.py")
"""The test files that take longest, longest first (one full run's per-file totals on 2 CPU cores):
pytest-xdist hands out a file at a time in collection order, so these start first and the two
workers end on short files, together, instead of one waiting on the other's last long file. A stale
order costs only time; files not named follow in their collection order."""


def pytest_collection_modifyitems(items):
    rank = {path: index for index, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.partition("::")[0], len(rank)))  # stable: a file's tests keep their order
