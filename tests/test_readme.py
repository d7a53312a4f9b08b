"""The README and docs/: the two commands CI runs, every command either tested or listed as not run,
links that resolve, and the "Your own model" example run as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, read_metrics

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

# Every command in a ```bash block of README.md or docs/*.md (comments stripped): the test that runs
# it (tests/FILE.py::TEST, with the sizes a test affords where the command trains for long), or why
# no test runs it ("not run: ...").
COMMANDS = {
    "pip install torch==2.13.0 && pip install -e . && python -m ddptrain":
        "not run: installs packages and trains 200 steps; tests/test_models.py::"
        "test_rerunning_with_more_steps_resumes_bit_exactly_and_keeps_the_metrics runs the default command, shorter",
    'pip install torch==2.13.0 && pip install -e ".[test,deepspeed]" && python -m pytest --durations=15':
        "tests/test_readme.py::test_ci_runs_exactly_the_readme_test_command (it is .ci/run's command)",
    "torchrun --standalone --nproc_per_node=2 -m ddptrain batch.global_size=32 batch.micro_size=4":
        "tests/test_cli.py::test_layouts_give_the_same_loss_curve",
    "python -m ddptrain data=text 'data.paths=[corpus/**/*.txt]' data.split_by=paragraph":
        "tests/test_sources.py::test_text_on_two_ranks_builds_once_then_reuses_the_cache",
    "python -m ddptrain data=jsonl 'data.paths=[shards/*.jsonl]' data.field=text data.tokenizer=tokenizer.json":
        "tests/test_sources.py::test_each_source_trains_through_the_cli",
    "python -m ddptrain data=tokens 'data.paths=[train.bin]' 'data.val_paths=[val.bin]' data.eod_token=50256 "
    "data.vocab_size=50304": "tests/test_sources.py::test_each_source_trains_through_the_cli",
    "python -m ddptrain data=hf 'data.paths=[my_saved_dataset]' data.field=text":
        "tests/test_sources.py::test_each_source_trains_through_the_cli",
    "python -m ddptrain model=custom model._target_=my_models.build +model.width=96 run.dir=runs/mine "
    "trainer.max_steps=20 optim.decay_steps=40": "tests/test_readme.py::test_own_model_example_runs_as_written",
    "python -m ddptrain model=custom model._target_=my_models.build +model.width=96 run.dir=runs/mine "
    "trainer.max_steps=40 optim.decay_steps=40": "tests/test_readme.py::test_own_model_example_runs_as_written",
    "python -c \"import ddptrain; print(ddptrain.load_model('runs/mine'))\"":
        "tests/test_readme.py::test_own_model_example_runs_as_written",
    "python -m ddptrain.export runs/default exported/":
        "tests/test_export.py::test_exported_run_matches_load_model_end_to_end",
    "python -m benchmarks.bench": "tests/test_benchmarks.py::test_engine_throughput_benchmark_runs_on_two_ranks",
    "torchrun --standalone --nproc_per_node=2 -m benchmarks.bench":
        "not run: the same benchmark under torchrun; tests/test_benchmarks.py runs it with spawned ranks",
    "python -m benchmarks.bench_data": "tests/test_benchmarks.py::test_padding_benchmark_compares_the_three_layouts",
    "python -m benchmarks.bench_data --seq-len 1024 --global-batch 16 --micro-size 4 --steps 100":
        "tests/test_benchmarks.py::test_padding_benchmark_compares_the_three_layouts",
    "python -m benchmarks.bench_memory": "tests/test_benchmarks.py::test_memory_benchmark_compares_ddp_and_zero1",
    "pip install 'ddptrain[plot]'": "not run: installs a package (the test extra includes matplotlib)",
    "python -m ddptrain.plot runs/a runs/b -o loss.png --labels A B":
        "tests/test_observability.py::test_plot_command_draws_one_line_per_run",
    "python docs/loss_layouts.py": "not run: trains four 60-step runs (minutes) to redraw docs/loss_layouts.png",
    "sbatch --gpus-per-node=8 launch/single_node.sbatch trainer.max_steps=1000 strategy=zero2":
        "not run: needs GPU nodes; tests/test_slurm.py submits the same template to CPU nodes",
    "sbatch --nodes=4 --gpus-per-node=8 launch/multi_node.sbatch trainer.max_steps=1000 strategy=zero2":
        "not run: needs 4 GPU nodes; tests/test_slurm.py submits the same template to 2 CPU nodes",
    "sudo bash launch/local_cluster.sh": "tests/test_slurm.py::test_cluster_runs_a_job_on_both_nodes",
    "DDPTRAIN_NPROC_PER_NODE=2 sbatch --wait launch/single_node.sbatch trainer.max_steps=50":
        "tests/test_slurm.py::test_template_trains_to_max_steps",
    "sbatch --wait launch/multi_node.sbatch trainer.max_steps=50":
        "tests/test_slurm.py::test_template_trains_to_max_steps",
    "sudo bash launch/local_cluster.sh stop": "tests/test_slurm.py::test_cluster_runs_a_job_on_both_nodes",
    "docker build -f docker/Dockerfile -t ddptrain .": "tests/test_docker.py::test_image_builds_and_trains",
    'docker run --rm --gpus all --ipc=host -v "$PWD/runs:/workspace/runs" ddptrain run.dir=runs/demo '
    "trainer.max_steps=1000 strategy=zero2":
        "not run: needs GPUs; tests/test_docker.py::test_image_builds_and_trains runs the image on 2 CPU ranks",
    "pip install 'ddptrain[deepspeed]'": "not run: installs a package (the README's test command does)",
    "torchrun --standalone --nproc_per_node=8 -m ddptrain strategy=zero2":
        "not run: 8 ranks; tests/test_zero.py::test_zero_loss_curve_matches_ddp runs zero1/2/3 on 2 ranks",
    "python -m ddptrain strategy=zero1": "tests/test_zero.py::test_zero2_one_rank_accumulation_4_equals_two_ranks_"
                                         "accumulation_2 (a world of one under DeepSpeed)",
    "torchrun --standalone --nproc_per_node=8 -m ddptrain strategy=zero3 "
    "++strategy.deepspeed.zero_optimization.reduce_bucket_size=50000000 "
    "++strategy.deepspeed.zero_optimization.offload_optimizer.device=cpu "
    "++strategy.deepspeed.zero_force_ds_cpu_optimizer=false":
        "not run: 8 ranks with CPU offload; tests/test_zero.py::test_deepspeed_config_is_derived_and_checked "
        "checks how strategy.deepspeed keys merge",
    "python ckpt/zero_to_fp32.py ckpt consolidated/ --tag zero":
        "tests/test_zero.py::test_zero_checkpoint_converts_to_the_model_state_dict (through the same function)",
    "pip install 'ddptrain[serve]'": "not run: installs packages (the test extra has what tests/test_serve.py needs)",
    "python -m ddptrain trainer.max_steps=2000 run.dir=runs/code":
        "not run: trains 2000 steps; tests/test_serve.py trains a short run to serve",
    "python -m ddptrain.serve runs/code --port 8000": "tests/test_serve.py::test_serve_cli_serves_a_run_directory",
    "curl -s localhost:8000/v1/completions -H 'content-type: application/json' "
    "-d '{\"prompt\": \"def main(\", \"max_tokens\": 64, \"temperature\": 0}'":
        "tests/test_serve.py::test_serve_cli_serves_a_run_directory (the same request, through httpx)",
    'python -m ddptrain.generate runs/code --prompt "def main(" --prompt "import os" --temperature 0 '
    "--max-tokens 80":
        "tests/test_serve.py::test_generate_cli_continues_prompts_like_load_model_and_refuses_what_does_not_fit",
    "python -m ddptrain.verify batch.micro_size=2": "tests/test_verify.py::test_cli_exit_codes_say_agree_differ_or_bad_config",
    "torchrun --standalone --nproc_per_node=2 -m ddptrain.verify batch.micro_size=2":
        "tests/test_verify.py::test_cli_under_torchrun_prints_one_report_that_agrees",
    "python -m ddptrain.verify batch.micro_tokens=4096 model=hf model.path=/models/llama-tiny":
        "not run: needs a local model directory; tests/test_verify.py verifies token budgets on the built-in GPT",
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
        test_file, _, rest = where.partition("::")
        name = rest.split()[0]
        assert (REPO / test_file).is_file() and f"def {name}(" in (REPO / test_file).read_text(), \
            f"{command!r}: {where} is not a test"


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
