"""The start-up summary on rank 0: one line per topic, so Slurm logs stay greppable."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ddptrain.config.schema import TrainConfig
from ddptrain.distributed import DistInfo, env_local_world_size, env_node_count, is_rank_zero
from ddptrain.generation.batch import KV_CACHE_MB
from ddptrain.models.spec import num_parameters
from ddptrain.train.builder import Built, describe_layout
from ddptrain.train.metrics import MetricsLogger
from ddptrain.train.memory_plan import format_plan, plan_for_config

log = logging.getLogger(__name__)


def log_summary(cfg: TrainConfig, dist_info: DistInfo, built: Built, metrics: MetricsLogger, step: int,
                sampled) -> None:
    """`sampled`: what a step's global batch draws from (TrainBatches.examples: the packed rows
    under batch.pack, else the training examples)."""
    d, train = dist_info, built.data.train
    if d.device.type == "cuda":
        device = f"{torch.cuda.get_device_name(d.device)} ({d.backend})"
    else:
        device = f"cpu, {torch.get_num_threads()} threads per rank ({d.backend})"
    window = metrics.window
    peak = f"{window.peak_flops:.3g} FLOP/s per device" if window.peak_flops else "unknown (MFU not reported)"
    mean_targets = train.valid_targets() / len(train)
    log.info("world: %d rank(s) on %d node(s) | device: %s | peak %s", d.world_size, env_node_count(), device, peak)
    log.info("strategy: %s | precision %s | %s", cfg.strategy.name, cfg.trainer.precision,
             describe_layout(cfg, d.world_size))
    per_sequence = sampled.valid_targets() / len(sampled)
    log.info("tokens per step: up to %d (seq_len %d), about %.0f valid targets on average",
             cfg.batch.global_size * cfg.batch.seq_len, cfg.batch.seq_len, cfg.batch.global_size * per_sequence)
    flops, parameters = window.model_flops, num_parameters(built.model)
    log.info("model: %s (%s), %d parameters (%.2fM)%s", built.spec.class_name, built.spec.kind, parameters,
             parameters / 1e6,
             f", {flops.n_layer} layers x {flops.n_embd} wide, {flops.per_token(cfg.batch.seq_len):.3g} training "
             f"FLOPs per token at seq_len {cfg.batch.seq_len}" if flops else "")
    log.info("dataset: %s, %d train documents -> %d examples, %d valid targets (%.1f per example, %.3g epochs "
             "in %d steps) | validation %d examples", cfg.data.name, train.documents, len(train),
             train.valid_targets(), mean_targets, cfg.trainer.max_steps * cfg.batch.global_size / len(sampled),
             cfg.trainer.max_steps, len(built.data.val))
    if train.is_conversations:  # data=sft: only assistant (completion) tokens are targets
        targets, positions = train.targets_per_example(), int((train.lengths - 1).sum())
        log.info("targets per example: mean %.1f, min %d, max %d | %.1f%% of the %d input positions are targets",
                 targets.mean(), targets.min(), targets.max(), 100.0 * targets.sum() / positions, positions)
    if is_rank_zero():
        log_memory_plan(cfg, dist_info)
    log.info("run dir: %s | steps %d..%d | wandb %s%s", Path(cfg.run.dir).resolve(), step, cfg.trainer.max_steps,
             cfg.logger.wandb.mode, f" (run id {metrics.run_id})" if metrics.run_id else "")


def log_memory_plan(cfg: TrainConfig, dist_info: DistInfo) -> None:
    """The memory plan of this config and world (`python -m ddptrain.plan`), built on the meta device.
    A report, not the run: a model the meta device cannot build (a custom factory) gets a warning."""
    memory = float(torch.cuda.get_device_properties(dist_info.device).total_memory) \
        if dist_info.device.type == "cuda" else None
    try:
        with torch.random.fork_rng(devices=[]):  # the run's random stream stays untouched
            plans, counts, layout = plan_for_config(cfg, dist_info.world_size, env_local_world_size())
    except Exception as error:  # noqa: BLE001 - any failure of the report must leave training alone
        log.warning("memory plan unavailable: %s: %s", type(error).__name__, error)
        return
    for line in format_plan(plans, counts, layout, memory, details=False).splitlines():
        log.info("%s", line)


def log_rl_summary(cfg: TrainConfig, dist_info: DistInfo, built: Built, step: int) -> None:
    """objective=grpo's start-up lines: the world, the layout in prompts and completions, the model."""
    rl, batch = cfg.rl, cfg.batch
    log.info("world: %d rank(s) on %d node(s) | strategy: %s | precision %s", dist_info.world_size,
             env_node_count(), cfg.strategy.name, cfg.trainer.precision)
    log.info("grpo: %d prompts per step x %d completions of <= %d tokens (temperature %g, top_p %g), %d prompts "
             "per rank | loss %s, scale_rewards %s, %d update(s) per rollout", batch.global_size, rl.group_size,
             rl.max_new_tokens, rl.temperature, rl.top_p, batch.global_size // dist_info.world_size,
             rl.loss_aggregation, rl.scale_rewards, rl.updates_per_rollout)
    parameters = num_parameters(built.model)
    log.info("model: %s (%s), %d parameters (%.2fM) | rewards: %s | %d prompts", built.spec.class_name,
             built.spec.kind, parameters, parameters / 1e6, ", ".join(built.rl.rewards.names), len(built.data))
    if is_rank_zero():
        log_memory_plan(cfg, dist_info)
    copy = built.rl.generation_copy
    copy_mib = sum(p.numel() * p.element_size() for p in copy.parameters()) / 2**20 if copy is not None else 0.0
    log.info("memory plan, rollouts: + %.1f MiB per rank for the policy's generation copy (%s), + at most %.0f MiB of "
             "paged KV cache while generating", copy_mib,
             f"strategy={cfg.strategy.name} shards the policy" if copy is not None else "none: the policy generates",
             KV_CACHE_MB)
    log.info("run dir: %s | steps %d..%d", Path(cfg.run.dir).resolve(), step, cfg.trainer.max_steps)
