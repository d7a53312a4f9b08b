"""model.lora: peft's LoRA over a frozen model=hf base. Only the adapter trains (the base stays bit
for bit), checkpoints and final/ hold the adapter alone, final/ is a PEFT adapter directory that
PeftModel.from_pretrained loads with load_model's logits, --merge exports the folded model, the
base is fingerprinted, layouts stay exact, and every strategy trains it on 2 ranks."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess

import pytest
import torch

import ddptrain
from ddptrain.config.compose import compose_config
from ddptrain.config.schema import ConfigError
from ddptrain.config.validation import validate
from ddptrain.engine.engine import Engine
from ddptrain.export import export
from ddptrain.models.adapters import HFAdapter
from ddptrain.models.spec import ModelError
from ddptrain.strategies import state as neutral
from ddptrain.runs import store as ckpt
from ddptrain.runs.store import CheckpointError
from ddptrain.runs.weights import save_final
from ddptrain.train.optim import build_optimizer
from ddptrain.runs.resume import check_base_weights
from tests.helpers import (MODEL_RUN, import_deepspeed, import_optional, keeping_mtimes, read_metrics, run_cli,
                           save_bpe_tokenizer)
from tests.zygote import launch_command

# peft's from_pretrained still asks transformers 5 for the renamed `is_gradient_checkpointing`
# (ddptrain's own calls to peft silence it in ddptrain.models.lora).
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

transformers = import_optional("transformers")
peft = import_optional("peft")

VOCAB, SEQ = 300, 64
RUN = [*MODEL_RUN, f"batch.seq_len={SEQ}"]
LORA = ["model.lora.r=4", "model.lora.alpha=8"]
ADAPTED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _base_dir(path, seed: int = 0, dtype: torch.dtype = torch.float32, tied: bool = False):
    """A tiny "pretrained" Llama: random weights, saved with save_pretrained (in `dtype`); `tied`: its
    output head shares the input embeddings' weight (tie_word_embeddings, as in Llama 3.2 1B or Qwen2.5 0.5B)."""
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      bos_token_id=None, eos_token_id=None, pad_token_id=None,
                                      tie_word_embeddings=tied)
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(config).to(dtype).save_pretrained(path)
    return path


def _model_cfg(base, r: int = 4, target_modules="all-linear") -> dict:
    return {"name": "hf", "path": str(base), "attn_implementation": "sdpa",
            "lora": {"r": r, "alpha": 8.0, "dropout": 0.0, "target_modules": target_modules}}


def _microbatches(seed: int, count: int = 2, rows: int = 2, length: int = 16):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        tokens = torch.randint(0, 256, (rows, length + 1), generator=gen)
        targets = tokens[:, 1:].clone()
        targets[0, length // 2:] = -100  # ragged valid counts
        out.append((tokens[:, :-1], targets))
    return out


def _trained(base, steps: int = 3, **cfg):
    """An adapted model after `steps` exact steps in one process; (model, spec, engine, state before)."""
    torch.manual_seed(0)
    model, spec = HFAdapter().build(_model_cfg(base, **cfg), 256, SEQ)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    optimizer = build_optimizer(model, "adamw", 1e-2, 0.1, (0.9, 0.95))
    engine = Engine(model, optimizer, "ddp", device=torch.device("cpu"), save_frozen=False)
    for step in range(steps):
        engine.step(_microbatches(step))
    return model, spec, engine, before


def _logits(model, seed: int = 5):
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(ids).logits


# -- config ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("override, message", [
    ("model.lora.r=-1", "model.lora.r=-1 must be >= 0"),
    ("model.lora.alpha=0", "model.lora.alpha=0.0 must be > 0"),
    ("model.lora.alpha=inf", "model.lora.alpha=inf must be > 0 and finite"),
    ("model.lora.alpha=1e309", "model.lora.alpha=inf must be > 0 and finite"),
    ("model.lora.alpha=nan", "model.lora.alpha=nan must be > 0 and finite"),
    ("model.lora.dropout=nan", "model.lora.dropout=nan must be in [0, 1)"),
    ("model.lora.dropout=1.0", "model.lora.dropout=1.0 must be in [0, 1)"),
    ("model.lora.target_modules=[]", "model.lora.target_modules=[] must be all-linear or a non-empty list"),
    ("+model.lora.rank=8", "model.lora.rank is not a config key; the keys of model.lora are: r, alpha, dropout"),
])
def test_lora_config_rules_name_the_key_and_the_value(override, message):
    overrides = ["model=hf", "model.path=/some/dir", "model.lora.r=8", override]
    with pytest.raises(ConfigError) as error:
        validate(compose_config(overrides), 1)
    assert message in str(error.value)


def test_lora_is_off_by_default_and_r_null_is_off_too(tmp_path):
    base = _base_dir(tmp_path / "base")
    assert validate(compose_config(["model=hf", f"model.path={base}", "model.lora.r=null"]), 1) > 0
    for r in (0, None):
        model, spec = HFAdapter().build(_model_cfg(base, r=r), 256, SEQ)
        assert isinstance(model, transformers.LlamaForCausalLM) and spec.base_weights is None
        assert all(p.requires_grad for p in model.parameters())


# -- the wrap -------------------------------------------------------------------------------------


def test_all_linear_adapts_attention_and_mlp_projections_not_the_head(tmp_path):
    model, spec = HFAdapter().build(_model_cfg(_base_dir(tmp_path / "base")), 256, SEQ)
    assert isinstance(model, peft.PeftModelForCausalLM) and len(spec.base_weights) == 64
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    adapted = {name.split(".lora_")[0].rsplit(".", 1)[1] for name in trainable}
    assert adapted == set(ADAPTED) and all(".lora_A." in name or ".lora_B." in name for name in trainable)
    assert len(trainable) == 2 * len(ADAPTED) * 2  # A and B, 7 projections, 2 layers
    few, _ = HFAdapter().build(_model_cfg(tmp_path / "base", target_modules=["q_proj", "v_proj"]), 256, SEQ)
    assert {n.split(".lora_")[0].rsplit(".", 1)[1] for n, p in few.named_parameters() if p.requires_grad} == \
        {"q_proj", "v_proj"}
    with pytest.raises(ModelError, match=r"model.lora.target_modules=\['nope'\]"):
        HFAdapter().build(_model_cfg(tmp_path / "base", target_modules=["nope"]), 256, SEQ)


@pytest.mark.parametrize("targets, message", [
    (["q_proj", "v_projj"], r"model.lora.target_modules=\['q_proj', 'v_projj'\]: 'v_projj' matches no module of the "
                            r"model at model.path=.*"
                            r"its adaptable layers are named: .*v_proj"),
    (["q_proj", "input_layernorm"], r"'input_layernorm' matches LlamaRMSNorm modules .*LoRA adapts Linear, "
                                    r"Embedding and Conv layers only"),
])
def test_every_lora_target_must_name_an_adaptable_module(tmp_path, targets, message):
    base = _base_dir(tmp_path / "base")
    with pytest.raises(ModelError, match=message):
        HFAdapter().build(_model_cfg(base, target_modules=targets), 256, SEQ)


def test_lora_needs_base_weights(tmp_path):
    config_only = tmp_path / "config_only"
    transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=4).save_pretrained(config_only)
    with pytest.raises(ModelError, match="has no weights .* LoRA trains an adapter over pretrained weights"):
        HFAdapter().build(_model_cfg(config_only), 256, SEQ)


def test_packed_rows_reach_the_adapted_model(tmp_path):
    model, _, _, _ = _trained(_base_dir(tmp_path / "base"), steps=2)
    HFAdapter().check_model(model, _model_cfg(tmp_path / "base"), SEQ, pack=True)  # per-document logits or raise
    # The boundaries pass through peft's forward to ddptrain's attention function (the probe tells).
    assert HFAdapter().use_attention(model, "gather", forced=True) == "gather"


# -- only the adapter trains ----------------------------------------------------------------------


def test_only_the_adapter_trains_and_the_base_stays_bit_identical(tmp_path):
    model, _, engine, before = _trained(_base_dir(tmp_path / "base"))
    after = model.state_dict()
    changed = {name for name in after if not torch.equal(after[name], before[name])}
    lora_names = {name for name in after if ".lora_" in name}
    assert changed == lora_names, sorted(changed ^ lora_names)[:5]  # every A and B moved, nothing else
    optimized = {id(p) for group in engine.strategy.optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for name, p in model.named_parameters() if ".lora_" in name}
    assert all(p.grad is None for name, p in model.named_parameters() if ".lora_" not in name)


def test_a_lora_checkpoint_holds_the_adapter_and_its_optimizer_state_only(tmp_path):
    base = _base_dir(tmp_path / "base")
    model, spec, engine, _ = _trained(base)
    engine.save(tmp_path / "ckpt")
    saved = neutral.read_full(tmp_path / "ckpt", "model")["model"]
    assert set(saved) == {name for name, p in model.named_parameters() if p.requires_grad}
    # It resumes into a fresh build (the base from model.path), every weight equal.
    torch.manual_seed(1)  # another adapter init: the load must overwrite it
    fresh, _ = HFAdapter().build(_model_cfg(base), 256, SEQ)
    restored = Engine(fresh, build_optimizer(fresh, "adamw", 1e-2, 0.1, (0.9, 0.95)), "ddp",
                      device=torch.device("cpu"), save_frozen=False)
    restored.load(tmp_path / "ckpt")
    ours = model.state_dict()
    assert all(torch.equal(value, ours[name]) for name, value in fresh.state_dict().items())
    assert restored.strategy.optimizer.state_dict()["state"].keys() == engine.strategy.optimizer.state_dict()["state"].keys()


# -- final/, load_model, export -------------------------------------------------------------------


def _finished_run(tmp_path):
    base = _base_dir(tmp_path / "base")
    model, spec, engine, _ = _trained(base)
    run_dir = tmp_path / "run"
    save_final(run_dir, model, engine.model_state_dict(trainable_only=True), spec, 3, {})
    return base, run_dir, model


@pytest.mark.slow  # a trained run or a process launch (seconds): out of the fast tier
def test_final_is_a_peft_adapter_directory_with_load_models_logits(tmp_path):
    base, run_dir, trained = _finished_run(tmp_path)
    final = run_dir / "final"
    assert {"adapter_config.json", "adapter_model.safetensors", "ddptrain_model.json"} <= {p.name for p in final.iterdir()}
    assert not (final / "model.safetensors").exists()  # the adapter alone
    assert json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"] == str(base.resolve())
    theirs = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base), final)
    ours = ddptrain.load_model(run_dir)
    assert isinstance(ours, peft.PeftModelForCausalLM) and not ours.training
    assert torch.equal(_logits(theirs), _logits(ours))
    trained.eval()
    assert torch.equal(_logits(ours), _logits(trained))  # the weights that trained
    assert not torch.equal(_logits(ours), _logits(transformers.AutoModelForCausalLM.from_pretrained(base)))


@pytest.mark.slow  # a trained run or a process launch (seconds): out of the fast tier
def test_merged_export_is_a_plain_transformers_model_with_the_same_logits(tmp_path):
    _, run_dir, _ = _finished_run(tmp_path)
    expected = _logits(ddptrain.load_model(run_dir))
    export(run_dir, tmp_path / "merged", merge=True)
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert type(merged).__name__ == "LlamaForCausalLM" and not any("lora" in n for n, _ in merged.named_parameters())
    assert torch.allclose(_logits(merged), expected, rtol=0, atol=1e-5)
    export(run_dir, tmp_path / "adapter")  # without --merge: the adapter directory
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()


@pytest.mark.filterwarnings("ignore:Model (has|with) `tie_word_embeddings=True`:UserWarning")
@pytest.mark.parametrize("adapted", [["lm_head", "q_proj"], ["embed_tokens", "q_proj"]])
def test_an_adapter_on_a_tied_head_or_embedding_merges_to_the_logits_it_trained_to(tmp_path, adapted):
    # Folded into a weight that the head and the embeddings share, the adapter of one would change both.
    base = _base_dir(tmp_path / "base", tied=True)
    model, spec, engine, _ = _trained(base, target_modules=adapted)
    save_final(tmp_path / "run", model, engine.model_state_dict(trainable_only=True), spec, 3, {})
    model.eval()
    export(tmp_path / "run", tmp_path / "merged", merge=True)
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert torch.allclose(_logits(merged), _logits(model), rtol=0, atol=1e-5)
    assert not merged.config.tie_word_embeddings  # the head and the embeddings now differ
    kept = transformers.AutoModelForCausalLM.from_pretrained(base)  # the tie is cut in the merge, not in the base
    assert kept.lm_head.weight is kept.model.embed_tokens.weight


@pytest.mark.slow  # a trained run or a process launch (seconds): out of the fast tier
def test_a_bf16_base_loads_and_merges_in_fp32_the_dtype_it_trained_in(tmp_path):
    base = _base_dir(tmp_path / "base", dtype=torch.bfloat16)
    assert json.loads((base / "config.json").read_text())["dtype"] == "bfloat16"
    model, spec, engine, _ = _trained(base)
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # training loads the base in fp32
    run_dir = tmp_path / "run"
    save_final(run_dir, model, engine.model_state_dict(trainable_only=True), spec, 3, {})
    loaded = ddptrain.load_model(run_dir)
    assert {p.dtype for p in loaded.parameters()} == {torch.float32}
    model.eval()
    assert torch.equal(_logits(loaded), _logits(model))  # the module that trained
    export(run_dir, tmp_path / "merged", merge=True)
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype="auto")
    assert {p.dtype for p in merged.parameters()} == {torch.float32}
    assert torch.allclose(_logits(merged), _logits(model), rtol=0, atol=1e-5)


def test_merge_changes_nothing_for_a_run_that_trained_every_weight(tmp_path):
    base = _base_dir(tmp_path / "base")
    model, spec = HFAdapter().build(_model_cfg(base, r=0), 256, SEQ)
    save_final(tmp_path / "run", model, model.state_dict(), spec, 1, {})
    export(tmp_path / "run", tmp_path / "merged", merge=True)
    export(tmp_path / "run", tmp_path / "plain")
    merged, plain = (transformers.AutoModelForCausalLM.from_pretrained(tmp_path / name) for name in ("merged", "plain"))
    assert torch.equal(_logits(merged), _logits(plain))


@pytest.mark.slow  # a trained run or a process launch (seconds): out of the fast tier
def test_other_base_weights_are_refused_by_load_model_and_on_resume(tmp_path):
    base, run_dir, _ = _finished_run(tmp_path)
    spec_dict = json.loads((run_dir / "final" / "ddptrain_model.json").read_text())
    _base_dir(base, seed=1)  # other weights at the same path
    with pytest.raises(ModelError, match="trained over other base weights than those now at model.path="):
        ddptrain.load_model(run_dir)
    _, rebuilt_spec = HFAdapter().build(_model_cfg(base), 256, SEQ)
    with pytest.raises(CheckpointError, match="its LoRA adapter was trained over other base weights"):
        check_base_weights(spec_dict, rebuilt_spec, run_dir)
    _base_dir(base, seed=0)  # the original weights back: both are accepted again
    check_base_weights(spec_dict, HFAdapter().build(_model_cfg(base), 256, SEQ)[1], run_dir)
    ddptrain.load_model(run_dir)


@pytest.mark.slow  # a trained run or a process launch (seconds): out of the fast tier
def test_the_servable_merge_is_remade_when_the_base_changes_under_the_same_mtimes(tmp_path):
    from ddptrain.serving.servable import MARKER, ServableError, servable_dir

    base, run_dir, _ = _finished_run(tmp_path)
    before = _logits(transformers.AutoModelForCausalLM.from_pretrained(servable_dir(run_dir)))
    assert torch.allclose(before, _logits(ddptrain.load_model(run_dir)), rtol=0, atol=1e-5)
    made = (run_dir / "servable" / MARKER).stat().st_mtime_ns

    generation = json.loads((base / "generation_config.json").read_text())  # a base file that is not the model's
    keeping_mtimes(base, lambda: (base / "generation_config.json").write_text(json.dumps({**generation, "top_k": 7})))
    after = _logits(transformers.AutoModelForCausalLM.from_pretrained(servable_dir(run_dir)))
    assert (run_dir / "servable" / MARKER).stat().st_mtime_ns != made  # remade from the changed base
    assert torch.equal(after, before)

    config = json.loads((base / "config.json").read_text())  # the same weights, another function of them
    keeping_mtimes(base, lambda: (base / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 0.5})))
    with pytest.raises(ServableError, match="rms_norm_eps"):  # not what trained: refused, never served
        servable_dir(run_dir)
    keeping_mtimes(base, lambda: (base / "config.json").write_text(json.dumps(config)))

    keeping_mtimes(base, lambda: _base_dir(base, seed=1))  # other base weights: refused, not served stale
    with pytest.raises(ServableError, match="trained over other base weights than those now at model.path="):
        servable_dir(run_dir)


@pytest.mark.slow  # a trained run or a process launch (seconds): out of the fast tier
def test_exporting_a_lora_run_whose_base_is_gone_names_the_missing_base(tmp_path, capsys):
    from ddptrain.export import main

    base, run_dir, _ = _finished_run(tmp_path)
    shutil.rmtree(base)
    with pytest.raises(SystemExit) as exit_info:
        main([str(run_dir), str(tmp_path / "out"), "--merge"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert f"model.path={base}, which is not there (any more)" in error and "Repo id" not in error, error


@pytest.mark.parametrize("key, value", [("rms_norm_eps", 0.5),
                                        ("rope_parameters", {"rope_theta": 1234.0, "rope_type": "default"})])
@pytest.mark.slow  # a trained run or a process launch (seconds): out of the fast tier
def test_an_edited_base_config_is_refused_by_load_model_export_and_serving(tmp_path, key, value):
    """The base's config.json is part of what the adapter trained over, as a resume already says."""
    from ddptrain.serving.servable import ServableError, servable_dir

    base, run_dir, trained = _finished_run(tmp_path)
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, key: value}))
    with pytest.raises(ModelError, match=f"{key}: .* -> "):
        ddptrain.load_model(run_dir)
    with pytest.raises(ModelError, match=key):
        export(run_dir, tmp_path / "merged", merge=True)
    assert not (tmp_path / "merged").exists()
    with pytest.raises(ServableError, match=key):
        servable_dir(run_dir)
    (base / "config.json").write_text(json.dumps(config))  # put back: accepted again, the trained logits
    trained.eval()
    assert torch.equal(_logits(ddptrain.load_model(run_dir)), _logits(trained))


# -- CLI runs -------------------------------------------------------------------------------------


def _losses(run_dir) -> list[float]:
    return [m["loss"] for m in read_metrics(run_dir)]


def _run(tmp_path, name: str, args: list[str], nproc: int):
    run_dir = tmp_path / name
    result = run_cli([*args, f"run.dir={run_dir}"], nproc=nproc)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


def _checkpoint_weights(run_dir, step: int, strategy: str) -> dict:
    return ckpt.read_weights(run_dir / "checkpoints" / f"step_{step:08d}")


@pytest.mark.slow
def test_lora_layouts_are_exact_in_fp64_and_final_holds_the_adapter_and_tokenizer(tmp_path):
    base = _base_dir(tmp_path / "base")
    save_bpe_tokenizer(base / "tokenizer.json")
    args = ["model=hf", f"model.path={base}", *LORA, "trainer.max_steps=4", "checkpoint.every=2", *RUN,
            "trainer.precision=fp64"]
    one = _run(tmp_path, "1x8", [*args, "batch.micro_size=8"], nproc=1)
    two = _run(tmp_path, "2x2", [*args, "batch.micro_size=2"], nproc=2)
    for mine, ref in zip(_losses(two), _losses(one), strict=True):
        assert math.isclose(mine, ref, rel_tol=1e-9), (mine, ref)
    assert _losses(one)[-1] < _losses(one)[0]  # the adapter learns
    final = two / "final"
    assert (final / "tokenizer.json").read_bytes() == (base / "tokenizer.json").read_bytes()
    assert (final / "adapter_model.safetensors").is_file() and not (final / "model.safetensors").exists()
    adapter = {name for name in _checkpoint_weights(two, 4, "ddp")}
    assert adapter and all(".lora_A." in name or ".lora_B." in name for name in adapter)
    theirs = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base), final)
    assert torch.equal(_logits(theirs), _logits(ddptrain.load_model(two)))


def _chat_model_dir(path):
    """A tiny base with its own BPE tokenizer (EOS, a ChatML template that marks assistant turns)."""
    tokenizers = import_optional("tokenizers")
    _base_dir(path)
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=290, special_tokens=["<|im_start|>", "<|im_end|>", "<eos>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["user\nassistant\n the cat sat on the mat"] * 20, trainer=trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>")
    fast.chat_template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}{% if m['role'] == 'assistant' %}"
        "{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{% else %}"
        "{{ m['content'] + '<|im_end|>' }}{% endif %}{{ '\\n' }}{% endfor %}")
    fast.save_pretrained(path)
    return path


@pytest.mark.slow
def test_lora_fine_tunes_chats_and_the_merged_export_has_its_logits(tmp_path):
    base = _chat_model_dir(tmp_path / "my_model")
    words = "the a cat dog sat ran on under mat rug big small".split()
    chats = [{"messages": [{"role": "user", "content": " ".join(words[i % 7:i % 7 + 3])},
                           {"role": "assistant", "content": " ".join(words[i % 5:i % 5 + 1 + i % 6])}]}
             for i in range(60)]
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(chat) + "\n" for chat in chats))
    run_dir = _run(tmp_path, "run", ["model=hf", f"model.path={base}", "model.lora.r=16", "data=sft",
                                     f"data.paths=[{tmp_path / 'chats.jsonl'}]", "trainer.max_steps=3",
                                     "trainer.log_every=1", "batch.seq_len=64", "batch.global_size=8",
                                     "batch.micro_size=4"], nproc=1)
    final = run_dir / "final"
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "chat_template.jinja"} <= \
        {p.name for p in final.iterdir()}
    result = subprocess.run([*launch_command(["-m", "ddptrain.export"]), str(run_dir), str(tmp_path / "merged"),
                             "--merge"], capture_output=True, text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 0, result.stderr[-3000:]
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert torch.allclose(_logits(merged), _logits(ddptrain.load_model(run_dir)), rtol=0, atol=1e-5)
    assert (tmp_path / "merged" / "tokenizer.json").is_file()
    tokenizer = transformers.AutoTokenizer.from_pretrained(base)  # generation stops at end of turn and at EOS
    stops = sorted(tokenizer.convert_tokens_to_ids(["<|im_end|>", "<eos>"]))
    assert merged.generation_config.eos_token_id == stops
    # The adapter directory, from final/ and from the newest checkpoint: the same files, the same stop
    # tokens (before, final/'s export dropped generation_config.json: generation never stopped).
    unfinished = tmp_path / "unfinished"
    shutil.copytree(run_dir, unfinished, ignore=shutil.ignore_patterns("final"))
    export(run_dir, tmp_path / "adapter")
    export(unfinished, tmp_path / "adapter-of-a-checkpoint")
    for adapter in (tmp_path / "adapter", tmp_path / "adapter-of-a-checkpoint"):
        config = transformers.GenerationConfig.from_pretrained(adapter)
        assert config.eos_token_id == stops, (adapter, config.eos_token_id)
    assert {p.name for p in (tmp_path / "adapter").iterdir()} == \
        {p.name for p in (tmp_path / "adapter-of-a-checkpoint").iterdir()}


@pytest.mark.slow
def test_a_resume_over_other_base_weights_is_refused(tmp_path):
    base = _base_dir(tmp_path / "base")
    args = ["model=hf", f"model.path={base}", *LORA, *RUN, "batch.micro_size=8", f"run.dir={tmp_path / 'run'}"]
    first = run_cli([*args, "trainer.max_steps=1"])
    assert first.returncode == 0, first.stderr[-3000:]
    # the start-up plan counts the adapter alone as trainable, built without loading or hashing the base
    assert "memory plan unavailable" not in first.stderr and " parameters (4,096 train)" in first.stderr, \
        first.stderr[-3000:]
    _base_dir(base, seed=1)
    result = run_cli([*args, "trainer.max_steps=2"])
    assert result.returncode == 2 and "its LoRA adapter was trained over other base weights" in result.stderr


@pytest.fixture(scope="module")
def ddp_on_two_ranks(tmp_path_factory):
    """(the CLI arguments, ddp's loss curve on 2 ranks): the reference of the sharded strategies."""
    tmp_path = tmp_path_factory.mktemp("lora_ddp")
    base = _base_dir(tmp_path / "base")
    args = ["model=hf", f"model.path={base}", *LORA, "trainer.max_steps=3", "checkpoint.every=2", *RUN,
            "batch.micro_size=2"]
    return args, _losses(_run(tmp_path, "ddp", args, nproc=2))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "zero2", "zero3"])  # zero1 shares zero2's code for frozen parameters
def test_sharded_strategies_train_the_adapter_on_two_ranks_and_resume(tmp_path, strategy, ddp_on_two_ranks):
    if strategy.startswith("zero"):
        import_deepspeed()
    args, reference = ddp_on_two_ranks
    run_dir = _run(tmp_path, strategy, [*args, f"strategy={strategy}"], nproc=2)
    for mine, ref in zip(_losses(run_dir), reference, strict=True):
        assert math.isclose(mine, ref, rel_tol=1e-5), (strategy, mine, ref)
    saved = _checkpoint_weights(run_dir, 2, strategy)
    assert saved and all(".lora_A." in name or ".lora_B." in name for name in saved), sorted(saved)[:5]
    # Resume from step 2's adapter-only checkpoint: the same last step as the run that went straight on.
    resumed = tmp_path / "resumed"
    shutil.copytree(run_dir, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000003")
    shutil.rmtree(resumed / "final")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    (resumed / "metrics.jsonl").write_text("\n".join(lines[:2]) + "\n")
    result = run_cli([*args, f"strategy={strategy}", f"run.dir={resumed}"], nproc=2)
    assert result.returncode == 0 and "resumed from" in result.stderr, result.stderr[-3000:]
    assert math.isclose(_losses(resumed)[-1], _losses(run_dir)[-1], rel_tol=1e-6)
    assert torch.allclose(_logits(ddptrain.load_model(resumed)), _logits(ddptrain.load_model(run_dir)), atol=1e-6)
