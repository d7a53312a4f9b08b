"""A step fit for GPUs, shown on CPU: no host synchronisation from ddptrain code in steps nobody
reads (Engine and trainer loop), NaN skips decided on the device, fp16 with dynamic loss scaling."""

from __future__ import annotations

import contextlib
import math
import sys
from pathlib import Path

import pytest
import torch

import ddptrain
from ddptrain.testing import run_distributed
from tests.helpers import TINY_RUN, microbatch, read_metrics, run_cli, tiny_gpt

PACKAGE = str(Path(ddptrain.__file__).resolve().parent)
SYNCING = ("item", "__float__", "__int__", "__bool__", "tolist", "cpu", "numpy", "__index__")


@contextlib.contextmanager
def host_syncs(where=lambda: None):
    """Records (file:line, method, where()) of every Tensor method that waits for the device,
    called directly from ddptrain's own code."""
    calls: list[tuple[str, str, object]] = []
    originals = {name: getattr(torch.Tensor, name) for name in SYNCING}

    def wrap(name, original):
        def counted(self, *args, **kwargs):
            caller = sys._getframe(1)
            if caller.f_code.co_filename.startswith(PACKAGE):
                calls.append((f"{Path(caller.f_code.co_filename).name}:{caller.f_lineno}", name, where()))
            return original(self, *args, **kwargs)
        return counted

    for name, original in originals.items():
        setattr(torch.Tensor, name, wrap(name, original))
    try:
        yield calls
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def _unread_engine_steps():
    model = tiny_gpt(torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    engine = ddptrain.Engine(model, optimizer, "ddp", grad_clip=1.0, nonfinite="skip")
    rank = ddptrain.get_rank()
    steps = [[microbatch(2, [12, 3 + rank], seed + rank), microbatch(1, [7], seed + 9)] for seed in range(4)]
    engine.step(steps[0])  # warm-up: DDP builds its buckets
    with host_syncs() as calls:
        unread = [engine.step(mbs) for mbs in steps[1:]]
    poison = engine.model.register_forward_hook(lambda module, args, out: out * float("nan") if rank == 1 else out)
    with host_syncs() as nan_calls:
        nan_stats = engine.step(steps[0])
    poison.remove()
    return calls, nan_calls, [s.loss for s in unread], nan_stats.skipped, engine.skipped_steps


def test_unread_engine_steps_make_no_host_sync_and_a_nan_is_skipped_on_the_device():
    results = run_distributed(_unread_engine_steps, 2)
    for calls, nan_calls, losses, nan_skipped, skipped in results:
        assert calls == [], f"host syncs in unread steps: {calls}"
        assert nan_calls == [], f"host syncs in a step with a NaN: {nan_calls}"
        assert all(math.isfinite(loss) for loss in losses)
        assert nan_skipped and skipped == 1, "every rank skips the NaN step"
    assert results[0][2] == results[1][2], "the losses, read later, are the same on every rank"


def _trainer_loop(run_dir: str):
    from hydra import compose, initialize_config_dir

    from ddptrain.__main__ import CONFIG_PATH
    from ddptrain.config.schema import register_configs
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
        with host_syncs(where=lambda: trainer.step) as calls:
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


# -- fp16 -----------------------------------------------------------------------------------------

FP16_RUN = [*TINY_RUN, "batch.seq_len=64", "batch.global_size=8", "batch.micro_size=2", "trainer.log_every=1",
            "trainer.max_steps=40"]


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
