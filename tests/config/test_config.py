"""The config layer refuses, before anything starts, values that would train other than asked or fail
late with a traceback: each rule's message names the key, the value and the rule (validate_run, the
check every command runs on its composed config)."""

from __future__ import annotations

import pytest

from ddptrain.config.compose import compose_config
from ddptrain.config.schema import ConfigError
from ddptrain.train.builder import validate_run


def _refusal(overrides: list[str], world_size: int = 1) -> str:
    with pytest.raises(ConfigError) as error:
        validate_run(compose_config(overrides), world_size)
    return str(error.value)


@pytest.mark.parametrize("override, message", [
    # torch checks only its defaults, not ddptrain's per-group decay: -0.1 trained, growing the weights
    ("optim.weight_decay=-0.1", "optim.weight_decay=-0.1 must be a finite number >= 0"),
    ("optim.weight_decay=nan", "optim.weight_decay=nan must be a finite number >= 0"),
    # LambdaLR takes any factor: a negative floor made the last steps' lr negative (gradient ascent)
    ("optim.min_lr_ratio=-1", "optim.min_lr_ratio=-1.0 must be in [0, 1]"),
    ("optim.min_lr_ratio=nan", "optim.min_lr_ratio=nan must be in [0, 1]"),
    # these failed after the build, in torch or in the first steps
    ("optim.lr=inf", "optim.lr=inf must be a finite number > 0"),
    ("optim.betas=[1.5,0.9]", "optim.betas=[1.5, 0.9] must be two numbers in [0, 1)"),
    ("optim.betas=[0.9]", "optim.betas=[0.9] must be two numbers in [0, 1)"),
    ("optim.betas=[a,b]", "optim.betas=['a', 'b'] must be two numbers in [0, 1)"),
    ("objective.z_loss=inf", "objective.z_loss=inf must be a finite number >= 0"),
    ("trainer.grad_clip=inf", "trainer.grad_clip=inf must be a finite number > 0, or null (no clipping)"),
    ("run.seed=-5", "run.seed=-5 must be in [0, 2**64)"),
])
def test_numeric_edge_values_are_refused_with_the_key_the_value_and_the_rule(override, message):
    assert message in _refusal([override])


def test_the_numeric_bounds_still_take_their_edges():
    overrides = ["optim.weight_decay=0", "optim.min_lr_ratio=0", "optim.betas=[0,0.999]", "run.seed=0",
                 "trainer.grad_clip=null", "objective.z_loss=0"]
    assert validate_run(compose_config(overrides), 1) == 2
    assert validate_run(compose_config(["optim.min_lr_ratio=1"]), 1) == 2


@pytest.mark.parametrize("overrides, message", [
    (["data=jsonl", "data.paths=[c.jsonl]", "data.split_by=paragraph"],
     "data.split_by='paragraph' is read only when data.name is text, and this run has data.name='jsonl'"),
    (["data=text", "data.paths=[c.txt]", "data.field=body"],
     "data.field='body' is read only when data.name is jsonl or hf, and this run has data.name='text'"),
    (["data=text", "data.paths=[c.txt]", "data.dtype=uint32"],
     "data.dtype='uint32' is read only when data.name is tokens"),
    (["data.train_on=last_assistant"], "data.train_on='last_assistant' is read only when data.name is sft"),
    (["data=sft", "data.paths=[c.jsonl]", "data.format=prompt_completion", "data.messages_field=conversation"],
     "data.messages_field='conversation' is read only when data.format is auto or messages, and this run has "
     "data.format='prompt_completion'"),
    (["data=sft", "data.paths=[c.jsonl]", "data.format=messages", "data.completion_field=answer"],
     "data.completion_field='answer' is read only when data.format is auto or prompt_completion"),
    (["data.on_decode_error=error"],  # stdlib replaces undecodable bytes whatever the policy
     "data.on_decode_error='error' is read only when data.name is text or jsonl or hf or sft"),
    (["data=text", "data.paths=[a.txt]", "data.val_paths=[b.txt]", "data.val_percent=20"],
     "data.val_percent=20.0 is read only when data.val_paths is empty, and this run has data.val_paths=['b.txt']"),
    (["data.cache_dir=/scratch/cache"],  # stdlib is tokenized in memory, never cached
     "data.cache_dir='/scratch/cache' is read only when data.name is text or jsonl or tokens or hf or sft"),
    (["optim=sgd", "optim.betas=[0.8,0.9]"], "optim.betas=[0.8, 0.9] is read only when optim.name is adamw"),
    (["optim.schedule=constant", "optim.min_lr_ratio=0.5"],
     "optim.min_lr_ratio=0.5 is read only when optim.schedule is cosine, and this run has optim.schedule='constant'"),
    (["optim.schedule=constant", "optim.decay_steps=50"], "optim.decay_steps=50 is read only when optim.schedule is"),
    (["logger.wandb.project=mine"],  # logger=wandb (or a mode) was forgotten: nothing would be logged to it
     "logger.wandb.project='mine' is read only when logger.wandb.mode is online or offline, and this run has "
     "logger.wandb.mode='disabled'"),
    (["trainer.attention=mask"], "trainer.attention=mask applies to packed rows only (batch.pack=true)"),
    (["model=hf", "model.path=/models/base", "model.lora.target_modules=[q_proj]"],
     "model.lora.target_modules=['q_proj'] is read only with LoRA on, and this run has model.lora.r=0: every "
     "weight would train"),
    (["model=hf", "model.path=/models/base", "model.lora.r=null", "model.lora.alpha=32"],
     "model.lora.alpha=32.0 is read only with LoRA on"),
])
def test_a_key_the_run_would_not_read_is_refused_instead_of_ignored(overrides, message):
    assert message in _refusal(overrides)


@pytest.mark.slow  # over 4 s (a process launch or ranks): out of the fast tier
def test_the_same_keys_are_taken_where_the_run_reads_them_or_left_at_their_defaults():
    for overrides in (["data=text", "data.paths=[c.txt]", "data.split_by=paragraph"],
                      ["data=jsonl", "data.paths=[c.jsonl]", "data.field=body", "data.on_decode_error=error"],
                      ["data=text", "data.paths=[a.txt]", "data.val_paths=[b.txt]", "data.split_by=file",
                       "data.cache_dir=/scratch/cache"],
                      ["data=sft", "data.paths=[c.jsonl]", "data.messages_field=conversation",
                       "data.prompt_field=question", "data.completion_field=answer"],
                      ["data=sft", "data.paths=[c.jsonl]", "data.format=prompt_completion", "data.prompt_field=q"],
                      ["optim=sgd"], ["optim.schedule=cosine", "optim.min_lr_ratio=0.5", "optim.decay_steps=50"],
                      ["logger=wandb", "logger.wandb.project=mine", "logger.wandb.name=first"],
                      ["trainer.attention=mask", "batch.pack=true"],
                      ["model=hf", "model.path=/models/base", "model.lora.r=4", "model.lora.target_modules=[q_proj]"]):
        assert validate_run(compose_config(overrides), 1) >= 0, overrides


@pytest.mark.parametrize("overrides, world_size, message", [
    # Path("") is the working directory: the run wrote config.yaml, checkpoints and final/ into it
    (["run.dir="], 1, "run.dir='' is empty: give the run's directory"),
    # signal.signal raised OSError after the process group had started
    (["checkpoint.preempt_signals=[SIGTERM,SIGKILL]"], 1, "checkpoint.preempt_signals has SIGKILL, which no process "
                                                          "can catch"),
    # DDP's int(nan * 2**20) failed in setup, on 2 ranks; a bucket <= 0 MiB was taken as is
    (["strategy.bucket_cap_mb=nan"], 2, "strategy.bucket_cap_mb=nan must be a finite number > 0"),
    (["strategy.bucket_cap_mb=-1"], 2, "strategy.bucket_cap_mb=-1.0 must be a finite number > 0"),
    # a number is no class name: FSDP setup compared it with the model's classes after the group had started
    (["strategy=fsdp", "strategy.shard_modules=[1]"], 2, "strategy.shard_modules=[1] must be a list of module class "
                                                         "names"),
])
def test_values_that_failed_after_start_up_or_wrote_elsewhere_are_refused_first(overrides, world_size, message):
    assert message in _refusal(overrides, world_size)


def test_a_warmup_longer_than_the_fixed_schedule_is_refused():
    # the cosine's progress is clamped: past decay_steps the lr sat at its floor from the step after warmup on
    message = _refusal(["optim.warmup_steps=20", "optim.decay_steps=10"])
    assert "optim.warmup_steps=20 must be <= optim.decay_steps=10, the schedule's length" in message
    assert validate_run(compose_config(["optim.warmup_steps=10", "optim.decay_steps=10"]), 1) == 2


def test_data_vocab_size_sizes_the_model_on_the_default_data_as_on_every_source():
    from ddptrain.data import DataError, load_splits
    from ddptrain.train.builder import build_model

    # stdlib ignored it: the run built a 256-id model while ddptrain.plan counted data.vocab_size's
    cfg = compose_config(["data.vocab_size=512", "data.max_docs=4", "model.n_layer=1", "model.n_embd=32",
                          "model.n_head=2", "batch.seq_len=32"])
    splits = load_splits(cfg.data, cfg.batch.seq_len)
    assert splits.vocab_size == 512
    model, _, _ = build_model(cfg, splits.vocab_size)
    assert model.tok_emb.num_embeddings == 512
    cfg.data.vocab_size = 100
    with pytest.raises(DataError, match=r"data.vocab_size=100 is smaller than the vocabulary of the tokenizer byte"):
        load_splits(cfg.data, cfg.batch.seq_len)


def test_a_warmup_longer_than_the_run_is_named_at_start_up_with_the_peak_it_reaches(caplog):
    """optim.warmup_steps > trainer.max_steps: the run ends inside the warmup and never trains at optim.lr."""
    from torch import nn

    from ddptrain.train.builder import optimizer_and_schedule

    with caplog.at_level("WARNING", logger="ddptrain"):
        optimizer, scheduler = optimizer_and_schedule(
            compose_config(["trainer.max_steps=10", "optim.warmup_steps=40", "optim.lr=0.001"]), nn.Linear(2, 2))
        for _ in range(9):
            optimizer.step()
            scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.001 * 10 / 40), "the last step's lr is the peak"
    assert "optim.warmup_steps=40 > trainer.max_steps=10" in caplog.text and "peaks at 0.00025" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="ddptrain"):
        optimizer_and_schedule(compose_config(["trainer.max_steps=40", "optim.warmup_steps=40"]), nn.Linear(2, 2))
    assert "warmup" not in caplog.text
