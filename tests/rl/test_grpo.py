"""objective=grpo end to end: rollouts from the run's own generator, seeded per (seed, step, prompt,
sample), so the whole run (rollouts, rewards, advantages, updates) is the same on 1 and 2 ranks;
resume; bad input; reward functions that fail.

A tiny random Llama (fp64) with a chat template trained here (tests/data/chats.py): its completions
are random words, which `tests.rl.rewards:word_count` scores by their length, so groups differ.
"""

from __future__ import annotations

import math

import pytest

from tests.data.chats import write_jsonl
from tests.helpers import import_optional, read_metrics, run_cli
from tests.rl.models import prompt_records, save_chat_llama

torch = import_optional("torch")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo")
    model = save_chat_llama(root / "llama")
    prompts = write_jsonl(root / "prompts.jsonl", prompt_records(16))
    return root, model, prompts


def grpo_args(setup, run_dir, *extra) -> list[str]:
    _, model, prompts = setup
    return ["model=hf", f"model.path={model}", "data=prompts", "objective=grpo", f"data.paths=[{prompts}]",
            "reward.functions=[tests.rl.rewards:word_count,tests.rl.rewards:likes_the]", "reward.weights=[1.0,0.5]",
            "rl.group_size=4", "rl.max_new_tokens=6", "batch.global_size=4", "batch.micro_size=2", "batch.seq_len=64",
            "trainer.max_steps=3", "trainer.log_every=1", "trainer.precision=fp64", "optim.name=sgd", "optim.lr=0.5",
            "optim.warmup_steps=0", "trainer.grad_clip=null", "logger.progress=lines", f"run.dir={run_dir}", *extra]


CURVE_KEYS = ("loss", "grad_norm", "reward", "reward_std", "reward/tests.rl.rewards:word_count",
              "reward/tests.rl.rewards:likes_the", "completion_length", "completion_length_max", "truncated_fraction",
              "frac_reward_zero_std", "completion_tokens")


def _same_curve(got: list[dict], expected: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in expected]
    for one, two in zip(expected, got):
        for key in CURVE_KEYS:
            a, b = one[key], two[key]
            assert math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12), (one["step"], key, a, b)


@pytest.fixture(scope="module")
def one_rank(setup):
    """Three GRPO steps on one rank (ddp): the curve the other layouts are held to."""
    run_dir = setup[0] / "one_rank"
    result = run_cli(grpo_args(setup, run_dir))
    assert result.returncode == 0, result.stderr[-4000:]
    return read_metrics(run_dir)


@pytest.mark.slow
def test_the_run_is_the_same_on_one_and_two_ranks_rollouts_included(setup, one_rank, tmp_path):
    run_dir = tmp_path / "two_ranks"
    result = run_cli(grpo_args(setup, run_dir), nproc=2)
    assert result.returncode == 0, result.stderr[-4000:]
    assert [r["step"] for r in one_rank] == [1, 2, 3]
    _same_curve(read_metrics(run_dir), one_rank)
    first = one_rank[0]
    assert first["reward_std"] > 0 and first["completion_tokens"] > 0, first
    for key in ("generate_s", "score_s", "train_s", "rollout_tokens_per_second", "tokens_per_second", "kl",
                "clip_ratio", "nan_reward_steps"):
        assert key in first, key
    assert len({r["reward"] for r in one_rank}) > 1, "the policy and its rollouts change"


@pytest.mark.slow
def test_fsdp_generates_from_the_gathered_policy_and_gives_the_same_curve(setup, one_rank, tmp_path):
    run_dir = tmp_path / "fsdp"
    result = run_cli(grpo_args(setup, run_dir, "strategy=fsdp"), nproc=2)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "gathers its full weights into a generation copy" in result.stderr
    _same_curve(read_metrics(run_dir), one_rank)


@pytest.mark.slow
def test_a_resumed_run_generates_the_same_rollouts_on_another_world_size(setup, one_rank, tmp_path):
    resumed = tmp_path / "resumed"
    first = run_cli(grpo_args(setup, resumed, "optim.decay_steps=3", "trainer.max_steps=2"))
    assert first.returncode == 0, first.stderr[-4000:]
    second = run_cli(grpo_args(setup, resumed, "optim.decay_steps=3"), nproc=2)
    assert second.returncode == 0, second.stderr[-4000:]
    assert "resumed from" in second.stderr
    _same_curve(read_metrics(resumed), one_rank)


def _fails(result, message: str) -> None:
    assert result.returncode == 2, result.stderr[-3000:]
    assert message in result.stderr, result.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("extra, message", [
    (["reward.functions=[no_such_module_xyz:f]", "reward.weights=null"],
     "config error: reward.functions: 'no_such_module_xyz:f': module 'no_such_module_xyz' does not import"),
    (["rl.group_size=1"], "config error: rl.group_size=1 must be >= 2"),
    (["data=sft"], "config error: objective=grpo with data=sft"),
    (["reward.weights=[1.0]"], "config error: reward.weights=[1.0] has 1 weight(s) for 2 reward.functions"),
    (["trainer.eval_every=1"], "config error: trainer.eval_every=1: objective=grpo has no validation split"),
])
def test_bad_config_is_refused_before_anything_is_written(setup, tmp_path, extra, message):
    run_dir = tmp_path / "run"
    _fails(run_cli(grpo_args(setup, run_dir, *extra)), message)
    assert not run_dir.exists()


@pytest.mark.slow
def test_prompts_without_grpo_and_a_prompt_too_long_are_refused(setup, tmp_path):
    root, model, prompts = setup
    _fails(run_cli(["model=hf", f"model.path={model}", "data=prompts", f"data.paths=[{prompts}]",
                    f"run.dir={tmp_path / 'a'}"]), "config error: objective=token with data=prompts")
    run_dir = tmp_path / "b"
    _fails(run_cli(grpo_args(setup, run_dir, "rl.max_new_tokens=60")),
           f"data error: {prompts}:1: the prompt is")
    assert not (run_dir / "config.yaml").exists() and not (run_dir / "checkpoints").exists()


@pytest.mark.slow
def test_a_reward_function_that_raises_stops_the_run_naming_it_and_saves_nothing(setup, tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli(grpo_args(setup, run_dir, "reward.functions=[tests.rl.rewards:raises]", "reward.weights=null"),
                     nproc=2)
    assert result.returncode != 0  # each rank exits 2; torchrun reports 1
    for rank in (0, 1):  # named on every rank, each for its own prompts
        assert (f"rank{rank} error] reward error: reward function tests.rl.rewards:raises raised ValueError: no score "
                "for you (scoring 8 completions, the first of prompt") in result.stderr, result.stderr[-3000:]
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "final").exists()
    assert not (run_dir / "metrics.jsonl").exists() or not read_metrics(run_dir)


@pytest.mark.slow
def test_a_nan_reward_skips_the_step_on_every_rank_and_counts_it(setup, tmp_path):
    root, model, _ = setup
    prompts = write_jsonl(tmp_path / "four.jsonl", prompt_records(4))  # every step holds prompt 0
    run_dir = tmp_path / "run"
    args = grpo_args(setup, run_dir, "reward.functions=[tests.rl.rewards:nan_on_first_step]", "reward.weights=null",
                     f"data.paths=[{prompts}]", "trainer.max_steps=2")
    result = run_cli(args, nproc=2)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "step 1 skipped: a reward function returned NaN" in result.stderr
    rows = read_metrics(run_dir)
    assert [r["nan_reward_steps"] for r in rows] == [1, 2] and all(r["reward"] is None for r in rows)  # NaN: null
    safetensors = import_optional("safetensors.torch", "safetensors")
    initial = safetensors.load_file(str(model / "model.safetensors"))
    final = safetensors.load_file(str(run_dir / "final" / "model.safetensors"))
    assert all(torch.equal(initial[k].double(), final[k].double()) for k in initial), "no update was applied"
