"""Against the peer: TRL GRPOTrainer's own loss and update on the SAME completions, each held to the
exact fp64 GRPO (tests/engine/grpo_reference.py), beside ddptrain's.

TRL generates nothing here: its generation step (`_generate`) is replaced by one that returns the
saved rollouts of each prompt, and its reward function returns their rewards, so its own code
computes the advantages (scale_rewards="group"), the log-probs (its fused head on left-padded
prompts), the loss of its loss_type and one SGD step with gradient accumulation 2
(steps_per_generation 2: dapo's normaliser is then the step's token count). Its loss types map to
ours: grpo -> sequence_mean, dr_grpo -> constant, dapo -> token_mean. TRL's rewards and advantages
are float32 whatever the model's dtype: its distance to the exact value is float32's, ours fp64's.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch

from ddptrain.engine.engine import Engine
from ddptrain.engine.grpo import GRPOSettings
from ddptrain.rl.batches import RolloutLayout
from ddptrain.rl.update import train_on_rollouts
from ddptrain.train.reference import Reference
from tests.engine.grpo_reference import exact_update, grpo_material, relative_update_difference, tiny_llama
from tests.helpers import import_optional

LOSS_TYPES = {"grpo": "sequence_mean", "dr_grpo": "constant", "dapo": "token_mean"}
SETTINGS = dict(beta=0.04, epsilon=0.2, epsilon_high=0.28, temperature=0.7)
LR = 0.5
TRL_TOLERANCE = 1e-5
"""TRL's rewards and advantages are float32 (rewards_per_func is a float32 tensor): relative errors
of ~1e-7 in each advantage, which the loss (~0.05 here) and the update carry."""


def _trl_update(material, loss_type: str, tmp_path) -> tuple[float, dict]:
    """TRL GRPOTrainer's loss of the rollouts and its weights after one SGD step on them."""
    datasets, trl = import_optional("datasets"), import_optional("trl")
    transformers = import_optional("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "tokenizer")
    group_size = len(material.rollouts) // material.prompts
    by_prompt = {f"prompt {i}": [r for r in material.rollouts if r.prompt_index == i] for i in range(material.prompts)}
    fed: list = []

    def generate(self, prompts):  # TRL's _generate, returning the saved completions of each prompt in turn
        fed.clear()
        taken = {prompt: 0 for prompt in by_prompt}
        for prompt in prompts:
            fed.append(by_prompt[prompt][taken[prompt]])
            taken[prompt] += 1
        completion_ids = [list(r.completion_ids) for r in fed]
        return ([list(r.prompt_ids) for r in fed], completion_ids, None, tokenizer.batch_decode(completion_ids),
                None, {}, None, [])

    def saved_reward(prompts, completions, **kwargs):
        return [r.reward for r in fed]

    args = trl.GRPOConfig(output_dir=str(tmp_path / f"trl-{loss_type}"), per_device_train_batch_size=len(by_prompt) *
                          group_size // 2, gradient_accumulation_steps=2, steps_per_generation=2,
                          num_generations=group_size, max_completion_length=material.max_new_tokens, max_steps=1,
                          learning_rate=LR, optim="sgd", lr_scheduler_type="constant", warmup_steps=0,
                          max_grad_norm=0.0, weight_decay=0.0, loss_type=loss_type, scale_rewards="group",
                          logging_steps=1, report_to=[], save_strategy="no", bf16=False, use_cpu=True, seed=0,
                          **SETTINGS)
    model = tiny_llama(material.vocab_size, plain=True)
    model.save_pretrained(tmp_path / "model")  # TRL builds its reference (beta > 0) from the policy's path
    model.config._name_or_path = str(tmp_path / "model")
    trainer = trl.GRPOTrainer(model=model, reward_funcs=saved_reward, args=args, processing_class=tokenizer,
                              train_dataset=datasets.Dataset.from_list([{"prompt": p} for p in by_prompt]))
    trainer._generate = types.MethodType(generate, trainer)
    losses = []
    compute_loss = trainer.compute_loss

    def recorded(*arguments, **keywords):
        loss = compute_loss(*arguments, **keywords)
        losses.append(float(loss.detach()))  # each microbatch's share: they add up to the step's loss
        return loss

    trainer.compute_loss = recorded
    trainer.train()
    assert len(losses) == 2, "one step of 2 accumulated microbatches"
    return sum(losses), {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("loss_type", list(LOSS_TYPES))
def test_trl_grpo_trainer_and_ddptrain_against_the_exact_grpo(tmp_path, loss_type):
    material = grpo_material(tmp_path)
    settings = GRPOSettings(LOSS_TYPES[loss_type], max_new_tokens=material.max_new_tokens, **SETTINGS)
    reference_model = tiny_llama(material.vocab_size)  # TRL's reference: the initial policy
    [exact], exact_weights = exact_update(tiny_llama(material.vocab_size), material.rollouts, settings,
                                          [material.rollouts], copy.deepcopy(reference_model), LR)

    model = tiny_llama(material.vocab_size)
    engine = Engine(model, torch.optim.SGD(model.parameters(), lr=LR), "ddp", precision="fp64",
                    device=torch.device("cpu"))
    [stats] = train_on_rollouts(engine, material.rollouts, settings, RolloutLayout(material.prompts, micro_size=2),
                                Reference(engine, model, reference_model))
    ours = abs(stats.loss - exact["loss"])
    ours_update = relative_update_difference(engine.model_state_dict(), exact_weights, material.initial)

    trl_loss, trl_weights = _trl_update(material, loss_type, tmp_path)
    theirs = abs(trl_loss - exact["loss"])
    theirs_update = relative_update_difference(trl_weights, exact_weights, material.initial)
    print(f"\nTRL loss_type={loss_type} (ddptrain {settings.loss_aggregation}): exact loss {exact['loss']:.12f}; "
          f"absolute distance of the loss: ddptrain {ours:.1e}, TRL {theirs:.1e}; relative distance of the update: "
          f"ddptrain {ours_update:.1e}, TRL {theirs_update:.1e}")
    # The loss's distance is absolute: sequence_mean's first loss is ~0 (each group's advantages sum to 0).
    assert ours <= 1e-12 and ours_update <= 1e-9
    assert theirs <= TRL_TOLERANCE and theirs_update <= TRL_TOLERANCE
