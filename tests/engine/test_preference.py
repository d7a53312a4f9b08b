"""DPO's objective: per-sequence log-prob sums, TRL's sigmoid and ipo formulas, the chunked head's
same sums, and the step's exact mean over pairs whatever the layout (the mean of microbatch means
is not)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from ddptrain.config import DataConfig
from ddptrain.contract.pairs import PairTargets
from ddptrain.contract.targets import IGNORE_INDEX
from ddptrain.data import TrainBatches, load_splits
from ddptrain.engine.engine import Engine
from ddptrain.engine.preference import DPOObjective, PairHeadLoss, pair_losses, sequence_logps
from ddptrain.models import GPT, GPTConfig
from ddptrain.train.reference import Reference, frozen_copy
from tests.data.chats import save_chat_tokenizer, write_jsonl
from tests.data.pairs import random_pairs


def _pairs(seed: int = 0, rows: int = 4, width: int = 9, vocab: int = 11) -> tuple[torch.Tensor, PairTargets]:
    """Random logits and 2 pairs (4 sequences, one per row) with ragged valid spans."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, width, vocab, generator=generator, dtype=torch.float64)
    tokens = torch.randint(0, vocab, (rows, width), generator=generator)
    starts, ends = [2, 1, 4, 3], [9, 5, 6, 8]
    sequences = torch.full((rows, width), -1)
    for row in range(rows):
        tokens[row, : starts[row]] = IGNORE_INDEX
        tokens[row, ends[row]:] = IGNORE_INDEX
        sequences[row, starts[row] : ends[row]] = row
    return logits, PairTargets(tokens, sequences, rows)


def test_sequence_logps_are_the_sums_of_each_sequences_target_log_probs():
    logits, pairs = _pairs()
    got = sequence_logps(logits, pairs)
    log_probs = logits.log_softmax(-1)
    for s in range(pairs.count):
        where = pairs.sequences == s
        expected = log_probs[where].gather(-1, pairs.tokens[where].unsqueeze(-1)).sum()
        assert torch.allclose(got[s], expected, rtol=1e-12)


def test_sigmoid_and_ipo_are_trl_formulas():
    policy = torch.tensor([-3.0, -5.0, -7.5, -2.0], dtype=torch.float64)
    reference = torch.tensor([-3.5, -4.0, -7.0, -2.5], dtype=torch.float64)
    lengths = torch.tensor([3.0, 5.0, 2.0, 4.0], dtype=torch.float64)
    beta = 0.1
    chosen, rejected = policy[0::2] - reference[0::2], policy[1::2] - reference[1::2]
    losses, rewards_chosen, rewards_rejected = pair_losses(policy, reference, lengths, beta, "sigmoid")
    assert torch.allclose(losses, -F.logsigmoid(beta * (chosen - rejected)))
    assert torch.allclose(rewards_chosen, beta * chosen) and torch.allclose(rewards_rejected, beta * rejected)
    losses, _, _ = pair_losses(policy, reference, lengths, beta, "ipo")
    assert torch.allclose(losses, (chosen / lengths[0::2] - rejected / lengths[1::2] - 1 / (2 * beta)) ** 2)
    with pytest.raises(ValueError, match="loss_type 'hinge' is not one of sigmoid, ipo"):
        DPOObjective(loss_type="hinge")
    with pytest.raises(ValueError, match="beta 0 must be a finite number > 0"):
        DPOObjective(beta=0)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_the_chunked_head_gives_the_full_logits_sums_and_gradients(loss_type):
    torch.manual_seed(0)
    hidden = torch.randn(4, 9, 6, dtype=torch.float64, requires_grad=True)
    head = torch.nn.Linear(6, 11, bias=False).double()
    _, pairs = _pairs()
    pairs = pairs.with_reference(torch.randn(4, dtype=torch.float64))
    objective = DPOObjective(0.3, loss_type)
    full = objective.token_sum(head(hidden), pairs)
    full[0].backward()
    expected = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad, head.weight.grad = None, None
    chunked = PairHeadLoss(pairs, objective, chunk_tokens=4)(hidden, head)
    chunked[0].backward()
    assert torch.allclose(chunked, full, rtol=1e-12)
    assert torch.allclose(hidden.grad, expected[0], rtol=1e-10) and torch.allclose(head.weight.grad, expected[1])


# -- the step ----------------------------------------------------------------------------------------


def _data(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", random_pairs(48, seed=7))
    tokenizer = save_chat_tokenizer(tmp_path / "tok") / "tokenizer.json"
    cfg = DataConfig(name="preference", paths=[path], tokenizer=str(tokenizer), cache_dir=str(tmp_path / "cache"),
                     val_percent=0.0)
    return load_splits(cfg, 64)


def _engine(data, loss_type: str):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=data.vocab_size, n_layer=2, n_head=2, n_embd=32, max_seq_len=128))
    reference = frozen_copy(model)
    lr = 0.5 if loss_type == "sigmoid" else 0.005  # ipo squares its delta: a large rate diverges
    engine = Engine(model, torch.optim.SGD(model.parameters(), lr=lr), "ddp", precision="fp64",
                    objective=DPOObjective(0.1, loss_type))
    return engine, Reference(engine, model, reference)


LAYOUTS = {"1 x micro 8": dict(micro=8), "micro 3": dict(micro=3), "token budget": dict(micro_tokens=100),
           "packed": dict(pack=True, micro=1), "packed, budget": dict(pack=True, micro_tokens=128)}


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
@pytest.mark.slow  # a trained run or a process launch (seconds): out of the fast tier
def test_the_step_is_the_mean_over_pairs_for_every_layout_and_a_mean_of_means_is_not(tmp_path, loss_type):
    """One process; the two-rank layouts run under torchrun in tests/train/test_dpo.py."""
    data = _data(tmp_path)
    curves = {}
    for name, layout in LAYOUTS.items():
        engine, reference = _engine(data, loss_type)
        layout = dict(layout)
        batches = TrainBatches(data.train, 8, layout.pop("micro", 8), seed=1, rank=0, world_size=1, seq_len=64,
                               **layout)
        curves[name] = [(stats.loss, stats.metrics) for stats in
                        (engine.step(reference.fill(batches.microbatches(step))) for step in range(4))]
        if name == "token budget":
            budget_engine, budget_reference, budget_batches = engine, reference, batches
    expected = curves["1 x micro 8"]
    for name, curve in curves.items():
        for (loss, metrics), (loss_1x8, metrics_1x8) in zip(curve, expected):
            assert math.isclose(loss, loss_1x8, rel_tol=1e-9), (name, loss, loss_1x8)
            for key, value in metrics.items():
                assert math.isclose(value, metrics_1x8[key], rel_tol=1e-9, abs_tol=1e-12), (name, key)
    assert expected[0][0] != expected[3][0], "it trained"

    # Step 5 under the token budget: microbatches of different pair counts.
    microbatches = budget_reference.fill(budget_batches.microbatches(4))
    sums, counts = [], []
    with torch.no_grad():
        for inputs, pairs in microbatches:
            pairs = pairs.to(budget_engine.device)
            sums.append(float(budget_engine.objective.token_sum(budget_engine.forward(inputs), pairs)[0]))
            counts.append(pairs.pairs)
    exact = sum(sums) / sum(counts)
    naive = sum(s / c for s, c in zip(sums, counts)) / len(sums)
    assert math.isclose(budget_engine.step(microbatches).loss, exact, rel_tol=1e-9)
    print(f"\n{loss_type}: step 5 of 8 pairs in {len(counts)} microbatches of {counts} pairs: exact mean over "
          f"pairs {exact:.6f}, mean of microbatch means {naive:.6f}, {100 * (naive - exact) / exact:+.2f}%")
    assert len(set(counts)) > 1 and abs(naive - exact) > 1e-6 * abs(exact)
