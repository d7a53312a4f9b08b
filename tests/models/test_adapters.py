"""One adapter per kind of model, and one rule for a model's transformer blocks."""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from ddptrain.models.adapters import CustomAdapter, GPTAdapter, HFAdapter, adapter_for, adapter_of
from ddptrain.contract.blocks import block_class_names, transformer_blocks
from ddptrain.models.compiling import compile_model
from ddptrain.models.spec import ModelError, ModelSpec
from ddptrain.strategies.fsdp import default_shard_modules
from ddptrain.runs.weights import SPEC_FILE, WEIGHTS_FILE, load_model, save_final
from tests.helpers import SEQ, VOCAB, import_optional

GPT_CFG = {"name": "gpt", "n_layer": 3, "n_head": 2, "n_embd": 16}
CONV_CFG = {"_target_": "tests.toy_models.make_conv_lm", "width": 8}


def tiny_llama(num_layers: int = 3, max_positions: int = SEQ) -> nn.Module:
    transformers = import_optional("transformers")
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=num_layers, num_attention_heads=2, num_key_value_heads=1,
                                      max_position_embeddings=max_positions)
    return transformers.LlamaForCausalLM(config)


def tiny_llama_dir(directory, max_positions: int = SEQ) -> str:
    tiny_llama(2, max_positions).config.save_pretrained(directory)
    return str(directory)


# -- picking the adapter ---------------------------------------------------------------------------


@pytest.mark.parametrize("model_cfg, adapter", [
    (GPT_CFG, GPTAdapter),
    ({"n_layer": 2}, GPTAdapter),  # the built-in GPT is the default model
    ({"name": "hf", "path": "/some/dir"}, HFAdapter),
    (CONV_CFG, CustomAdapter),
    ({"name": "hf", "_target_": "pkg.build"}, CustomAdapter),  # a factory wins over a name
])
def test_adapter_for_picks_the_kind_of_a_config_section(model_cfg, adapter):
    for section in (model_cfg, OmegaConf.create(model_cfg)):
        picked = adapter_for(section)
        assert type(picked) is adapter and picked.kind == {GPTAdapter: "gpt", HFAdapter: "hf",
                                                           CustomAdapter: "custom"}[adapter]


def test_adapter_for_refuses_an_unknown_name():
    with pytest.raises(ModelError, match=r"model.name='mamba' is not one of gpt, hf"):
        adapter_for({"name": "mamba"})


def test_adapter_of_a_spec_is_the_adapter_that_built_it():
    for model_cfg in (GPT_CFG, CONV_CFG):
        _, spec = adapter_for(model_cfg).build(model_cfg, VOCAB, SEQ)
        assert type(adapter_of(spec)) is type(adapter_for(model_cfg))
    assert adapter_of(spec).target == "tests.toy_models.make_conv_lm"
    assert isinstance(adapter_of(ModelSpec(kind="hf", config={}, vocab_size=VOCAB, max_seq_len=SEQ)), HFAdapter)
    with pytest.raises(ModelError, match="kind='rnn' is not one of gpt, hf, custom"):
        adapter_of(ModelSpec(kind="rnn", config={}, vocab_size=VOCAB, max_seq_len=SEQ))


# -- kind-specific behaviour -----------------------------------------------------------------------


def test_tokenizer_defaults_and_files_per_kind(tmp_path):
    model_dir = tmp_path / "llama"
    model_dir.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        (model_dir / name).write_text("{}")
    other = tmp_path / "other.json"
    other.write_text("{}")
    hf_cfg = {"name": "hf", "path": str(model_dir)}
    hf = adapter_for(hf_cfg)
    assert hf.default_tokenizer(hf_cfg) == str(model_dir / "tokenizer.json")
    assert hf.tokenizer_files(hf_cfg, str(model_dir / "tokenizer.json")) == {
        "tokenizer.json": model_dir / "tokenizer.json", "tokenizer_config.json": model_dir / "tokenizer_config.json"}
    assert hf.tokenizer_files(hf_cfg, str(other)) == {"tokenizer.json": other}  # the run used another tokenizer
    (model_dir / "tokenizer.json").unlink()
    assert hf.default_tokenizer(hf_cfg) is None
    gpt = adapter_for(GPT_CFG)
    assert gpt.default_tokenizer(GPT_CFG) is None
    assert gpt.tokenizer_files(GPT_CFG, "byte") == {} and gpt.tokenizer_files(GPT_CFG, None) == {}
    assert gpt.tokenizer_files(GPT_CFG, str(other)) == {"tokenizer.json": other}  # final/ names it tokenizer.json
    for name in ("tokenizer_config.json", "chat_template.jinja", "vocab.json"):  # its companions beside it go too
        (tmp_path / name).write_text("{}")
    assert gpt.tokenizer_files(GPT_CFG, str(other)) == {"tokenizer.json": other, **{
        name: tmp_path / name for name in ("tokenizer_config.json", "chat_template.jinja")}}


def test_check_model_refuses_packing_and_a_too_long_context(tmp_path):
    conv, _ = adapter_for(CONV_CFG).build(CONV_CFG, VOCAB, SEQ)
    adapter_for(CONV_CFG).check_model(conv, CONV_CFG, SEQ, pack=False)
    with pytest.raises(ModelError, match="batch.pack=true needs a model whose forward takes positions= and "
                                         "segments=.*CausalConvLM.forward does not"):
        adapter_for(CONV_CFG).check_model(conv, CONV_CFG, SEQ, pack=True)
    gpt, _ = adapter_for(GPT_CFG).build(GPT_CFG, VOCAB, SEQ)
    adapter_for(GPT_CFG).check_model(gpt, GPT_CFG, SEQ, pack=True)
    hf_cfg = {"name": "hf", "path": tiny_llama_dir(tmp_path / "llama", max_positions=SEQ)}
    llama, spec = adapter_for(hf_cfg).build(hf_cfg, VOCAB, SEQ)
    assert spec.kind == "hf" and spec.hf_config["model_type"] == "llama"
    adapter_for(hf_cfg).check_model(llama, hf_cfg, SEQ, pack=True)  # the probe: sdpa honours the mask
    with pytest.raises(ModelError, match=rf"batch.seq_len={SEQ + 1} exceeds the model's context of {SEQ} "
                                         rf"positions \(model.path={hf_cfg['path']}\)"):
        adapter_for(hf_cfg).check_model(llama, hf_cfg, SEQ + 1, pack=False)


# -- final/ round trips ----------------------------------------------------------------------------


def _trained_weights(model: nn.Module) -> None:
    """Weights no fresh build has (a rebuild from the spec alone cannot pass the comparison)."""
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param))


@pytest.mark.parametrize("model_cfg", [GPT_CFG, CONV_CFG], ids=["gpt", "custom"])
def test_save_final_loads_back_with_equal_weights(model_cfg, tmp_path):
    torch.manual_seed(0)
    model, spec = adapter_for(model_cfg).build(model_cfg, VOCAB, SEQ)
    _trained_weights(model)
    adapter = adapter_of(spec)
    directory = tmp_path / "weights"
    directory.mkdir()
    adapter.save_final(model, model.state_dict(), directory, spec)
    loaded = adapter.load_final(directory, spec)
    assert type(loaded) is type(model)
    assert loaded.state_dict().keys() == model.state_dict().keys()
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    if spec.kind == "gpt":
        assert spec.tied and loaded.head.weight is loaded.tok_emb.weight  # stored once, tied again on load

    save_final(tmp_path / "run", model, model.state_dict(), spec, step=7, tokenizer_files={})
    through_run_dir = load_model(tmp_path / "run")
    assert not through_run_dir.training
    assert all(torch.equal(through_run_dir.state_dict()[name], tensor) for name, tensor in model.state_dict().items())


def test_a_final_dir_written_before_the_adapters_still_loads(tmp_path):
    """ddptrain_model.json as earlier versions wrote it (kind, class_name, ...), beside model.safetensors."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model, _ = adapter_for(GPT_CFG).build(GPT_CFG, VOCAB, SEQ)
    _trained_weights(model)
    final = tmp_path / "final"
    final.mkdir()
    state = {name: tensor for name, tensor in model.state_dict().items() if name != "head.weight"}
    save_file(state, str(final / WEIGHTS_FILE), metadata={"format": "pt"})
    (final / SPEC_FILE).write_text(json.dumps({
        "kind": "gpt", "config": GPT_CFG, "vocab_size": VOCAB, "max_seq_len": SEQ,
        "class_name": "ddptrain.models.gpt.GPT", "hf_config": None, "tied": {"head.weight": "tok_emb.weight"},
        "step": 3}))
    loaded = load_model(tmp_path)
    assert all(torch.equal(loaded.state_dict()[name], tensor) for name, tensor in model.state_dict().items())


# -- the transformer blocks ------------------------------------------------------------------------


def _compiled(model: nn.Module) -> list[nn.Module]:
    """The modules that `nn.Module.compile()` was called on (it compiles at the first forward)."""
    return [module for module in model.modules() if getattr(module, "_compiled_call_impl", None) is not None]


def _assert_everyone_uses(model: nn.Module, blocks: list[nn.Module], class_name: str) -> None:
    assert [id(block) for block in transformer_blocks(model)] == [id(block) for block in blocks]
    assert block_class_names(model) == default_shard_modules(model) == {class_name}
    compile_model(model)
    assert [id(module) for module in _compiled(model)] == [id(block) for block in blocks]


@pytest.mark.slow  # a trained run or a process launch (seconds): out of the fast tier
def test_the_gpt_blocks():
    model, _ = adapter_for(GPT_CFG).build(GPT_CFG, VOCAB, SEQ)
    _assert_everyone_uses(model, list(model.blocks), "Block")


def test_the_decoder_layers_of_a_transformers_llama():
    model = tiny_llama(num_layers=3)
    _assert_everyone_uses(model, list(model.model.layers), "LlamaDecoderLayer")


def test_the_blocks_of_a_transformers_gpt2():
    transformers = import_optional("transformers")
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=16,
                                                                 n_layer=2, n_head=2))
    _assert_everyone_uses(model, list(model.transformer.h), "GPT2Block")


def test_a_model_without_a_list_of_blocks_has_none_and_compiles_whole():
    model, _ = adapter_for(CONV_CFG).build(CONV_CFG, VOCAB, SEQ)
    assert transformer_blocks(model) == [] and default_shard_modules(model) == set()
    compile_model(model)
    assert _compiled(model) == [model]


class Expert(nn.Linear):
    pass


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList(Expert(4, 4) for _ in range(8))


class MixtureLM(nn.Module):
    """Two layers of eight experts each: the longest list of one class is a layer's experts."""

    _no_split_modules = ["Layer"]

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(2))


def test_declared_block_classes_win_over_a_longer_list():
    model = MixtureLM()
    assert transformer_blocks(model) == list(model.layers)
    model._no_split_modules = None  # without the declaration, the longest list is taken
    assert transformer_blocks(model) == list(model.layers[0].experts)
