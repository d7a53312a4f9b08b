"""Any model in, the trained model out: model=hf, model._target_, final/, load_model, re-runs."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

import ddptrain
from ddptrain.models.spec import ModelError
from tests.helpers import (MODEL_RUN, TINY_RUN, finished_run, import_deepspeed, import_optional, read_metrics,
                           run_cli, save_bpe_tokenizer)

transformers = import_optional("transformers")

RUN = [*MODEL_RUN, "batch.seq_len=64"]
FP64 = ["trainer.precision=fp64"]


def _llama_dir(path, vocab_size=300, weights=False, seed=0):
    config = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if weights:
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(config)
        with torch.no_grad():
            model.lm_head.weight.mul_(30)  # "pretrained": far from the uniform predictions of a fresh init
        model.save_pretrained(path)
    else:
        config.save_pretrained(path)
    return path


def torch_read_weights(checkpoint) -> dict[str, torch.Tensor]:
    """A checkpoint's weights read by torch's own DCP converter (not ddptrain's reader)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(checkpoint / "state"), str(checkpoint.parent / "full.pt"))
    return torch.load(checkpoint.parent / "full.pt", weights_only=False)["model"]


def _losses(run_dir) -> list[float]:
    return [m["loss"] for m in read_metrics(run_dir)]


def _assert_same_curves(curves: dict, tolerance: float) -> None:
    reference_name, reference = next(iter(curves.items()))
    for name, curve in curves.items():
        assert len(curve) == len(reference), name
        for step, (mine, ref) in enumerate(zip(curve, reference), 1):
            assert math.isclose(mine, ref, rel_tol=tolerance), (name, reference_name, step, mine, ref)


def _train_layouts(tmp_path, args: list[str], layouts=((1, 8), (2, 2))) -> dict:
    curves = {}
    for ranks, micro in layouts:
        run_dir = tmp_path / f"{ranks}x{micro}"
        result = run_cli([*args, f"batch.micro_size={micro}", f"run.dir={run_dir}"], nproc=ranks)
        assert result.returncode == 0, result.stderr[-3000:]
        curves[(ranks, micro)] = _losses(run_dir)
    return curves


# -- config ---------------------------------------------------------------------------------------


@pytest.mark.slow  # over 4 s (a process launch or ranks): out of the fast tier
def test_an_unknown_key_is_refused_by_the_command_before_anything_is_written(tmp_path):
    result = run_cli(["+trainer.max_step=5", f"run.dir={tmp_path / 'run'}"])
    assert result.returncode == 2, result.stderr[-2000:]
    assert "trainer.max_step is not a config key" in result.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("override, key", [("+trainer.max_step=5", "trainer.max_step"),
                                           ("+model.n_layers=2", "model.n_layers"),
                                           ("+objective.zloss=1", "objective.zloss")])
def test_unknown_keys_are_refused_however_they_are_written(override, key):
    """In this process, through what the command runs first (composing, then validate_run): the
    launch above shows how that refusal reaches the user."""
    from ddptrain.config.compose import compose_config
    from ddptrain.config.schema import ConfigError
    from ddptrain.train.builder import validate_run

    with pytest.raises(ConfigError, match=f"{key} is not a config key"):
        validate_run(compose_config([override]), 1)


@pytest.mark.slow
def test_model_errors_name_the_value_and_the_rule(tmp_path):
    missing = run_cli(["model=hf", f"model.path={tmp_path / 'nowhere'}", *RUN, f"run.dir={tmp_path / 'a'}"])
    assert missing.returncode == 2 and f"model.path={tmp_path / 'nowhere'}: no such directory" in missing.stderr
    small = _llama_dir(tmp_path / "small", vocab_size=100)  # the byte tokenizer has 256 ids
    result = run_cli(["model=hf", f"model.path={small}", *RUN, f"run.dir={tmp_path / 'b'}"])
    assert result.returncode == 2 and "vocabulary (100 ids) does not cover the tokenizer's (256 ids)" in result.stderr
    result = run_cli(["model=custom", "model._target_=tests.no_such_module.build", *RUN, f"run.dir={tmp_path / 'c'}"])
    assert result.returncode == 2 and "model._target_='tests.no_such_module.build' cannot be imported" in result.stderr
    result = run_cli(["model=custom", "model._target_=tests.toy_models.make_conv_lm", "+model.depth=3", *RUN,
                      f"run.dir={tmp_path / 'd'}"])
    assert result.returncode == 2 and "does not take depth" in result.stderr
    result = run_cli(["model=custom", "model._target_=tests.toy_models.make_conv_lm", "batch.pack=true", *RUN,
                      f"run.dir={tmp_path / 'e'}"])
    assert result.returncode == 2 and "batch.pack=true needs a model whose forward takes positions= and segments=" \
        in result.stderr


def test_the_packing_probe_refuses_a_model_that_attends_across_documents(tmp_path, monkeypatch):
    from ddptrain.models import hf

    model = hf.load_causal_lm(str(_llama_dir(tmp_path / "llama")), "sdpa", 256)
    hf.check_packing(model)  # honours the per-document mask
    full = lambda segments, dtype, window=None: torch.zeros(segments.shape[0], 1, segments.shape[1], segments.shape[1], dtype=dtype)
    monkeypatch.setattr(hf, "document_mask", full)  # a mask that lets every token see the earlier document
    with pytest.raises(ModelError, match="does not keep attention inside each packed document"):
        hf.check_packing(model)


# -- model=hf -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_llama_from_a_config_json_trains_exactly_and_saves_a_pretrained_directory(tmp_path):
    llama = _llama_dir(tmp_path / "llama")
    curves = _train_layouts(tmp_path, ["model=hf", f"model.path={llama}", "trainer.max_steps=4", *RUN, *FP64])
    _assert_same_curves(curves, 1e-9)
    run_dir = tmp_path / "2x2"
    final = run_dir / "final"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(final)
    assert type(loaded).__name__ == "LlamaForCausalLM"
    ours = ddptrain.load_model(run_dir)
    assert not ours.training and next(ours.parameters()).device.type == "cpu"
    ids = torch.randint(0, 256, (2, 16))
    assert torch.equal(loaded(ids).logits, ours(ids).logits)
    start = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(llama))
    assert not torch.equal(loaded.lm_head.weight.double(), start.lm_head.weight.double())  # it trained


@pytest.mark.slow
def test_a_packed_hf_model_keeps_the_loss_curve_over_layouts(tmp_path):
    llama = _llama_dir(tmp_path / "llama")
    args = ["model=hf", f"model.path={llama}", "trainer.max_steps=3", "batch.pack=true", *RUN, *FP64]
    curves = _train_layouts(tmp_path, args, layouts=((1, 8), (2, 1)))
    _assert_same_curves(curves, 1e-9)


@pytest.mark.slow
def test_fine_tuning_starts_from_the_saved_weights(tmp_path):
    from ddptrain.config import DataConfig
    from ddptrain.data import TrainBatches, load_splits
    from ddptrain.engine.objective import token_loss_sum

    pretrained = _llama_dir(tmp_path / "pretrained", weights=True, seed=7)
    run_dir = tmp_path / "run"
    result = run_cli(["model=hf", f"model.path={pretrained}", "trainer.max_steps=1", "batch.micro_size=8", *RUN, *FP64,
                      f"run.dir={run_dir}"])
    assert result.returncode == 0, result.stderr[-3000:]
    # the start-up plan builds the model from config.json: from_pretrained cannot run on the meta device
    assert "memory plan unavailable" not in result.stderr and "memory plan: " in result.stderr, result.stderr[-3000:]
    logged = read_metrics(run_dir)[0]["loss"]

    # The same batch through the saved model, by hand: global mean over its valid targets.
    data = load_splits(DataConfig(max_docs=40, tokenizer="byte"), 64)
    batches = TrainBatches(data.train, 8, 8, seed=1234, rank=0, world_size=1)
    model = transformers.AutoModelForCausalLM.from_pretrained(pretrained, dtype=torch.float64)
    fresh = transformers.AutoModelForCausalLM.from_config(model.config, dtype=torch.float64)
    with torch.no_grad():
        def mean_loss(lm):
            total, count = 0.0, 0
            for inputs, targets in batches.microbatches(0):
                total += float(token_loss_sum(lm(inputs).logits, targets))
                count += int((targets != -100).sum())
            return total / count
        expected, untrained = mean_loss(model), mean_loss(fresh)
    assert math.isclose(logged, expected, rel_tol=1e-9), (logged, expected)
    assert not math.isclose(logged, untrained, rel_tol=1e-3), "the check would not tell pretrained from fresh"


@pytest.mark.slow
def test_the_model_directory_tokenizer_is_used_and_saved(tmp_path):
    llama = _llama_dir(tmp_path / "llama")
    save_bpe_tokenizer(llama / "tokenizer.json")
    run_dir = tmp_path / "run"
    result = run_cli(["model=hf", f"model.path={llama}", "trainer.max_steps=2", "batch.micro_size=8", *RUN,
                      f"run.dir={run_dir}"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"tokenizer {llama / 'tokenizer.json'}" in result.stderr or str(llama / "tokenizer.json") in \
        (run_dir / "config.yaml").read_text()
    assert (run_dir / "final" / "tokenizer.json").read_bytes() == (llama / "tokenizer.json").read_bytes()


# -- model._target_ -------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_target_factory_model_trains_exactly_and_reloads(tmp_path):
    args = ["model=custom", "model._target_=tests.toy_models.make_conv_lm", "+model.width=24", "trainer.max_steps=4",
            *RUN, *FP64]
    curves = _train_layouts(tmp_path, args)
    _assert_same_curves(curves, 1e-9)
    run_dir = tmp_path / "2x2"
    model = ddptrain.load_model(run_dir)
    assert type(model).__name__ == "CausalConvLM" and model.embed.embedding_dim == 24
    spec = json.loads((run_dir / "final" / "ddptrain_model.json").read_text())
    assert spec["kind"] == "custom" and spec["step"] == 4
    checkpoint = torch_read_weights(run_dir / "checkpoints" / "step_00000004")
    for name, value in model.state_dict().items():
        assert torch.equal(value, checkpoint[name]), name


# -- final weights, re-runs -----------------------------------------------------------------------


@pytest.mark.slow
def test_rerunning_with_more_steps_resumes_bit_exactly_and_keeps_the_metrics(tmp_path):
    base = [*TINY_RUN, "batch.seq_len=64", "batch.global_size=8", "batch.micro_size=4", "optim.decay_steps=8"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert run_cli([*base, "trainer.max_steps=8", f"run.dir={straight}"]).returncode == 0
    first = run_cli([*base, "trainer.max_steps=4", f"run.dir={resumed}"])
    assert first.returncode == 0, first.stderr[-3000:]
    first_lines = (resumed / "metrics.jsonl").read_text().splitlines()
    second = run_cli([*base, "trainer.max_steps=8", f"run.dir={resumed}"])
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stderr and "step 4" in second.stderr
    lines = (resumed / "metrics.jsonl").read_text().splitlines()
    assert lines[:4] == first_lines, "the first run's metrics must be kept as they were"
    assert [json.loads(line)["step"] for line in lines] == list(range(1, 9))
    assert _losses(resumed) == _losses(straight)  # bit for bit
    a, b = ddptrain.load_model(straight).state_dict(), ddptrain.load_model(resumed).state_dict()
    assert all(torch.equal(a[name], b[name]) for name in a)
    again = run_cli([*base, "trainer.max_steps=8", f"run.dir={resumed}"])
    assert again.returncode == 0 and "nothing to do: this run already finished at step 8" in again.stderr
    assert (resumed / "metrics.jsonl").read_text().splitlines() == lines
    shorter = run_cli([*base, "trainer.max_steps=6", f"run.dir={resumed}"])
    assert shorter.returncode == 2 and "past trainer.max_steps=6" in shorter.stderr


TWO_STEPS = [*TINY_RUN, "batch.seq_len=64", "batch.global_size=8", "batch.micro_size=8", "trainer.max_steps=2"]


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    return finished_run(tmp_path_factory, "two-steps", TWO_STEPS)


@pytest.mark.slow
def test_changing_max_steps_without_decay_steps_warns_about_the_schedule(two_steps, tmp_path):
    shutil.copytree(two_steps, tmp_path, dirs_exist_ok=True)
    result = run_cli([*TWO_STEPS, f"run.dir={tmp_path}", "trainer.max_steps=3"])
    assert result.returncode == 0 and "the LR schedule now runs over 3 steps instead of 2" in result.stderr


@pytest.mark.slow
def test_load_model_falls_back_to_the_newest_checkpoint(two_steps, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(two_steps, run_dir)
    final = {k: v.clone() for k, v in ddptrain.load_model(run_dir).state_dict().items()}
    shutil.rmtree(run_dir / "final")
    from_checkpoint = ddptrain.load_model(run_dir).state_dict()
    assert all(torch.equal(final[name], from_checkpoint[name]) for name in final)
    with pytest.raises(FileNotFoundError, match="holds no trained weights"):
        ddptrain.load_model(tmp_path)


@pytest.mark.slow
def test_zero3_on_two_ranks_leaves_final_weights_that_load_model_reads(tmp_path):
    import_deepspeed()

    run_dir = tmp_path / "run"
    result = run_cli([*TINY_RUN, "strategy=zero3", "batch.seq_len=64", "batch.global_size=8", "batch.micro_size=2",
                      "trainer.max_steps=3", f"run.dir={run_dir}"], nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    model = ddptrain.load_model(run_dir)
    reference = torch_read_weights(run_dir / "checkpoints" / "step_00000003")
    for name, value in model.state_dict().items():
        assert torch.equal(value, reference[name]), name
    assert any(value.abs().sum() > 0 for value in model.state_dict().values())
