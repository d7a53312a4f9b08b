"""A step's rollouts: seeded per (run seed, step, prompt, sample), so the same on 1 and 2 ranks and
whatever else is generated beside them; rewards (TRL's signature, the built-ins, weights, the
errors that name the function and the prompt); group advantages under every rl.scale_rewards."""

from __future__ import annotations

import math

import pytest

from ddptrain.config.schema import ConfigError, DataConfig, RewardConfig
from ddptrain.data.prompts import PromptBatches, load_prompts
from ddptrain.rl.advantages import group_advantages
from ddptrain.rl.rewards import RewardError, Rewards, final_answer
from ddptrain.rl.rollouts import Sampling, generate_completions, rollout_seed
from ddptrain.testing import run_distributed
from tests.helpers import import_optional
from tests.rl.models import prompt_records, save_chat_llama
from tests.data.chats import write_jsonl

torch = import_optional("torch")
transformers = import_optional("transformers")

SAMPLING = Sampling(group_size=3, max_new_tokens=6, temperature=1.0, top_p=0.95, stop=())


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("rollouts")
    model_dir = save_chat_llama(root / "llama")
    prompts = write_jsonl(root / "prompts.jsonl", prompt_records(8))
    return model_dir, prompts


def _prompt_set(model_dir, prompts):
    cfg = DataConfig(name="prompts", paths=[prompts], tokenizer=str(model_dir / "tokenizer.json"))
    return load_prompts(cfg, 64, 6)


def _completions(model_dir, prompts, rank: int, world_size: int, step: int = 2):
    """(prompt_index, sample, token ids, truncated) of `rank`'s share of the step."""
    prompt_set = _prompt_set(model_dir, prompts)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).double()
    batches = PromptBatches(prompt_set, 4, seed=7, rank=rank, world_size=world_size)
    tokenizer = prompt_set.tokenizer
    done = generate_completions(model, tokenizer.tokenizer.backend_tokenizer, tokenizer.stop_ids(),
                                batches.microbatches(step), SAMPLING, run_seed=7, step=step)
    return [(c.prompt_index, c.sample, c.generated.token_ids, c.generated.truncated) for c in done]


def _rank_completions(model_dir, prompts):
    import torch.distributed as dist

    return _completions(model_dir, prompts, dist.get_rank(), dist.get_world_size())


@pytest.mark.slow
def test_a_steps_completions_are_the_same_on_one_and_two_ranks(setup):
    model_dir, prompts = setup
    alone = _completions(model_dir, prompts, 0, 1)
    ranks = run_distributed(_rank_completions, 2, model_dir, prompts)
    assert ranks[0] + ranks[1] == alone
    assert [(i, s) for i, s, _, _ in alone] == [(i, s) for i in range(4) for s in range(3)]  # whole groups, in order
    assert len({ids for _, _, ids, _ in alone}) > 1, "sampled, not all alike"


@pytest.mark.slow  # a trained run or a process launch (seconds): out of the fast tier
def test_a_completion_does_not_depend_on_its_batch_mates_or_the_step_it_is_not_in(setup):
    model_dir, prompts = setup
    prompt_set = _prompt_set(model_dir, prompts)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).double()
    tokenizer = prompt_set.tokenizer
    args = (model, tokenizer.tokenizer.backend_tokenizer, tokenizer.stop_ids())
    together = generate_completions(*args, [(0, prompt_set[0]), (1, prompt_set[1])], SAMPLING, 7, 0)
    alone = generate_completions(*args, [(1, prompt_set[1])], SAMPLING, 7, 0)
    assert [c.generated for c in together[3:]] == [c.generated for c in alone]
    other_step = generate_completions(*args, [(1, prompt_set[1])], SAMPLING, 7, 1)
    assert [c.generated for c in other_step] != [c.generated for c in alone]
    assert len({rollout_seed(7, t, p, s) for t in range(3) for p in range(4) for s in range(4)}) == 48


def test_prompts_are_rendered_with_the_generation_prompt_and_too_long_ones_are_refused(setup, tmp_path):
    from ddptrain.data.sources import DataError

    model_dir, prompts = setup
    prompt_set = _prompt_set(model_dir, prompts)
    text = prompt_set.tokenizer.tokenizer.decode(list(prompt_set[0].ids))
    assert text.startswith("<|im_start|>user\n") and text.endswith("<|im_start|>assistant\n")
    assert prompt_set[0].fields == {"answer": "0", "pid": 0, "kind": "keep"}
    long = write_jsonl(tmp_path / "long.jsonl", [{"prompt": "the " * 80}])
    cfg = DataConfig(name="prompts", paths=[long], tokenizer=str(model_dir / "tokenizer.json"))
    with pytest.raises(DataError, match=r"long.jsonl:1: the prompt is \d+ tokens, longer than batch.seq_len=64 - "
                                        r"rl.max_new_tokens=6 = 58"):
        load_prompts(cfg, 64, 6)


def test_a_saved_hugging_face_dataset_gives_the_same_prompts_as_its_jsonl(setup, tmp_path):
    datasets = import_optional("datasets")
    model_dir, prompts = setup
    records = [{"prompt": record["prompt"], "answer": record["answer"]} for record in prompt_records(8)]
    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "saved"))
    jsonl = write_jsonl(tmp_path / "same.jsonl", records)
    tokenizer = str(model_dir / "tokenizer.json")
    loaded = [load_prompts(DataConfig(name="prompts", paths=[path], tokenizer=tokenizer, cache_dir=str(tmp_path)), 64, 6)
              for path in (str(tmp_path / "saved"), jsonl)]
    assert [(p.ids, p.fields) for p in loaded[0].prompts] == [(p.ids, p.fields) for p in loaded[1].prompts]
    assert loaded[0][3].fields == {"answer": "3"}


# -- rewards -----------------------------------------------------------------------------------------


def test_final_answers_and_the_built_in_rewards():
    assert final_answer("so 3 + 4 = 7\n#### 7") == "7"
    assert final_answer(r"the answer is \boxed{12} not 13") == "12"
    assert final_answer("I think 1,000 then 42.") == "42"
    assert final_answer("no digits") is None
    rewards = Rewards(RewardConfig(functions=["exact_match", "format"], weights=[1.0, 0.25],
                                   format_pattern=r".*#### \d+"))
    completions = ["so #### 42", "it is 41", [{"role": "assistant", "content": r"\boxed{42.0}"}]]
    scores = rewards.score(["p"] * 3, completions, [{"answer": "42"}] * 3, ["a", "b", "c"])
    assert scores.per_function == {"exact_match": [1.0, 0.0, 1.0], "format": [1.0, 0.0, 0.0]}
    assert scores.total == [1.25, 0.0, 1.0]


def test_a_user_reward_gets_trls_arguments_and_none_counts_zero():
    rewards = Rewards(RewardConfig(functions=["tests.rl.rewards:likes_the"]))
    scores = rewards.score(["p", "q"], ["the the cat", "the"], [{"kind": "keep"}, {"kind": "skip"}], ["a", "b"])
    assert scores.total == [2.0, 0.0] and math.isnan(scores.per_function["tests.rl.rewards:likes_the"][1])


@pytest.mark.parametrize("name, message", [
    ("tests.rl.rewards:raises", r"reward function tests.rl.rewards:raises raised ValueError: no score for you "
                                r"\(scoring 2 completions, the first of prompt p.jsonl:1\)"),
    ("tests.rl.rewards:wrong_length", r"reward function tests.rl.rewards:wrong_length returned 1 values for 2 "
                                      r"completions \(of prompts p.jsonl:1 ...\)"),
])
def test_a_reward_function_that_fails_is_named_with_the_prompt(name, message):
    rewards = Rewards(RewardConfig(functions=[name]))
    with pytest.raises(RewardError, match=message):
        rewards.score(["x", "y"], ["a", "b"], [{}, {}], ["p.jsonl:1", "p.jsonl:2"])


@pytest.mark.parametrize("functions, message", [
    (["no_such_module_xyz:f"], r"'no_such_module_xyz:f': module 'no_such_module_xyz' does not import"),
    (["tests.rl.rewards:nothing_here"], r"module 'tests.rl.rewards' has no callable 'nothing_here'"),
])
def test_a_reward_path_that_does_not_import_is_a_config_error(functions, message):
    with pytest.raises(ConfigError, match=message):
        Rewards(RewardConfig(functions=functions))


# -- advantages --------------------------------------------------------------------------------------


def test_group_advantages_for_each_scaling():
    rewards = [1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0]  # two groups of 4; the second all equal
    t = torch.tensor(rewards, dtype=torch.float64).view(2, 4)
    centred = t - t.mean(1, keepdim=True)
    group, stats = group_advantages(rewards, 4, "group")
    assert torch.allclose(torch.tensor(group, dtype=torch.float64).view(2, 4), centred / (t.std(1, keepdim=True) + 1e-4))
    batch, _ = group_advantages(rewards, 4, "batch")
    assert torch.allclose(torch.tensor(batch, dtype=torch.float64).view(2, 4), centred / (t.std() + 1e-4))
    none, _ = group_advantages(rewards, 4, "none")
    assert torch.allclose(torch.tensor(none, dtype=torch.float64).view(2, 4), centred)
    assert stats["frac_reward_zero_std"] == 0.5 and math.isclose(stats["reward"], t.mean().item())
    assert math.isclose(stats["reward_std"], t.std().item())


def _rank_batch_advantages(rewards):
    import torch.distributed as dist

    share = len(rewards) // dist.get_world_size()
    mine = rewards[dist.get_rank() * share:(dist.get_rank() + 1) * share]
    return group_advantages(mine, 4, "batch")


@pytest.mark.slow
def test_batch_scaling_is_the_same_on_two_ranks():
    rewards = [1.0, 0.0, 0.0, 1.0, 2.0, 3.0, 2.0, 5.0]
    alone, stats = group_advantages(rewards, 4, "batch")
    ranks = run_distributed(_rank_batch_advantages, 2, rewards)
    assert ranks[0][0] + ranks[1][0] == pytest.approx(alone, rel=1e-12)
    assert ranks[0][1] == pytest.approx(stats, rel=1e-12)
