"""One builder: a validated config -> data, model, optimizer, schedule and engine.

The trainer and `python -m ddptrain.verify` build through the same functions, so what verify
checks is what training runs. The order is the flow of the package: data (the global-batch plan
and this rank's share), then the model through its kind's adapter (checks, activation
checkpointing, compile), then optimizer and schedule, then the engine under the strategy.
"""

from __future__ import annotations

import copy
import logging
import os
import time
from dataclasses import dataclass
from typing import Callable

import torch
from omegaconf import OmegaConf
from torch import nn

from ddptrain.config.layout import BatchLayout, resolve_layout
from ddptrain.config.schema import ConfigError, TrainConfig
from ddptrain.config.validation import strategy_options, validate
from ddptrain.data import DataSplits, TrainBatches, load_splits
from ddptrain.data.mixed import MixtureSplits, SourceLabels, load_mixture, mixture_training_examples
from ddptrain.data.mixture import MixturePlan
from ddptrain.data.prompts import PromptBatches, PromptSet, load_prompts
from ddptrain.distributed import DistInfo, pick_device, raise_on_every_rank
from ddptrain.engine.chunked import chunk_rows
from ddptrain.engine.engine import Engine
from ddptrain.engine.objective import Objective
from ddptrain.engine.preference import DPOObjective
from ddptrain.engine.sourced import SourcedObjective
from ddptrain.models.adapters import ModelAdapter, adapter_for
from ddptrain.models import attention
from ddptrain.models.spec import ModelError, ModelSpec, check_output_contract, head_width_problem
from ddptrain.models.compiling import compile_model
from ddptrain.models.lora import is_adapted
from ddptrain.models.kernel_check import kernel_problem
from ddptrain.rl.rewards import Rewards
from ddptrain.rl.step import GRPOStep, generation_copy_of, rollout_layout
from ddptrain.strategies import check_strategy_config, strategy_class
from ddptrain.train.optim import build_optimizer, build_scheduler
from ddptrain.train.reference import Reference, frozen_copy, precompute

log = logging.getLogger(__name__)


@dataclass
class Built:
    """What a run is made of."""

    data: DataSplits | PromptSet
    """The tokenized splits; objective=grpo: the prompts."""
    batches: TrainBatches | PromptBatches
    """This rank's microbatches (objective=grpo: prompts) of every step (the global-batch plan is the same on
    every rank)."""
    model: nn.Module
    """The unwrapped module (the engine holds the wrapped one)."""
    spec: ModelSpec
    adapter: ModelAdapter
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    engine: Engine
    reference: Reference | None = None
    """objective=dpo: what fills each microbatch's reference log-probs before the step."""
    rl: GRPOStep | None = None
    """objective=grpo: each step's rollouts and update (ddptrain/rl/step.py)."""


def resolve_tokenizer(cfg: TrainConfig) -> None:
    """data.tokenizer=null becomes the model kind's own tokenizer (model=hf's tokenizer.json), else bytes."""
    if cfg.data.tokenizer is None:
        cfg.data.tokenizer = adapter_for(cfg.model).default_tokenizer(cfg.model) or "byte"


def decay_steps(cfg: TrainConfig) -> int:
    """The LR schedule's length: optim.decay_steps, else trainer.max_steps."""
    return cfg.optim.decay_steps or cfg.trainer.max_steps


def load_data(cfg: TrainConfig, dist_info: DistInfo) -> DataSplits:
    """The tokenized splits; the ranks that share the cache directory preprocess it together (a shard each)."""
    started = time.perf_counter()
    load = load_mixture if cfg.data.name == "mixture" else load_splits
    data = load(cfg.data, cfg.batch.seq_len, local_rank=dist_info.local_rank, collective=True)
    log.info("data: %d train documents -> %d examples (%d valid targets), %d validation examples, %.1fs",
             data.train.documents, len(data.train), data.train.valid_targets(), len(data.val),
             time.perf_counter() - started)
    return data


def train_batches(cfg: TrainConfig, data: DataSplits, dist_info: DistInfo) -> TrainBatches:
    """This rank's microbatches; a new run's epochs in the order data.order names (auto: the bijection; a
    resumed run then continues in its checkpoint's order, TrainBatches.load_state_dict)."""
    batch = cfg.batch
    order = "bijection" if cfg.data.order == "auto" else cfg.data.order
    examples, plan, labels = data.train, None, None
    if isinstance(data, MixtureSplits):
        examples, sources = mixture_training_examples(data, batch.pack, batch.seq_len)
        plan = MixturePlan(sources, batch.global_size, cfg.run.seed, order)
        if len(sources) > 1:  # each position's source, for loss/<source> (one source: the loss itself)
            labels = SourceLabels([source.offset for source in sources], examples.lengths)
    return TrainBatches(examples, batch.global_size, batch.micro_size, cfg.run.seed, dist_info.rank,
                        dist_info.world_size, micro_tokens=batch.micro_tokens, pack=batch.pack, seq_len=batch.seq_len,
                        order=order, plan=plan, labels=labels)


def build_model(cfg: TrainConfig, vocab_size: int, device: torch.device | None = None, precision: str | None = None,
                sample_inputs=None) -> tuple[nn.Module, ModelSpec, ModelAdapter]:
    """The configured model with the same initial weights on every rank, checked by its adapter
    (packing, context length) and against the model contract on `sample_inputs` (a real
    microbatch's token ids; every rank agrees on the verdict), with packed rows' attention backend
    for `device` and `precision` (default: the run's), activation checkpointing and compile when
    configured."""
    torch.manual_seed(cfg.run.seed)
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    adapter = adapter_for(model_cfg)
    model, spec = adapter.build(model_cfg, vocab_size, cfg.batch.seq_len)
    if cfg.batch.pack:
        use_packed_attention(cfg, adapter, model, device or pick_device(0), precision or cfg.trainer.precision)
    adapter.check_model(model, model_cfg, cfg.batch.seq_len, cfg.batch.pack)
    error = None
    if sample_inputs is not None:
        what = f"{type(model).__name__} (model.{'_target_' if '_target_' in model_cfg else 'name'}=" \
               f"{model_cfg.get('_target_', model_cfg.get('name'))})"
        try:
            check_output_contract(model, sample_inputs, vocab_size, what)
        except ModelError as caught:
            error = caught
    raise_on_every_rank(error, ModelError)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    if trainable < total:  # model.lora: only the adapter trains
        log.info("model: %d of %d parameters train (%.3g%%); checkpoints and final/ hold %s", trainable, total,
                 100 * trainable / total, "those alone" if not adapter.saves_frozen_weights(spec) else "all")
    if cfg.trainer.chunked_head:
        why_not = adapter.use_head_loss(model)
        problem = head_width_problem(model) if why_not is None else None
        if problem is not None:  # a head padded past the logits: another loss than the logits', silently
            raise ConfigError(f"trainer.chunked_head=true, but {type(model).__name__} breaks the head-loss protocol: "
                              f"{problem}. Make the head as wide as the logits (or the logits as wide as the "
                              "head), or set trainer.chunked_head=false")
        if why_not is None:
            log.info("loss: the output head and the objective on the valid targets only, %d rows at a time "
                     "(trainer.chunked_head): no (B, T, V) logits", cfg.trainer.head_chunk_tokens
                     or chunk_rows(_head_outputs(model)))
        else:
            log.info("loss: on the full logits (trainer.chunked_head=true, but %s)", why_not)
    if cfg.trainer.activation_checkpointing:
        adapter.enable_activation_checkpointing(model)
    if cfg.trainer.compile:
        compile_model(model)  # after the adapter's eager checks
    return model, spec, adapter


def _head_outputs(model: nn.Module) -> int | None:
    """The output head's width (its vocabulary), where the head says it: the default chunk's size."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else getattr(model, "head", None)
    return getattr(head, "out_features", None)


def use_packed_attention(cfg: TrainConfig, adapter: ModelAdapter, model: nn.Module, device: torch.device,
                         precision: str) -> str:
    """trainer.attention for packed rows, resolved for this device and precision, checked against
    the dense mask on this device (ddptrain/models/kernel_check.py), set on the model and named at
    start-up (ddptrain/models/attention.py). Collective: a forced backend that fails the check on
    any rank is refused on every rank; one that `auto` chose gives way to the gather (then the mask)."""
    requested = cfg.trainer.attention
    forced = requested != "auto"
    backend = attention.select_backend(requested, device.type, precision)  # a ModelError where it is missing
    used = adapter.use_attention(model, backend, forced=forced)
    layout, error = adapter.head_layout(model), None
    problem = kernel_problem(used, layout, device, precision, cfg.batch.seq_len)
    while problem is not None and not forced:
        replacement = "gather" if used != "gather" else "mask"
        log.warning("packed attention: %s fails its check on this device (%s): using %s", used, problem, replacement)
        used = adapter.use_attention(model, replacement, forced=False)
        problem = kernel_problem(used, layout, device, precision, cfg.batch.seq_len)
    if problem is not None:
        error = attention.AttentionError(f"trainer.attention={used}: its kernel does not compute what the dense mask "
                                         f"does here ({problem}); use trainer.attention=auto, gather or mask")
    raise_on_every_rank(error, ModelError)
    chosen = f"trainer.attention={requested}" + (f" on {device.type}, {precision}" if requested == "auto" else "")
    log.info("packed attention: %s [%s; checked against the dense mask on %s]", attention.describe(used), chosen,
             device.type)
    return used


def optimizer_and_schedule(cfg: TrainConfig, model: nn.Module):
    optim = cfg.optim
    optimizer = build_optimizer(model, optim.name, optim.lr, optim.weight_decay, tuple(optim.betas))
    scheduler = build_scheduler(optimizer, optim.schedule, optim.warmup_steps, decay_steps(cfg), optim.min_lr_ratio)
    if optim.warmup_steps > cfg.trainer.max_steps:  # step s trains at (s + 1) / warmup_steps x lr
        log.warning("optim.warmup_steps=%d > trainer.max_steps=%d: the run ends inside the warmup, so its learning "
                    "rate peaks at %.3g (%d/%d of optim.lr=%g) and never reaches optim.lr; lower optim.warmup_steps",
                    optim.warmup_steps, cfg.trainer.max_steps, optim.lr * cfg.trainer.max_steps / optim.warmup_steps,
                    cfg.trainer.max_steps, optim.warmup_steps, optim.lr)
    return optimizer, scheduler


def objective_of(cfg: TrainConfig, sources: int = 1) -> Objective | DPOObjective | SourcedObjective:
    """The configured objective; over a mixture of several `sources`, summed per source as well."""
    if cfg.objective.name == "dpo":
        return DPOObjective(beta=cfg.objective.beta, loss_type=cfg.objective.loss_type)
    objective = Objective(label_smoothing=cfg.objective.label_smoothing, z_loss=cfg.objective.z_loss)
    return SourcedObjective(objective, sources) if sources > 1 else objective


def step_layout(cfg: TrainConfig, world_size: int) -> dict:
    """What a strategy needs of the layout: microbatch size and (when fixed) accumulation steps."""
    layout = BatchLayout.of(cfg.batch, world_size)
    return {"micro_batch_size": layout.micro_batch_size, "grad_accum_steps": layout.microbatches_per_step}


def validate_run(cfg: TrainConfig, world_size: int) -> int:
    """`validate` (the config's own rules), then the strategy's rules on its section (ZeRO: the
    DeepSpeed config ddptrain derives, against strategy.deepspeed); returns the accumulation steps.
    Both fail as a ConfigError before the process group or the run dir exists."""
    given, cfg = cfg, copy.deepcopy(cfg)  # validated as it will run; the run resolves and says its own layout
    resolve_layout(cfg)
    accumulation = validate(cfg, world_size)  # its errors name run.dir as given ('~')
    given.run.dir = os.path.expanduser(given.run.dir)  # as every other path key: '~/runs/x' is in the home directory
    try:
        check_strategy_config(cfg.strategy.name, world_size=world_size, grad_clip=cfg.trainer.grad_clip,
                              **strategy_options(cfg.strategy), **step_layout(cfg, world_size))
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if cfg.objective.name == "grpo":
        Rewards(cfg.reward)  # a reward path that does not import is a ConfigError before anything is written
    return accumulation


def describe_layout(cfg: TrainConfig, world_size: int) -> str:
    """The step's layout in words, for the start-up summary and verify's report: "global batch 8
    sequences = micro 2 x accumulation 2 x world 2" where the product is the global batch, else
    (token budgets, packing: rows per step vary) what the global batch is split into."""
    batch, layout = cfg.batch, BatchLayout.of(cfg.batch, world_size)
    whole = f"global batch {batch.global_size} sequences"
    if not layout.rows_vary:
        return f"{whole} = micro {batch.micro_size} x accumulation {layout.grad_accum_steps} x world {world_size}"
    budget = (f"microbatches of <= {batch.micro_tokens} padded tokens" if batch.micro_tokens
              else f"{batch.micro_size} row{'s' if batch.micro_size != 1 else ''} per microbatch")
    packed = f"packed into rows of {batch.seq_len} tokens, " if batch.pack else "in "
    if batch.pack and cfg.data.name == "sft":
        whole = f"global batch {batch.global_size} conversations"
        packed = f"each step's conversations packed whole into rows of <= {batch.seq_len} tokens, "
    return f"{whole}, {packed}{budget}, world {world_size} (the number of microbatches varies by step and rank)"


SHAPE_SAMPLE_STEPS = 16
"""How many first steps' microbatch shapes `keep_sdpa_off_cudnn_if_shapes_change` looks at."""
FIXED_SHAPES = 4
"""At most this many distinct (rows, width) shapes in those steps: fixed-width rows (a full
microbatch, a rank's shorter last one), whose cuDNN plans are built once."""


def keep_sdpa_off_cudnn_if_shapes_change(batches: TrainBatches, max_steps: int, device: torch.device) -> bool:
    """Switch SDPA's cuDNN backend off, process-wide, on CUDA when the run's microbatches change
    shape: more than FIXED_SHAPES distinct (rows, width) over every rank in the first
    SHAPE_SAMPLE_STEPS steps, counted from step 0 whatever step a resumed run starts at (the same
    kernels either way). True where it did.

    Unpacked rows are padded to their microbatch's longest row, so on ragged data (paragraphs,
    conversations, a token budget) nearly every microbatch brings a new shape. torch's cuDNN
    attention keys its execution plans on exact sizes and builds one for every new shape, and SDPA
    picks cuDNN for causal attention on Hopper GPUs (as for the gather's buckets:
    `attention._without_cudnn`). Process-wide, not a context around the forward: it then holds for
    every SDPA call of the run (the built-in GPT's unpacked rows, model=hf's sdpa, `_target_` models,
    evaluation), for activation checkpointing's recompute in backward, and for graphs compiled later.
    Fixed-width runs keep SDPA's own choice (torchtitan, whose rows never change shape, keeps cuDNN
    off on GPUs before Blackwell anyway)."""
    if device.type != "cuda":
        return False
    shapes = {shape for step in range(min(SHAPE_SAMPLE_STEPS, max_steps)) for shape in batches.global_shapes(step)}
    if len(shapes) <= FIXED_SHAPES:
        return False
    torch.backends.cuda.enable_cudnn_sdp(False)
    log.info("attention: SDPA without cuDNN: the first %d steps' microbatches take %d shapes, and cuDNN builds "
             "an execution plan for every new shape (FlashAttention and the memory-efficient kernel build none)",
             SHAPE_SAMPLE_STEPS, len(shapes))
    return True


def build_engine(cfg: TrainConfig, dist_info: DistInfo, model: nn.Module, optimizer, scheduler, save_frozen: bool,
                 device: torch.device, precision: str | None, nonfinite: str | None, sources: int = 1) -> Engine:
    """The Engine over the model under the configured strategy (`precision`, `nonfinite`: None for the run's;
    `sources`: a mixture's, whose per-source loss sums the objective adds)."""
    return Engine(model, optimizer, cfg.strategy.name, grad_clip=cfg.trainer.grad_clip, lr_scheduler=scheduler,
                  precision=precision or cfg.trainer.precision, nonfinite=nonfinite or cfg.trainer.nonfinite,
                  device=device, objective=objective_of(cfg, sources),
                  strategy_options={**strategy_options(cfg.strategy), **step_layout(cfg, dist_info.world_size)},
                  save_frozen=save_frozen, chunked_head=cfg.trainer.chunked_head,
                  head_chunk_tokens=cfg.trainer.head_chunk_tokens)


def build(cfg: TrainConfig, dist_info: DistInfo, *, device: torch.device | None = None, precision: str | None = None,
          nonfinite: str | None = None, prepare: Callable[[nn.Module], None] | None = None) -> Built:
    """Everything a run needs, from a validated config. `device`, `precision` and `nonfinite`
    default to the run's; `prepare(model)` runs after the model is built and before the engine
    wraps it (verify turns dropout off and copies the initial weights there)."""
    layout = resolve_layout(cfg)
    if layout is not None:
        log.info("layout: %s", layout)
    if cfg.objective.name == "grpo":
        return build_grpo(cfg, dist_info, device=device, precision=precision, nonfinite=nonfinite, prepare=prepare)
    resolve_tokenizer(cfg)
    torch.manual_seed(cfg.run.seed)
    data = load_data(cfg, dist_info)
    batches = train_batches(cfg, data, dist_info)
    run_device = device or dist_info.device
    keep_sdpa_off_cudnn_if_shapes_change(batches, cfg.trainer.max_steps, run_device)
    microbatches = batches.microbatches(0)  # a rank may hold none: the others check
    sample = microbatches[0][0] if microbatches else None
    if isinstance(sample, dict):  # packed rows: the contract is on token ids (the packing probe checks the rest)
        sample = sample["idx"]
    model, spec, adapter = build_model(cfg, data.vocab_size, run_device,
                                       precision or cfg.trainer.precision, sample_inputs=sample)
    if prepare is not None:
        prepare(model)
    optimizer, scheduler = optimizer_and_schedule(cfg, model)
    # DPO's reference: the LoRA base (the adapter disabled), else the initial weights, copied before training.
    frozen = frozen_copy(model, cfg.strategy.name) if cfg.objective.name == "dpo" and not is_adapted(model) else None
    engine = build_engine(cfg, dist_info, model, optimizer, scheduler, adapter.saves_frozen_weights(spec), run_device,
                          precision, nonfinite, sources=len(data.names) if isinstance(data, MixtureSplits) else 1)
    reference = Reference(engine, model, frozen) if cfg.objective.name == "dpo" else None
    if cfg.objective.precompute_reference:  # once, from the initial weights (a resume rebuilds them)
        splits = {"train": data.train, "val": data.val}
        data.fingerprint["reference"] = precompute(reference, splits, data.fingerprint, cfg.batch.micro_size,
                                                   dist_info, cfg.data.cache_dir)
        reference.drop_frozen_copy()  # every pair carries its log-probs now
    return Built(data, batches, model, spec, adapter, optimizer, scheduler, engine, reference)


def build_grpo(cfg: TrainConfig, dist_info: DistInfo, *, device: torch.device | None = None,
               precision: str | None = None, nonfinite: str | None = None,
               prepare: Callable[[nn.Module], None] | None = None) -> Built:
    """objective=grpo: the prompts and their plan, the policy, the engine and the step that generates,
    scores and trains (ddptrain/rl/step.py). Sharded strategies (fsdp, zero3) get an unsharded copy of
    the policy for generation, made before the strategy wraps the policy."""
    started = time.perf_counter()
    rewards = Rewards(cfg.reward)
    prompts = load_prompts(cfg.data, cfg.batch.seq_len, cfg.rl.max_new_tokens)
    log.info("data: %d prompts, %.1fs", len(prompts), time.perf_counter() - started)
    batches = PromptBatches(prompts, cfg.batch.global_size, cfg.run.seed, dist_info.rank, dist_info.world_size)
    run_device = device or dist_info.device
    sample = torch.tensor([prompts[0].ids])
    model, spec, adapter = build_model(cfg, prompts.vocab_size, run_device, precision or cfg.trainer.precision,
                                       sample_inputs=sample)
    if prepare is not None:
        prepare(model)
    optimizer, scheduler = optimizer_and_schedule(cfg, model)
    generation_copy = generation_copy_of(model) if strategy_class(cfg.strategy.name).shards_weights else None
    # rl.beta > 0: the KL's reference, as DPO's: the LoRA base (the adapter disabled), else the initial weights.
    frozen = frozen_copy(model, cfg.strategy.name) if cfg.rl.beta > 0 and not is_adapted(model) else None
    engine = build_engine(cfg, dist_info, model, optimizer, scheduler, adapter.saves_frozen_weights(spec), run_device,
                          precision, nonfinite)
    if generation_copy is not None:
        generation_copy.to(run_device)
        log.info("rollouts: strategy=%s shards the policy, so each rollout phase gathers its full weights into a "
                 "generation copy (%d parameters on every rank)", cfg.strategy.name,
                 sum(p.numel() for p in generation_copy.parameters()))
    reference = Reference(engine, model, frozen) if cfg.rl.beta > 0 else None
    step = GRPOStep(cfg, engine, model, prompts.tokenizer, rewards, rollout_layout(cfg), reference, generation_copy)
    return Built(prompts, batches, model, spec, adapter, optimizer, scheduler, engine, rl=step)
