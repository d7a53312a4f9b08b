"""The typed config: one dataclass per section, a default and a one-line docstring per field.

YAML under conf/ picks groups (and a group file may override a default). The allowed values of
enumerated keys are in ddptrain/config/choices.py; the rules between values are in
ddptrain/config/validation.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING, OmegaConf

from ddptrain.config.choices import ATTN_IMPLEMENTATIONS


class ConfigError(ValueError):
    """A config value breaks a rule; the message names the key, the value and the rule."""


@dataclass
class RunConfig:
    dir: str = "runs/default"
    """Run directory shared by every rank: metrics.jsonl, config.yaml, train.log, checkpoints."""
    seed: int = 1234
    """Seed of the model init and of the data order (the global batch of step t depends on it), in [0, 2**64)."""


@dataclass
class EarlyStoppingConfig:
    metric: Optional[str] = None
    """val_loss or a logged eval metric (eval/<task>/acc, eval/<task>/acc_norm); null: no early stopping."""
    mode: Optional[str] = None
    """min | max; null: inferred (val_loss: min, eval/*/acc*: max)."""
    patience: int = 3
    """Stop after this many evaluations in a row without an improvement."""
    min_delta: float = 0.0
    """An improvement must beat the best so far by more than this (>= 0)."""


@dataclass
class TrainerConfig:
    max_steps: int = 200
    """Optimizer steps to train."""
    log_every: int = 10
    """Write a metrics line every this many steps (and at the last step)."""
    precision: str = "fp32"
    """fp32 | fp64 | bf16 (autocast) | fp16 (autocast with dynamic loss scaling)."""
    grad_clip: Optional[float] = 1.0
    """Clip the global gradient norm to this finite value (null: no clipping)."""
    empty_step: str = "skip"
    """A global batch without any valid target token: skip (no update, counted, warned) | stop."""
    nonfinite: str = "skip"
    """A non-finite gradient norm: skip (no update, counted, warned) | stop."""
    eval_every: int = 0
    """Validation loss every this many steps (0: only after the last step)."""
    eval_examples: int = 64
    """Size of the fixed validation set (examples taken from the validation split)."""
    compile: bool = False
    """torch.compile each transformer block (start-up: tens of seconds of compiling on the first steps)."""
    activation_checkpointing: bool = False
    """Recompute each transformer block in backward instead of keeping its activations (less memory, more compute)."""
    attention: str = "auto"
    """Packed rows' per-document attention: auto | gather | varlen | flex | mask (ddptrain/models/attention.py)."""
    chunked_head: bool = True
    """Output head + loss on the valid targets only, in chunks, no (B, T, V) logits, where the model can (docs/architecture.md)."""
    head_chunk_tokens: Optional[int] = None
    """Rows per chunk of the chunked head (null: as many as keep a chunk's fp32 logits within 64 MiB: 341 at V = 49,152)."""
    eval_tasks: list = field(default_factory=list)
    """Multiple-choice task files (JSONL: {"context", "choices", "label"} a line) scored at every eval step."""
    eval_chat_template: bool = False
    """Wrap each task context in the tokenizer's chat template as a user turn (chat models)."""
    early_stopping: EarlyStoppingConfig = field(default_factory=EarlyStoppingConfig)
    """Stop when an evaluated metric stops improving (trainer.early_stopping.metric null: never)."""


@dataclass
class BatchConfig:
    global_size: int = 16
    """Sequences per optimizer step, over all ranks and microbatches."""
    micro_size: Optional[int] = None
    """Sequences (pairs; packed: rows) per microbatch per rank; null: resolved per layout at start-up, one row
    per microbatch where conversations or pairs are packed (each row keeps its own width), else 8."""
    seq_len: int = 256
    """Tokens per sequence (inputs); documents are cut to this and their ends padded."""
    micro_tokens: Optional[int] = None
    """Instead of micro_size: at most this many padded tokens per microbatch (>= seq_len)."""
    pack: Optional[bool] = None
    """Pack several documents into each row of seq_len tokens (attention stays per document); null: packed
    conversations (data=sft) and pairs (data=preference), the same sample with the fewest positions, unless
    micro_tokens is set, else false."""


@dataclass
class OptimConfig:
    name: str = "adamw"
    """adamw | sgd"""
    lr: float = 1e-3
    """Peak learning rate."""
    weight_decay: float = 0.1
    """Decoupled weight decay (>= 0) on matrices (not on norms and biases)."""
    betas: list = field(default_factory=lambda: [0.9, 0.95])
    """AdamW betas: two numbers in [0, 1)."""
    schedule: str = "cosine"
    """cosine | constant, after linear warmup."""
    warmup_steps: int = 20
    """Linear warmup steps (at most optim.decay_steps, when that is set)."""
    decay_steps: Optional[int] = None
    """Length of the schedule (null: trainer.max_steps). Fix it to extend a run later without changing its schedule."""
    min_lr_ratio: float = 0.1
    """Cosine floor as a fraction of lr, in [0, 1]."""


@dataclass
class GPTModelConfig:
    """model=gpt: the built-in decoder-only GPT (ddptrain/models/gpt.py)."""

    name: str = "gpt"
    """Model family: gpt (built in) | hf (a local transformers directory); absent for a `_target_` factory."""
    n_layer: int = 4
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads per block."""
    n_embd: int = 128
    """Embedding width (divisible by n_head)."""
    dropout: float = 0.0
    """Dropout probability (0 keeps steps deterministic)."""
    bias: bool = False
    """Biases in linear and norm layers."""

    @staticmethod
    def check(typed: Any) -> None:
        """The rules between this kind's values (the node already has this schema's types)."""
        for key in ("n_layer", "n_head", "n_embd"):
            if not typed[key] > 0:
                raise ConfigError(f"model.{key}={typed[key]!r} must be > 0")
        if typed.n_embd % typed.n_head:
            raise ConfigError(f"model.n_embd={typed.n_embd} must be divisible by model.n_head={typed.n_head}")
        if not 0 <= typed.dropout < 1:
            raise ConfigError(f"model.dropout={typed.dropout!r} must be in [0, 1)")


@dataclass
class LoRAConfig:
    """model.lora: a LoRA adapter through peft over the frozen weights of model.path (r 0 or null: off)."""

    r: Optional[int] = 0
    """Rank of each adapter's A (r x in) and B (out x r) matrices; 0 or null: no LoRA, every weight trains."""
    alpha: float = 16.0
    """Scale numerator: the adapter adds (alpha / r) x B A to each targeted weight (peft's lora_alpha)."""
    dropout: float = 0.0
    """Dropout on each adapter's input (0 keeps steps deterministic and layouts exact)."""
    target_modules: Any = "all-linear"
    """Modules that get an adapter: all-linear (every attention and MLP projection, not the LM head) or a list of
    module names (peft's target_modules, e.g. [q_proj, v_proj])."""


@dataclass
class HFModelConfig:
    """model=hf: any causal LM that transformers' AutoModelForCausalLM knows, from a local directory."""

    name: str = "hf"
    path: str = MISSING
    """Local directory: config.json, and weights to fine-tune from (none: initialised with run.seed). Never downloaded."""
    attn_implementation: str = "sdpa"
    """sdpa | eager: transformers' attention kernel (packing needs one that takes a 4D mask)."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """LoRA (model.lora.r > 0): only the adapter trains; checkpoints and final/ hold it alone."""

    @staticmethod
    def check(typed: Any) -> None:
        """The rules between this kind's values (the node already has this schema's types)."""
        if typed.attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise ConfigError(f"model.attn_implementation={typed.attn_implementation!r} is not one of "
                              f"{', '.join(ATTN_IMPLEMENTATIONS)}")
        lora = typed.lora
        if lora.r is not None and lora.r < 0:
            raise ConfigError(f"model.lora.r={lora.r} must be >= 0 (0 or null: no LoRA)")
        if not lora.r:  # LoRA off: every weight trains, and a LoRA setting would be ignored
            given, defaults = OmegaConf.to_container(lora), dataclasses.asdict(LoRAConfig())
            for key in ("alpha", "dropout", "target_modules"):
                if given[key] != defaults[key]:
                    raise ConfigError(f"model.lora.{key}={given[key]!r} is read only with LoRA on, and this run has "
                                      f"model.lora.r={lora.r}: every weight would train; set model.lora.r > 0, or "
                                      "leave it out")
        if lora.r:
            if not 0 < lora.alpha < float("inf"):  # inf: every update non-finite, every step skipped
                raise ConfigError(f"model.lora.alpha={lora.alpha!r} must be > 0 and finite")
            if not 0 <= lora.dropout < 1:
                raise ConfigError(f"model.lora.dropout={lora.dropout!r} must be in [0, 1)")
            targets = lora.target_modules
            names = [targets] if isinstance(targets, str) else list(targets) if targets is not None else []
            if not names or not all(isinstance(name, str) and name for name in names):
                raise ConfigError(f"model.lora.target_modules={targets!r} must be all-linear or a non-empty list of "
                                  "module names, e.g. [q_proj, k_proj, v_proj, o_proj]")


ModelConfig = GPTModelConfig  # the default model's schema

MODEL_SCHEMAS = {"gpt": GPTModelConfig, "hf": HFModelConfig}
"""Schema of each `model.name`; a node with `_target_` is a user factory and its other keys are its arguments."""


@dataclass
class ObjectiveConfig:
    name: str = "token"
    """token (the mean token loss over valid targets) | dpo (the mean DPO loss over pairs, data=preference)."""
    label_smoothing: float = 0.0
    """Label smoothing epsilon in [0, 1): still a sum over valid tokens divided by the global count N_t."""
    z_loss: float = 0.0
    """Weight of PaLM's z-loss, log(Z)^2 summed over valid tokens (0: off)."""
    beta: float = 0.1
    """dpo: the KL weight beta (ipo: the regularisation tau), > 0, as TRL's DPOConfig.beta."""
    loss_type: str = "sigmoid"
    """dpo: sigmoid (DPO) | ipo (IPO on per-token mean log-ratios), TRL's formulas."""
    precompute_reference: bool = False
    """dpo: the reference log-probs computed once before step 1 into the data cache (keyed by the model's weights)."""


@dataclass
class DataConfig:
    name: str = "stdlib"
    """stdlib (the interpreter's standard-library sources) | text | jsonl | tokens | hf (optional extra) | sft (chats) |
    preference (TRL's prompt/chosen/rejected pairs)."""
    val_percent: float = 5.0
    """Percent of documents (by a hash of their name) held out for validation (unless val_paths)."""
    max_docs: Optional[int] = None
    """Use only the first N documents of data.paths, and the first N of data.val_paths (quick experiments and tests)."""
    paths: list = field(default_factory=list)
    """Source files or globs (`**` recursive); hf: data files or one save_to_disk directory."""
    val_paths: list = field(default_factory=list)
    """Separate validation files or globs (instead of the hash split by val_percent)."""
    split_by: str = "file"
    """text: one document per file | paragraph (per blank-line-separated paragraph)."""
    field: str = "text"
    """jsonl and hf: the string field (column) holding each document."""
    tokenizer: Optional[str] = None
    """byte | path to a Hugging Face tokenizer.json (optional extra); null: model=hf's own tokenizer.json, else byte (sft: none)."""
    on_decode_error: str = "replace"
    """Bytes that are not UTF-8 where text is needed (jsonl, tokenizer.json): replace (U+FFFD, counted) | error."""
    dtype: str = "uint16"
    """tokens: uint16 | uint32, the element type of the flat token files (nanoGPT writes uint16)."""
    eod_token: Optional[int] = None
    """tokens: the end-of-document id that ends (and belongs to) each document."""
    index: Optional[str] = None
    """tokens: a .npy of document start offsets into the one file of data.paths (instead of eod_token)."""
    vocab_size: Optional[int] = None
    """Model vocabulary; required for data=tokens (ids must be below it); default: the tokenizer's."""
    cache_dir: Optional[str] = None
    """Preprocessing cache, shared by the ranks of a node (default: $XDG_CACHE_HOME/ddptrain or ~/.cache/ddptrain)."""
    format: str = "auto"
    """sft: auto (told by each record's fields) | messages (conversational) | prompt_completion."""
    messages_field: str = "messages"
    """sft: the field holding a conversation, a list of {"role", "content"} messages."""
    prompt_field: str = "prompt"
    """sft: the prompt field (a string, or a list of messages) of prompt-completion records."""
    completion_field: str = "completion"
    """sft: the completion field (a string, or a list of messages) of prompt-completion records."""
    train_on: str = "all_assistant"
    """sft: every assistant turn is a target (all_assistant) | only a conversation's last one (last_assistant)."""
    truncation: str = "drop"
    """sft and preference: an example (a pair: either sequence) longer than batch.seq_len + 1 tokens: drop (counted,
    warned) | right (cut its end) | error."""
    chat_template: Optional[str] = None
    """sft: a Jinja chat template file (default: the tokenizer's own, chat_template.jinja or tokenizer_config.json)."""
    sources: Any = None
    """mixture: source name -> {name: its kind, weight, max_repeat, on_exhausted, and that kind's data.* keys}; the
    other data.* keys apply to every source unless it sets its own (MixSourceConfig, docs/data.md)."""
    order: str = "auto"
    """An epoch's order: auto (a seeded bijection for a new run; a resumed run keeps its own) | bijection |
    permutation (the materialised one of runs started before the bijection)."""


@dataclass
class MixSourceConfig:
    """What a source of data=mixture sets besides its kind's data.* keys."""

    weight: float = 1.0
    """Its share of the valid target tokens: weight / sum(weights), >= 0."""
    max_repeat: Optional[int] = None
    """Passes over the source after its first, each in a new seeded order (null: unlimited; 0: read once)."""
    on_exhausted: str = "error"
    """Past max_repeat: error (stop the run at that step, naming the source) | renormalize (drop it)."""


@dataclass
class RLConfig:
    """objective=grpo: how rollouts are generated and how the GRPO update weighs them (docs/rl.md)."""

    group_size: int = 4
    """Completions sampled per prompt (>= 2: a group's advantages compare its completions)."""
    max_new_tokens: int = 64
    """Tokens generated per completion at most; a prompt may be at most batch.seq_len - max_new_tokens tokens."""
    temperature: float = 1.0
    """Sampling temperature (> 0); the policy's log-probs are taken at the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling in (0, 1]."""
    stop: list = field(default_factory=list)
    """Up to 4 strings: a completion ends with the token that completes one of them."""
    scale_rewards: str = "group"
    """group | batch | none: divide advantages by the group's reward std, the whole batch's, or not at all."""
    loss_aggregation: str = "token_mean"
    """token_mean | sequence_mean | constant | token_sum (docs/rl.md: the formulas and their papers)."""
    epsilon: float = 0.2
    """The importance ratio's lower clip: 1 - epsilon."""
    epsilon_high: Optional[float] = None
    """The upper clip 1 + epsilon_high (DAPO's clip-higher); null: epsilon."""
    beta: float = 0.0
    """The KL penalty's weight (k3 estimator) to the reference; 0: no reference."""
    mask_truncated: bool = False
    """Leave completions cut at max_new_tokens out of the loss (DAPO's overlong filtering)."""
    updates_per_rollout: int = 1
    """Optimizer steps per step's rollouts, each over its own part of them."""


@dataclass
class RewardConfig:
    """objective=grpo: the reward of a completion, a weighted sum of reward functions."""

    functions: list = field(default_factory=list)
    """Built-in names (exact_match, format) or `module:function` paths, each called TRL's way:
    f(prompts, completions, **fields) -> list[float | None]."""
    weights: Optional[list] = None
    """One weight per function; null: 1 each."""
    answer_field: str = "answer"
    """exact_match: the prompt record's field holding the right answer."""
    format_pattern: str = r"^.*\S.*$"
    """format: the regex a completion must match in full (re.fullmatch, DOTALL) for reward 1."""


@dataclass
class WandbConfig:
    mode: str = "disabled"
    """online | offline | disabled"""
    project: str = "ddptrain"
    """wandb project."""
    name: Optional[str] = None
    """wandb run name (default: the run dir's name)."""


@dataclass
class MLflowConfig:
    tracking_uri: Optional[str] = None
    """MLflow tracking store: a local file: or sqlite: URI, or a server's http(s) URL; null: no MLflow."""
    experiment: str = "ddptrain"
    """MLflow experiment name."""
    run_name: Optional[str] = None
    """MLflow run name (default: the run dir's name)."""
    log_final: bool = False
    """Log final/ as the run's artifact at the end."""


@dataclass
class LoggerConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)
    tensorboard: bool = False
    """Write every metrics.jsonl key as a TensorBoard scalar under run.dir/tensorboard/ (and the config as text)."""
    mlflow: MLflowConfig = field(default_factory=MLflowConfig)
    progress: str = "auto"
    """Rank-0 console: auto (a bar on a terminal, log lines otherwise) | bar | lines."""
    peak_flops: Any = "auto"
    """Peak FLOP/s of one device for MFU: auto (the accelerator table, else a matmul probe at start-up) | FLOP/s | null."""


@dataclass
class CheckpointConfig:
    every: int = 0
    """Save a checkpoint every this many steps (0: only on preemption)."""
    keep: int = 2
    """Keep the newest K complete checkpoints (the only complete one is never deleted)."""
    resume: str = "auto"
    """auto (latest complete checkpoint in run.dir, else fresh) | none | a checkpoint path."""
    accept_changed_data: bool = False
    """Resume although the corpus differs from the checkpoint's fingerprint (a file appended to, a new file
    matching the glob), with a warning: the data order differs from then on."""
    async_save: bool = False
    """Write weights and optimizer state in the background (dcp.async_save over a gloo group of its own):
    the step waits only for the copy to host memory; the checkpoint becomes complete (digests, marker)
    a few steps later, once every rank's files are written."""
    preempt_signals: list = field(default_factory=lambda: ["SIGTERM", "SIGUSR1"])
    """Signals that make every rank checkpoint at the next step boundary and exit."""
    preempt_check_every: int = 5
    """Ask every rank for a preemption signal every this many steps (a tiny all-reduce the host waits for), and at
    every checkpoint.every step, whose checkpoint then is the preemption checkpoint."""
    preempt_grace_s: float = 25.0
    """After a preemption signal, a rank that reaches no step boundary within this many seconds (stuck in a
    collective) exits instead of waiting to be SIGKILLed (torchrun waits 30 s)."""
    preempt_exit_code: int = 75
    """Exit code after a preemption checkpoint (EX_TEMPFAIL): the job should be restarted."""
    keep_best: Optional[str] = None
    """Keep the weights of the best evaluated step by this metric (val_loss, eval/<task>/acc...) in run.dir/best/."""


@dataclass
class DistConfig:
    timeout_s: float = 600.0
    """Process-group timeout: a dead or stuck peer fails the run after this many seconds."""


@dataclass
class TrainConfig:
    run: RunConfig = field(default_factory=RunConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    model: Any = field(default_factory=dict)
    """Checked against MODEL_SCHEMAS[model.name] by `validate` (a `_target_` factory takes any keys)."""
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    strategy: Any = field(default_factory=dict)
    """`name` (a key of ddptrain.config.choices.STRATEGIES) and that strategy's own Options, checked by `validate`."""
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    dist: DistConfig = field(default_factory=DistConfig)
