"""The model contract at start-up: one forward pass on a real microbatch's first row must give logits
(B, T, V) with V the data's vocabulary, or `.logits` of that shape; a factory that raises is a model
error. Each is a ModelError (rc=2), never a raw traceback or a run that trains on the wrong columns."""

from __future__ import annotations

import logging

import pytest
import torch

from ddptrain.models.spec import ModelError
from ddptrain.train.builder import build_model
from ddptrain.verify import compose_config, main
from tests.helpers import VERIFY_RUN, VOCAB, import_optional

RESHAPED = ["model=custom", "model._target_=tests.toy_models.make_reshaped_lm"]


@pytest.mark.parametrize("how, expected", [
    ("v_minus_1", r"logits of shape \(1, 12, 31\) for inputs of shape \(1, 12\).*V >= 32"),
    ("t_minus_1", r"logits of shape \(1, 11, 32\) for inputs of shape \(1, 12\)"),
    ("transposed", r"logits of shape \(1, 32, 12\)"),
    ("tuple", r"returned tuple, not logits: the model contract"),
])
def test_a_model_outside_the_contract_is_a_model_error_at_start_up(how, expected):
    cfg = compose_config([*RESHAPED, f"+model.how={how}"])
    inputs = torch.randint(0, VOCAB, (2, 12))
    with pytest.raises(ModelError, match=expected):
        build_model(cfg, VOCAB, sample_inputs=inputs)
    good = compose_config(["model=custom", "model._target_=tests.toy_models.make_conv_lm"])
    build_model(good, VOCAB, sample_inputs=inputs)  # raw logits (B, T, V): the contract


def test_a_factory_that_raises_is_a_model_error_in_training_and_verify(capsys, monkeypatch):
    # verify's main sets up logging (the ddptrain logger stops propagating); undo it afterwards
    monkeypatch.setattr(logging.getLogger("ddptrain"), "propagate", True)
    cfg = compose_config(["model=custom", "model._target_=tests.toy_models.make_raising_lm"])
    with pytest.raises(ModelError, match=r"make_raising_lm raised ValueError: no model for a vocabulary of 32"):
        build_model(cfg, VOCAB)
    with pytest.raises(SystemExit) as exit_info:
        main(["--steps", "1", *VERIFY_RUN, "model=custom", "model._target_=tests.toy_models.make_raising_lm"])
    assert exit_info.value.code == 2, "verify's docs: 2 for a bad model, 1 only for DIFFERENT"
    assert "raised ValueError: no model for a vocabulary" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["--steps", "1", *VERIFY_RUN, *RESHAPED, "+model.how=v_minus_1"])
    assert exit_info.value.code == 2 and "the model contract" in capsys.readouterr().err


@pytest.mark.parametrize("factory, expected", [
    ("make_ignores_packing_lm", r"IgnoresPackingLM \(custom model\) does not keep attention inside each packed document"),
    ("make_fails_on_packed_rows_lm", r"FailsOnPackedRowsLM \(custom model\) fails on packed rows .*ValueError: too many "
                                     r"values to unpack.*use batch.pack=false"),
])
def test_packing_probes_every_model_kind_at_start_up(factory, expected):
    cfg = compose_config(["model=custom", f"model._target_=tests.toy_models.{factory}", "batch.pack=true"])
    with pytest.raises(ModelError, match=expected):
        build_model(cfg, VOCAB)
    build_model(compose_config(["batch.pack=true", "model.n_layer=1", "model.n_embd=32"]), VOCAB)  # the GPT honours it


def test_bloom_with_eager_attention_and_packing_is_a_model_error_naming_it(tmp_path):
    transformers = import_optional("transformers")
    from ddptrain.models import hf

    transformers.BloomConfig(vocab_size=256, hidden_size=32, n_layer=1, n_head=2).save_pretrained(tmp_path)
    model = hf.load_causal_lm(str(tmp_path), "eager", 256)
    with pytest.raises(ModelError, match=r"BloomForCausalLM with attn_implementation=eager fails on packed rows .*"
                                         r"use batch.pack=false"):
        hf.check_packing(model)
