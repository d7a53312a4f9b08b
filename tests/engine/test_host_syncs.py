"""Host synchronisations of the step (the Engine and the trainer loop), NaN skips decided on the
device, and fp16 with dynamic loss scaling.

On CPU, where these tests always run (the ranks get CUDA_VISIBLE_DEVICES=""), nothing waits for a
device, so what is measured is ddptrain's own code: `host_syncs` counts every call of a Tensor
method that would wait for a GPU (`.item()`, `float()`, `.tolist()`, `.cpu()`, ...) made directly
from a frame of the ddptrain package. Reads inside torch (optimizers, clipping, DDP, indexing
copies) are not seen there.

On a CUDA machine the `*_on_cuda` tests run the same steps on the GPU and count every host
synchronisation, wherever it is made: `device_syncs` turns torch.cuda.set_sync_debug_mode("warn")
into counted warnings (blocking copies, stream syncs, the syncs inside torch's own ops) and also
counts every syncing Tensor method called on a CUDA tensor by any caller. The last test runs
scripts/gpu_check.sh (throughput, MFU, syncs by source line on a GPT-2-small-shaped model).
Without a GPU those tests are skipped and say so.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ddptrain
from ddptrain.testing import run_distributed
from tests.engine.syncs import device_syncs, host_syncs
from tests.helpers import REPO, SMALL_RUN, TINY_RUN, microbatch, read_metrics, run_cli, tiny_gpt

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device (torch.cuda.is_available() is False): the CPU tests count "
                                       "ddptrain's own reads only")

COUNTERS = {"ddptrain": host_syncs, "cuda": device_syncs}
"""What a helper below counts: ddptrain's own reads (any device), or every host sync (CUDA)."""


def _cuda_env() -> dict:
    """The ranks see the GPUs this process sees (run_distributed hides them otherwise)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") or ",".join(map(str, range(torch.cuda.device_count())))
    return {"CUDA_VISIBLE_DEVICES": visible}


def _cuda_world_size() -> int:
    return min(2, torch.cuda.device_count())  # NCCL takes one GPU per rank


def _unread_engine_steps(counter: str = "ddptrain"):
    count = COUNTERS[counter]
    model = tiny_gpt(torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    engine = ddptrain.Engine(model, optimizer, "ddp", grad_clip=1.0, nonfinite="skip")
    rank = ddptrain.get_rank()
    poisoned = ddptrain.get_world_size() - 1  # rank 1 of 2 (a world of one on a single GPU: rank 0)
    steps = [[microbatch(2, [12, 3 + rank], seed + rank), microbatch(1, [7], seed + 9)] for seed in range(4)]
    engine.step(steps[0])  # warm-up: DDP builds its buckets, the optimizer its state
    with count() as calls:
        unread = [engine.step(mbs) for mbs in steps[1:]]
    poison = engine.model.register_forward_hook(
        lambda module, args, out: out * float("nan") if rank == poisoned else out)
    with count() as nan_calls:
        nan_stats = engine.step(steps[0])
    poison.remove()
    return calls, nan_calls, [s.loss for s in unread], nan_stats.skipped, engine.skipped_steps


@pytest.mark.slow  # over 4 s (a process launch or ranks): out of the fast tier
def test_unread_engine_steps_make_no_host_sync_and_a_nan_is_skipped_on_the_device():
    results = run_distributed(_unread_engine_steps, 2)
    for calls, nan_calls, losses, nan_skipped, skipped in results:
        assert calls == [], f"host syncs in unread steps: {calls}"
        assert nan_calls == [], f"host syncs in a step with a NaN: {nan_calls}"
        assert all(math.isfinite(loss) for loss in losses)
        assert nan_skipped and skipped == 1, "every rank skips the NaN step"
    assert results[0][2] == results[1][2], "the losses, read later, are the same on every rank"


@needs_cuda
def test_unread_engine_steps_make_no_host_sync_on_cuda():
    """The same steps on the GPU (NCCL ranks, one per GPU, at most 2), counting every sync of the
    main thread, torch's own included: an unread step must not wait for the device anywhere."""
    results = run_distributed(_unread_engine_steps, _cuda_world_size(), "cuda", env=_cuda_env())
    for calls, nan_calls, losses, nan_skipped, skipped in results:
        assert calls == [], f"host syncs in unread steps on CUDA (ddptrain line, what synced, -): {calls}"
        assert nan_calls == [], f"host syncs in a step with a NaN on CUDA: {nan_calls}"
        assert all(math.isfinite(loss) for loss in losses)
        assert nan_skipped and skipped == 1, "every rank skips the NaN step"
    assert all(result[2] == results[0][2] for result in results), "the same losses on every rank"


def _trainer_loop(run_dir: str, counter: str = "ddptrain"):
    from hydra import compose, initialize_config_dir

    from ddptrain.config import CONFIG_PATH
    from ddptrain.config import register_configs
    from ddptrain.distributed import init_distributed
    from ddptrain.train.trainer import Trainer

    register_configs()
    with initialize_config_dir(config_dir=CONFIG_PATH, version_base="1.3"):
        cfg = compose("config", overrides=[*TINY_RUN, "batch.seq_len=64", "batch.global_size=8", "batch.micro_size=2",
                                           "trainer.max_steps=12", "trainer.log_every=6", "trainer.eval_every=0",
                                           "checkpoint.preempt_check_every=4", f"run.dir={run_dir}"])
    trainer = Trainer(cfg, init_distributed())
    try:
        trainer.build()
        with COUNTERS[counter](where=lambda: trainer.step) as calls:
            trainer.fit()
    finally:
        trainer.close()
    return calls


@pytest.mark.slow
def test_the_trainer_reads_numbers_only_on_log_checkpoint_and_preemption_steps(tmp_path):
    calls = run_distributed(_trainer_loop, 2, str(tmp_path))[0]
    # trainer.step counts finished steps: 4 and 8 ask for preemption, 6 and 12 log, 12 evaluates and saves.
    allowed = {4, 6, 8, 12}
    assert {step for _, _, step in calls} <= allowed, [call for call in calls if call[2] not in allowed]
    assert any(step == 6 for _, _, step in calls), "the counter must see the log step's reads"


@pytest.mark.slow
@needs_cuda
def test_the_trainer_syncs_only_on_log_checkpoint_and_preemption_steps_on_cuda(tmp_path):
    """The trainer loop on the GPU, every sync of rank 0's main thread counted (torch's included)."""
    calls = run_distributed(_trainer_loop, _cuda_world_size(), str(tmp_path), "cuda", env=_cuda_env())[0]
    # As above, plus step 0 (setup and the first step: DDP's bucket rebuild, the optimizer's state).
    allowed = {0, 4, 6, 8, 12}
    assert {step for _, _, step in calls} <= allowed, [call for call in calls if call[2] not in allowed]
    assert any(step == 6 for _, _, step in calls), "the counter must see the log step's reads"


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.skipif(not torch.cuda.is_available() or shutil.which("nvidia-smi") is None,
                    reason="scripts/gpu_check.sh needs an NVIDIA GPU and nvidia-smi")
def test_gpu_check_script_runs_and_reports_throughput_and_host_syncs(tmp_path):
    """scripts/gpu_check.sh as documented in its header, with fewer steps and a smaller microbatch:
    the compiled bf16 GPT-2-small run on every GPU, its throughput table, the sync-count run, packed
    attention's timing, a packed CLI run per backend and the unpacked rows' timing."""
    env = {**os.environ, "STEPS": "20", "LOG_EVERY": "10", "SYNC_STEPS": "10", "MICRO": "4", "WORK": str(tmp_path),
           "ATTENTION_SEQ_LENS": "1024", "PACKED_BACKENDS": "auto mask", "PACKED_STEPS": "4", "RAGGED_CALLS": "4",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}  # its `python` is ours
    result = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh")], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=1700)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert "after the first (compile) window: median" in result.stdout, output[-6000:]
    assert "host syncs on rank 0 over 10 steps (log every 10):" in result.stdout, output[-6000:]
    # Classed by the steps each line fires in: no ddptrain line may wait for the GPU in every step.
    assert "lines that sync in every step: 0" in result.stdout, output[-6000:]
    assert "benchmarks.bench_attention: cuda" in result.stdout and "time, ms (x causal)" in result.stdout, \
        output[-6000:]
    assert [m["step"] for m in read_metrics(tmp_path / "run")] == [10, 20]
    for backend in ("auto", "mask"):
        assert re.search(rf"^ +{backend} +[\d,]+ +[\d.]+ +[\d.]+$", result.stdout, re.M), output[-6000:]
        assert [m["step"] for m in read_metrics(tmp_path / f"packed_{backend}")] == [2, 4]
    assert "unpacked rows: 4 microbatches of 4 paragraphs" in result.stdout, output[-6000:]
    assert re.search(r"^ +without cudnn +[\d.]+ +[\d.]+ +[\d.]+$", result.stdout, re.M), output[-6000:]


# -- fp16 -----------------------------------------------------------------------------------------

FP16_RUN = [*SMALL_RUN, "trainer.log_every=1", "trainer.max_steps=40"]


@pytest.mark.slow
def test_fp16_trains_like_fp32_and_an_overflow_is_skipped_with_the_scale_lowered(tmp_path):
    runs = {}
    for precision, env in (("fp32", None), ("fp16", None), ("fp16-overflow", {"DDPTRAIN_FAILPOINT": "nan@5:1"})):
        run_dir = tmp_path / precision
        result = run_cli([*FP16_RUN, f"trainer.precision={precision.split('-')[0]}", f"run.dir={run_dir}"], nproc=2,
                         env=env)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[precision] = (read_metrics(run_dir), result.stderr)
    fp32, fp16 = runs["fp32"][0], runs["fp16"][0]
    assert abs(fp16[-1]["loss"] - fp32[-1]["loss"]) / fp32[-1]["loss"] < 0.03
    assert fp16[-1]["loss"] < fp16[0]["loss"] - 0.1, "fp16 must train"
    metrics, stderr = runs["fp16-overflow"]
    assert "step 5 skipped: non-finite gradient norm" in stderr
    for rank in (0, 1):
        assert f"rank{rank} warning] step 5 skipped" in stderr, "every rank skips the same step"
    by_step = {m["step"]: m for m in metrics}
    assert by_step[5]["skipped_steps"] == 1 and by_step[4]["skipped_steps"] == 0
    assert by_step[5]["loss_scale"] == by_step[4]["loss_scale"] / 2, "the overflow halves the scale"
    assert math.isfinite(metrics[-1]["loss"])
