"""The Slurm templates in launch/, submitted to a real Slurm cluster.

A session fixture starts the two-node local cluster of launch/local_cluster.sh (Debian's slurmctld,
two `slurmd -N nodeN` daemons, munge; as root it installs them with apt-get when missing, appends
node1 and node2 to /etc/hosts and links /etc/slurm/slurm.conf). The tests are skipped only when
Slurm cannot be installed or started for lack of root; any other cluster failure is a test failure.

Training jobs are awaited by polling `scontrol show job` every half second rather than with
`sbatch --wait`: sbatch polls after 2, 10 and then 42 seconds, which would triple the time of these
~15 s jobs. The fast-failing bad-override jobs do use `sbatch --wait`, the command users run.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, TINY_RUN, read_metrics

LAUNCH = REPO / "launch"
CLUSTER_SCRIPT = LAUNCH / "local_cluster.sh"
SLURM_DIR = Path(os.environ.get("DDPTRAIN_SLURM_DIR", "/tmp/ddptrain-slurm"))
SLURM_CONF = SLURM_DIR / "etc" / "slurm.conf"

MAX_STEPS = 5
SLURM_RUN = [*TINY_RUN, f"trainer.max_steps={MAX_STEPS}", "batch.global_size=4", "batch.micro_size=1",
             "batch.seq_len=16", "trainer.precision=fp32"]
METRIC_KEYS = {"step", "loss", "tokens", "lr", "grad_norm", "tokens_per_second"}
TERMINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                   "BOOT_FAIL", "DEADLINE", "PREEMPTED"}

pytestmark = [pytest.mark.slow, pytest.mark.system]


def _slurm_installed() -> bool:
    return all(shutil.which(tool) for tool in ("slurmctld", "slurmd", "sbatch", "munged"))


@pytest.fixture(scope="session")
def slurm_env() -> dict[str, str]:
    """Start (or reuse) the local cluster; the environment that submits jobs to it."""
    if os.geteuid() != 0 and not _slurm_installed():
        pytest.skip("Slurm is not installed and installing it (apt-get) needs root")
    was_running = SLURM_CONF.exists() and subprocess.run(
        ["bash", str(CLUSTER_SCRIPT), "status"], capture_output=True, timeout=30).returncode == 0
    started = subprocess.run(["bash", str(CLUSTER_SCRIPT), "start"], capture_output=True, text=True,
                             timeout=600)
    if started.returncode != 0:
        output = (started.stdout + started.stderr)[-3000:]
        if not _slurm_installed():
            pytest.skip(f"Slurm could not be installed (apt-get failed?):\n{output}")
        if os.geteuid() != 0:
            pytest.skip(f"starting the local Slurm cluster needs root:\n{output}")
        pytest.fail(f"launch/local_cluster.sh start failed:\n{output}")
    # A clean environment: no SLURM_* of an outer allocation (pytest run inside a job) leaks in.
    env = {key: value for key, value in os.environ.items() if not key.startswith("SLURM_")}
    env.update(SLURM_CONF=str(SLURM_CONF), DDPTRAIN_PYTHON=sys.executable, PYTHONUNBUFFERED="1")
    yield env
    if not was_running:
        subprocess.run(["bash", str(CLUSTER_SCRIPT), "stop"], capture_output=True, timeout=60)


def _job_name() -> str:
    return f"ddptrain-test-{uuid.uuid4().hex[:8]}"


def _sbatch_args(template: str, name: str, out_dir: Path) -> list[str]:
    return ["sbatch", f"--job-name={name}", f"--output={out_dir}/%x-%j.out", str(LAUNCH / template)]


def _job_fields(job_id: str, env: dict[str, str]) -> dict[str, str]:
    shown = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True,
                           env=env, timeout=30)
    return dict(re.findall(r"(\w+)=(\S*)", shown.stdout))


def wait_for_job(job_id: str, env: dict[str, str], timeout: float) -> dict[str, str]:
    """Poll until the job ends (a requeued job pends and runs again first); its scontrol fields."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        fields = _job_fields(job_id, env)
        if fields.get("JobState") in TERMINAL_STATES:
            return fields
        time.sleep(0.5)
    subprocess.run(["scancel", job_id], env=env, timeout=30)
    pytest.fail(f"job {job_id} still {fields.get('JobState')} after {timeout:.0f}s; cancelled")


def submit(template: str, overrides: list[str], out_dir: Path, env: dict[str, str],
           extra_env: dict[str, str] | None = None) -> str:
    """sbatch the template from the repository root (the submit dir); the job id."""
    job_env = {**env, "DDPTRAIN_LOG_DIR": str(out_dir / "logs"), **(extra_env or {})}
    submitted = subprocess.run(
        ["sbatch", "--parsable"] + _sbatch_args(template, _job_name(), out_dir)[1:] + overrides,
        capture_output=True, text=True, cwd=REPO, env=job_env, timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    return submitted.stdout.strip().split(";")[0]


def job_output(out_dir: Path) -> str:
    """The batch log and every per-node log of the jobs written under out_dir."""
    logs = sorted(out_dir.glob("*.out")) + sorted((out_dir / "logs").glob("*.log"))
    return "\n".join(f"==> {log.name} <==\n{log.read_text(errors='replace')}" for log in logs)


def test_cluster_runs_a_job_on_both_nodes(slurm_env, tmp_path):
    """The cluster itself: one task on each of the two nodes."""
    ran = subprocess.run(["srun", "--nodes=2", "--ntasks-per-node=1", "printenv", "SLURMD_NODENAME"],
                         capture_output=True, text=True, env=slurm_env, timeout=60)
    assert ran.returncode == 0, ran.stderr
    assert sorted(ran.stdout.split()) == ["node1", "node2"]


def test_local_cluster_refuses_a_controller_that_is_not_its_own(slurm_env, tmp_path):
    """Another cluster's controller on the same port (here: this script's own, run with another
    DDPTRAIN_SLURM_DIR) must be refused before /etc is touched, not silently used."""
    linked = os.path.realpath("/etc/slurm/slurm.conf")
    other = tmp_path / "other-slurm"
    started = subprocess.run(["bash", str(CLUSTER_SCRIPT), "start"], capture_output=True, text=True, timeout=120,
                             env={**slurm_env, "DDPTRAIN_SLURM_DIR": str(other)})
    assert started.returncode != 0, started.stderr
    port = os.environ.get("DDPTRAIN_SLURM_CTLD_PORT", "6817")
    assert (f"a Slurm controller that is not this cluster's answers on port {port} (cluster ddptrain, config "
            f"{SLURM_CONF}; ours: cluster ddptrain, config {other}/etc/slurm.conf)") in started.stderr, started.stderr
    assert os.path.realpath("/etc/slurm/slurm.conf") == linked
    assert not list((other / "run").glob("*.pid")), "no daemon of the refused cluster may start"


@pytest.mark.parametrize(
    ("template", "nproc_per_node", "nodes"),
    [("single_node.sbatch", "2", 1), ("multi_node.sbatch", "1", 2)],
    ids=["single-node-2-ranks", "two-nodes-1-rank-each"],
)
def test_template_trains_to_max_steps(slurm_env, tmp_path, template, nproc_per_node, nodes):
    run_dir = tmp_path / "run"
    # Two nodes train with HSDP: replicate=auto is the number of nodes, so a 2 x 1 mesh
    hsdp = ["strategy=fsdp", "strategy.replicate=auto"] if nodes > 1 else []
    job_id = submit(template, [f"run.dir={run_dir}"] + SLURM_RUN + hsdp, tmp_path, slurm_env,
                    {"DDPTRAIN_NPROC_PER_NODE": nproc_per_node})
    fields = wait_for_job(job_id, slurm_env, timeout=120)
    output = job_output(tmp_path)
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", output
    assert fields["NumNodes"] == str(nodes), fields

    metrics = read_metrics(run_dir)
    assert [record["step"] for record in metrics] == list(range(1, MAX_STEPS + 1)), output
    for record in metrics:
        assert METRIC_KEYS <= record.keys(), record
    if nodes > 1:
        assert "(node1 node2)" in output, output
        node_logs = sorted(p.name for p in (tmp_path / "logs").glob(f"*-{job_id}.node*.log"))
        assert node_logs == [f"{fields['JobName']}-{job_id}.node{i}.log" for i in range(nodes)]
        # rank 0 logs; c10d's rendezvous puts it on whichever node's agent joined first
        logs = [(tmp_path / "logs" / name).read_text() for name in node_logs]
        assert sum("HSDP mesh of 2 replicas x 1 shards" in log for log in logs) == 1, "\n----\n".join(logs)[-3000:]


@pytest.mark.parametrize(
    ("template", "use_sbatch_wait"),
    [("single_node.sbatch", True), ("multi_node.sbatch", False)],
    ids=["single-node-sbatch-wait", "two-nodes"],
)
def test_bad_override_fails_fast_with_hydra_message(slurm_env, tmp_path, template, use_sbatch_wait):
    """A typo in an override ends the job quickly with a non-zero exit; its log says why. The
    single-node job is awaited with `sbatch --wait`, the command users run (it fails in under
    10 s, sbatch's second poll); the two-node one is polled (it may take a little longer). A job
    that hangs instead is caught by the limits of the wait (300 s), not by timing the failure."""
    overrides = [f"run.dir={tmp_path / 'run'}", "trainer.max_stepz=3"]
    if use_sbatch_wait:
        name = _job_name()
        try:
            submitted = subprocess.run(
                ["sbatch", "--wait"] + _sbatch_args(template, name, tmp_path)[1:] + overrides,
                capture_output=True, text=True, cwd=REPO, timeout=300,
                env={**slurm_env, "DDPTRAIN_LOG_DIR": str(tmp_path / "logs")})
        except subprocess.TimeoutExpired:
            subprocess.run(["scancel", f"--name={name}"], env=slurm_env, timeout=30)
            pytest.fail(f"a bad override hung the job for 300s:\n{job_output(tmp_path)}")
        failed = submitted.returncode != 0
    else:
        fields = wait_for_job(submit(template, overrides, tmp_path, slurm_env), slurm_env, timeout=300)
        failed = fields["JobState"] == "FAILED" and fields["ExitCode"] != "0:0"
    output = job_output(tmp_path)
    assert failed, output
    # Hydra's own words, in the batch log (the two-node template copies the node logs there).
    batch_log = "\n".join(p.read_text(errors="replace") for p in tmp_path.glob("*.out"))
    assert "Could not override 'trainer.max_stepz'" in batch_log, output


PREEMPT_STEPS = 400  # long enough to signal mid-run, short enough to finish in seconds


def final_model_state(run_dir: Path) -> tuple[int, dict]:
    """(step, model weights) of the newest complete checkpoint in run_dir."""
    from ddptrain.runs.store import find_latest, load_trainer_state, read_weights

    latest = find_latest(run_dir)
    assert latest is not None, f"no complete checkpoint in {run_dir}"
    state = load_trainer_state(latest)
    return state["step"], read_weights(latest)


# checkpoint.every = max_steps: the only regular checkpoint is the final one, to compare.
PREEMPT_RUN = [o for o in SLURM_RUN if not o.startswith("trainer.max_steps=")] + [
    f"trainer.max_steps={PREEMPT_STEPS}", f"checkpoint.every={PREEMPT_STEPS}"]


@pytest.fixture(scope="module")
def preempt_reference(slurm_env, tmp_path_factory) -> Path:
    """Both templates' reference, run once: the same world size (2 ranks: one node of 2, or two
    nodes of 1) and overrides, without Slurm and without interruption."""
    reference_dir = tmp_path_factory.mktemp("preempt") / "reference"
    reference = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         "-m", "ddptrain", f"run.dir={reference_dir}"] + PREEMPT_RUN,
        capture_output=True, text=True, cwd=REPO, timeout=180, env=slurm_env)
    assert reference.returncode == 0, reference.stdout[-3000:] + reference.stderr[-3000:]
    return reference_dir


@pytest.mark.parametrize(
    ("template", "nproc_per_node"),
    [("single_node.sbatch", "2"), ("multi_node.sbatch", "1")],
    ids=["single-node", "two-nodes"],
)
def test_preempted_job_checkpoints_requeues_and_matches_uninterrupted_run(
        slurm_env, preempt_reference, tmp_path, template, nproc_per_node):
    """scancel --signal=USR1 --batch mid-run: the batch script forwards USR1 to the ranks, they
    checkpoint and exit, the job requeues itself, resumes from the checkpoint, and ends with the
    parameters of an uninterrupted run."""
    overrides = PREEMPT_RUN
    reference_dir = preempt_reference

    run_dir = tmp_path / "run"
    job_id = submit(template, [f"run.dir={run_dir}"] + overrides, tmp_path, slurm_env,
                    {"DDPTRAIN_NPROC_PER_NODE": nproc_per_node, "DDPTRAIN_PREEMPT_GRACE": "60"})
    metrics_path = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 600  # a hang guard: the job logs 10 steps in well under a minute
    while not (metrics_path.exists() and len(metrics_path.read_text().splitlines()) >= 10):
        assert time.monotonic() < deadline, f"no progress:\n{job_output(tmp_path)}"
        state = _job_fields(job_id, slurm_env).get("JobState")
        assert state in {"PENDING", "RUNNING"}, f"job {state} before the signal:\n{job_output(tmp_path)}"
        time.sleep(0.2)
    signalled = subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], env=slurm_env,
                               capture_output=True, text=True, timeout=30)
    assert signalled.returncode == 0, signalled.stderr

    fields = wait_for_job(job_id, slurm_env, timeout=240)
    output = job_output(tmp_path)
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", output
    assert fields["Restarts"] == "1", f"expected one requeue, got {fields['Restarts']}:\n{output}"
    assert "requeueing job" in output, output
    resumed_from = re.search(r"resumed from \S+ at step (\d+)", output)
    assert resumed_from and 0 < int(resumed_from.group(1)) < PREEMPT_STEPS, output

    # Steps between the checkpoint and the signal may be logged twice; the later record wins.
    resumed = {record["step"]: record for record in read_metrics(run_dir)}
    expected = {record["step"]: record for record in read_metrics(reference_dir)}
    assert sorted(resumed) == sorted(expected) == list(range(1, PREEMPT_STEPS + 1))
    for step, record in expected.items():
        assert resumed[step]["loss"] == record["loss"], (step, resumed[step], record)

    # The same final parameters, bit for bit: a resumed run replays the same arithmetic.
    final_step, final_weights = final_model_state(run_dir)
    reference_step, reference_weights = final_model_state(reference_dir)
    assert final_step == reference_step == PREEMPT_STEPS
    assert final_weights.keys() == reference_weights.keys()
    different = [name for name in reference_weights
                 if not torch.equal(final_weights[name], reference_weights[name])]
    assert not different, f"parameters differ from the uninterrupted run: {different}"


def test_two_nodes_share_the_preprocessing_and_build_a_one_process_entry(slurm_env, tmp_path):
    """Two nodes of 2 ranks on a cache directory both see: the 4 ranks tokenize a shard each (the
    JSONL corpus cut at line starts), rank 0 merges, and the entry is the one-process build's, byte
    for byte (ddptrain/data/shards.py)."""
    from ddptrain.data import load_splits
    from tests.data.test_sharded_build import _config, _corpus, _entry_digests

    paths = _corpus(tmp_path / "corpus")
    cache, run_dir = tmp_path / "cache", tmp_path / "run"
    data = ["data=jsonl", f"data.paths=[{','.join(str(p) for p in paths)}]", "data.field=text",
            f"data.cache_dir={cache}", "data.max_docs=null", "data.val_percent=10.0"]
    job_id = submit("multi_node.sbatch", [f"run.dir={run_dir}"] + SLURM_RUN + data, tmp_path, slurm_env,
                    {"DDPTRAIN_NPROC_PER_NODE": "2"})
    fields = wait_for_job(job_id, slurm_env, timeout=180)
    output = job_output(tmp_path)
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", output
    assert [record["step"] for record in read_metrics(run_dir)] == list(range(1, MAX_STEPS + 1)), output
    for shard in range(4):
        assert re.search(rf"data: shard {shard} \(rank {shard}\): \d+ bytes \(2\d\.\d% of the corpus", output), output
    load_splits(_config(paths, tmp_path / "one"), 16, local_rank=0)
    assert _entry_digests(cache) == _entry_digests(tmp_path / "one")
