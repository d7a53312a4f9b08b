"""The chunked head as the Engine's default: equal to the full-logits path (trainer.chunked_head=false)
to 1e-9 in fp64 on every strategy that runs fp64 (ddp, fsdp, HSDP; DeepSpeed's ZeRO takes fp32 at
most: 1e-6 there, the rounding of a different order of additions), with packed rows, label
smoothing and z-loss, a tied head and LoRA on the head, over several steps with ragged
microbatches and fillers."""

from __future__ import annotations

import pytest
import torch

import ddptrain
from ddptrain.engine.objective import Objective
from ddptrain.models import hf
from ddptrain.testing import run_distributed
from tests.engine.reference import case_microbatches
from tests.helpers import (MODEL_RUN, SEQ, VOCAB, import_deepspeed, import_optional, read_metrics, relative_difference,
                           requires, run_cli, tiny_gpt)

OBJECTIVE = Objective(label_smoothing=0.1, z_loss=1e-3)
ZERO = {"micro_batch_size": 3, "grad_accum_steps": 3}
STRATEGIES = {  # name -> (ranks, strategy, options, precision)
    "ddp": (2, "ddp", None, "fp64"),
    "zero1": (2, "zero1", ZERO, "fp32"),
    "zero2": (2, "zero2", ZERO, "fp32"),
    "zero3": (2, "zero3", ZERO, "fp32"),
    "fsdp": (2, "fsdp", None, "fp64"),
    "hsdp": (4, "fsdp", {"replicate": 2}, "fp64"),
}
TOLERANCE = {"fp64": 1e-9, "fp32": 1e-6}
SLOW = {"zero1", "zero2", "hsdp"}
CHUNK_TOKENS = 5  # several chunks per microbatch, and a last one shorter


def _packed(inputs: torch.Tensor, targets: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """The rows as packed rows of two documents each (positions restart, segments 0 then 1)."""
    rows, width = inputs.shape
    cut = width // 3
    positions = torch.cat([torch.arange(cut), torch.arange(width - cut)]).expand(rows, width)
    segments = (torch.arange(width) >= cut).long().expand(rows, width)
    return {"idx": inputs, "positions": positions.contiguous(), "segments": segments.contiguous()}, targets


def _steps(rank: int, packed: bool) -> list[list]:
    steps = [case_microbatches("ragged_with_empty_microbatch", rank),
             case_microbatches("rank_without_valid_targets", rank % 2), case_microbatches(
                 "ragged_with_empty_microbatch", 1 - rank % 2)]
    return [[_packed(*mb) for mb in step] if packed else step for step in steps]


def _both_paths(strategy: str, options: dict | None, packed: bool, precision: str = "fp64"):
    """{chunked: (losses of 3 steps, the weights after them)} for chunked_head True and False."""
    results = {}
    for chunked in (True, False):
        model = tiny_gpt(torch.float64 if precision == "fp64" else torch.float32)
        engine = ddptrain.Engine(model, torch.optim.SGD(model.parameters(), lr=0.5), strategy, precision=precision,
                                 strategy_options=options, objective=OBJECTIVE, chunked_head=chunked,
                                 head_chunk_tokens=CHUNK_TOKENS)
        assert engine.chunked_head is chunked
        losses = [engine.step(step).loss for step in _steps(ddptrain.get_rank() % 2, packed)]
        results[chunked] = (losses, engine.model_state_dict())
    return results


def _assert_equal_paths(results, tolerance: float = 1e-9) -> None:
    for per_rank in results:
        (chunked_losses, chunked_weights), (full_losses, full_weights) = per_rank[True], per_rank[False]
        for chunked, full in zip(chunked_losses, full_losses):
            assert abs(chunked - full) <= tolerance * abs(full), (chunked_losses, full_losses)
        assert relative_difference(chunked_weights, full_weights) <= tolerance


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.slow) if name in SLOW else name
                                  for name in STRATEGIES])
@pytest.mark.slow  # every case over 4 s (ranks): out of the fast tier
def test_chunked_head_equals_full_logits_in_fp64_on_every_strategy(name):
    ranks, strategy, options, precision = STRATEGIES[name]
    if strategy.startswith("zero"):
        import_deepspeed()
    _assert_equal_paths(run_distributed(_both_paths, ranks, strategy, options, False, precision), TOLERANCE[precision])


@pytest.mark.parametrize("strategy", ["ddp", pytest.param("fsdp", marks=pytest.mark.slow)])
@pytest.mark.slow  # every case over 4 s (ranks): out of the fast tier
def test_chunked_head_equals_full_logits_on_packed_rows(strategy):
    _assert_equal_paths(run_distributed(_both_paths, 2, strategy, None, True))


def _lora_llama(chunked: bool):
    transformers, peft = import_optional("transformers"), import_optional("peft")
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(config).double()
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"],
                                                      init_lora_weights=False))
    assert hf.give_head_loss(model) and hf.head_loss_problem(model) is None
    engine = ddptrain.Engine(model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5),
                             "ddp", precision="fp64", chunked_head=chunked, head_chunk_tokens=CHUNK_TOKENS)
    assert engine.chunked_head is chunked
    losses = [engine.step(step).loss for step in _steps(ddptrain.get_rank(), False)]
    return losses, engine.model_state_dict(trainable_only=True)


def _lora_both():
    return {chunked: _lora_llama(chunked) for chunked in (True, False)}


@requires("peft")
@pytest.mark.slow  # over 4 s (a process launch or ranks): out of the fast tier
def test_chunked_head_with_lora_on_the_head_equals_full_logits():
    results = run_distributed(_lora_both, 2)
    _assert_equal_paths(results)
    assert any("lm_head.lora" in name for name in results[0][True][1]), "the head's adapter trains"


def test_a_model_without_the_protocol_keeps_the_full_logits():
    class LogitsOnly(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gpt = tiny_gpt(torch.float64)

        def forward(self, idx):
            return self.gpt(idx)

    model = LogitsOnly()
    engine = ddptrain.Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), "ddp", precision="fp64",
                             device=torch.device("cpu"))
    assert engine.chunked_head is False
    gpt = tiny_gpt()
    assert ddptrain.Engine(gpt, torch.optim.SGD(gpt.parameters(), lr=0.1), "ddp", precision="fp64",
                           device=torch.device("cpu")).chunked_head


@pytest.mark.parametrize("chunk_tokens", [0, -1, 2.5, True])
def test_head_chunk_tokens_must_be_a_positive_int(chunk_tokens):
    gpt = tiny_gpt()
    with pytest.raises(ValueError, match="chunk_tokens .* must be a positive int"):
        ddptrain.Engine(gpt, torch.optim.SGD(gpt.parameters(), lr=0.1), "ddp", device=torch.device("cpu"),
                        head_chunk_tokens=chunk_tokens)


def test_a_transformers_model_that_scales_its_logits_keeps_the_full_logits():
    """Gemma 2 soft-caps its logits after the head: the probe refuses the head-loss path."""
    transformers = import_optional("transformers")
    config = transformers.Gemma2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                       final_logit_softcapping=30.0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    from ddptrain.models.adapters import HFAdapter

    problem = HFAdapter().use_head_loss(model)
    assert problem is not None and "final_logit_softcapping=30.0" in problem
    assert ddptrain.Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), "ddp",
                           device=torch.device("cpu")).chunked_head is False


@pytest.mark.slow  # over 4 s (a process launch or ranks): out of the fast tier
def test_a_target_model_that_takes_head_loss_trains_the_same_through_the_chunked_head(tmp_path):
    """The README's protocol for `_target_` models, through the command line: the start-up line says
    which path runs, and the curve equals the full logits' (fp64)."""
    common = [*MODEL_RUN, "model=custom", "model._target_=tests.toy_models.make_head_loss_conv_lm",
              "trainer.precision=fp64", "trainer.max_steps=3", "trainer.log_every=1", "trainer.head_chunk_tokens=7"]
    curves, logs = {}, {}
    for chunked in (True, False):
        run_dir = tmp_path / str(chunked)
        result = run_cli([*common, f"trainer.chunked_head={str(chunked).lower()}", f"run.dir={run_dir}"])
        assert result.returncode == 0, result.stderr[-3000:]
        curves[chunked], logs[chunked] = [m["loss"] for m in read_metrics(run_dir)], result.stderr
    assert "loss: the output head and the objective on the valid targets only, 7 rows at a time" in logs[True]
    assert "loss: the output head" not in logs[False]
    assert curves[True] == pytest.approx(curves[False], rel=1e-9, abs=0)


@pytest.mark.slow  # over 4 s (a process launch or ranks): out of the fast tier
def test_a_target_model_whose_head_is_wider_than_its_logits_is_refused_naming_both_widths(tmp_path):
    """A head padded past the vocabulary trained another loss through the chunked head than through
    the logits, silently; it is a config error at start-up, and trains with trainer.chunked_head=false."""
    common = [*MODEL_RUN, "model=custom", "model._target_=tests.toy_models.make_padded_head_lm", "trainer.max_steps=1"]
    refused = run_cli([*common, f"run.dir={tmp_path / 'chunked'}"])
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert "config error: trainer.chunked_head=true, but PaddedHeadLM breaks the head-loss protocol: the head it " \
           "hands head_loss= gives 264 columns but its logits have 256" in refused.stderr, refused.stderr[-3000:]
    assert not (tmp_path / "chunked" / "checkpoints").exists()
    plain = run_cli([*common, "trainer.chunked_head=false", f"run.dir={tmp_path / 'plain'}"])
    assert plain.returncode == 0, plain.stderr[-3000:]
