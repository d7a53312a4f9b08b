"""The tests' fork server (tests/zygote.py): a launch through it is the launch it stands for (its
argv, working directory, environment, import path, stdio, exit code and signals), forked from the
server, and a launch whose environment the server's imports would have read differently runs plainly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests import zygote

PROBE = """
import json, os, sys
print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "mark": os.environ.get("MARK"), "ppid": os.getppid(),
                  "hf": [os.environ.get(key) for key in ("HF_HUB_OFFLINE", "TOKENIZERS_PARALLELISM")],
                  "datasets_cache": os.environ.get("HF_DATASETS_CACHE"),
                  "torch_preloaded": "torch" in sys.modules, "path0": sys.path[0], "name": __name__,
                  "stdin": sys.stdin.read()}))
sys.stderr.write("to stderr\\n")
code = os.environ.get("EXIT")
if code == "signal":
    os.kill(os.getpid(), 15)
sys.exit(int(code or 0))
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("zygote")
    (folder / "zprobe.py").write_text(PROBE)
    path = str(folder / "server.sock")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen([sys.executable, zygote.__file__, "serve", path], env=env)
    deadline = time.monotonic() + 120
    while not os.path.exists(path):
        assert process.poll() is None and time.monotonic() < deadline, "the fork server did not come up"
        time.sleep(0.05)
    yield process, path, folder
    process.terminate()
    process.wait(timeout=30)


def _launch(server, *args: str, env: dict | None = None, stdin: str = "") -> subprocess.CompletedProcess:
    process, path, folder = server
    full_env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", zygote.ENV_VAR: path,
                "PYTHONPATH": str(folder), **(env or {})}
    return subprocess.run([sys.executable, "-S", zygote.__file__, "-m", "zprobe", *args], cwd=folder / "..",
                          env=full_env, input=stdin, capture_output=True, text=True, timeout=120)


def _report(result) -> dict:
    import json

    return json.loads(result.stdout)


def test_a_launch_through_the_server_is_forked_from_it_and_gets_its_own_argv_cwd_env_path_and_stdio(server):
    result = _launch(server, "a", "--b=c", env={"MARK": "one"}, stdin="hello")
    assert result.returncode == 0, result.stderr
    report = _report(result)
    assert report["torch_preloaded"]  # forked from the server, which imported torch
    assert report["ppid"] == os.getpid()  # the client's parent: this test, which launched it
    assert report["argv"] == ["a", "--b=c"] and report["name"] == "__main__"
    assert report["cwd"] == str(server[2].parent) == report["path0"]
    assert report["mark"] == "one" and report["stdin"] == "hello"
    assert result.stderr == "to stderr\n"


def test_the_exit_code_and_a_death_by_signal_come_back_to_the_client(server):
    assert _launch(server, env={"EXIT": "3"}).returncode == 3
    assert _launch(server, env={"EXIT": "signal"}).returncode == -signal.SIGTERM


@pytest.mark.parametrize("variable", ["TORCHDYNAMO_VERBOSE", "DS_ACCELERATOR"])  # torch's, DeepSpeed's (preloaded)
def test_a_launch_whose_environment_differs_where_imports_read_it_runs_plainly(server, variable):
    result = _launch(server, env={variable: "cpu"})
    assert result.returncode == 0, result.stderr
    report = _report(result)
    assert not report["torch_preloaded"] and report["ppid"] == os.getpid()


def test_hugging_face_variables_are_compared_but_datasets_own_are_the_launchs(server):
    """The server imports transformers (tests/zygote.py's PRELOAD), which reads HF_HUB_OFFLINE and the
    rest at import: a launch with other values runs plainly. It does not import `datasets`, the only
    reader of HF_DATASETS_* (the benchmarks give TRL's workers a cache of their own): that launch is
    forked, with its value."""
    assert os.environ["HF_HUB_OFFLINE"] == "1"  # the session's (tests/conftest.py), the server's too
    other = _report(_launch(server, env={"HF_HUB_OFFLINE": "0"}))
    assert not other["torch_preloaded"] and other["hf"][0] == "0"
    own = _report(_launch(server, env={"HF_DATASETS_CACHE": "/tmp/own-datasets"}))
    assert own["torch_preloaded"] and own["datasets_cache"] == "/tmp/own-datasets"
    assert _report(_launch(server))["hf"] == ["1", "false"]


def test_torchruns_workers_are_forked_too_with_what_the_servers_imports_set_in_their_environment(server):
    """torchrun, forked, passes its environment on to its workers, with what the server's imports set
    (DeepSpeed's sets PYTORCH_NVML_BASED_CUDA_CHECK): they match the server and are forked too."""
    process, path, folder = server
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", zygote.ENV_VAR: path,
           "PYTHONPATH": str(folder)}
    command = [sys.executable, "-S", zygote.__file__, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node=2", "--no-python", sys.executable, "-S", zygote.__file__, "-u", "-m", "zprobe"]
    result = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    import json

    reports = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(reports) == 2 and all(report["torch_preloaded"] for report in reports), reports


def test_a_signal_to_the_client_reaches_the_forked_process(server):
    process, path, folder = server
    (folder / "zsleep.py").write_text("import signal, sys, time\n"
                                      "signal.signal(signal.SIGUSR1, lambda *_: sys.exit(42))\n"
                                      "print('ready', flush=True)\ntime.sleep(60)\n")
    env = {**os.environ, zygote.ENV_VAR: path, "PYTHONPATH": str(folder), "CUDA_VISIBLE_DEVICES": "",
           "OMP_NUM_THREADS": "1"}
    client = subprocess.Popen([sys.executable, "-S", zygote.__file__, "-m", "zsleep"], env=env,
                              stdout=subprocess.PIPE, text=True)
    assert client.stdout.readline() == "ready\n"
    client.send_signal(signal.SIGUSR1)
    assert client.wait(timeout=30) == 42


def test_a_killed_client_takes_its_forked_process_with_it(server):
    """subprocess.run's timeout kills the client: the process it stands for must not outlive it."""
    process, path, folder = server
    (folder / "zpid.py").write_text("import os, time\nprint(os.getpid(), flush=True)\ntime.sleep(60)\n")
    env = {**os.environ, zygote.ENV_VAR: path, "PYTHONPATH": str(folder), "CUDA_VISIBLE_DEVICES": "",
           "OMP_NUM_THREADS": "1"}
    client = subprocess.Popen([sys.executable, "-S", zygote.__file__, "-m", "zpid"], env=env,
                              stdout=subprocess.PIPE, text=True)
    forked = int(client.stdout.readline())
    assert forked != client.pid
    client.kill()
    client.wait(timeout=30)
    deadline = time.monotonic() + 30
    while _alive(forked):
        assert time.monotonic() < deadline, f"process {forked} outlived its killed client"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_the_forked_process_sees_the_clients_parent_and_gets_sigterm_when_it_dies(server):
    """ddptrain names a launch after os.getppid() and leaves when its launcher dies: through the
    server, the launcher is the client's parent, and its death reaches the forked process."""
    process, path, folder = server
    (folder / "zorphan.py").write_text(
        "import os, signal, sys, time\n"
        "def leave(*_):\n"
        "    open(sys.argv[1] + '.tmp', 'w').write('sigterm')\n"
        "    os.replace(sys.argv[1] + '.tmp', sys.argv[1])  # whole when it appears\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, leave)\n"
        "print(os.getppid(), flush=True)\ntime.sleep(60)\n")
    marker = folder / "orphan.txt"
    env = {**os.environ, zygote.ENV_VAR: path, "PYTHONPATH": str(folder), "CUDA_VISIBLE_DEVICES": "",
           "OMP_NUM_THREADS": "1"}
    # a launcher (sh) that starts the client and is then killed, as torchrun is in a test of orphaned workers
    launcher = subprocess.Popen(["sh", "-c", f"{sys.executable} -S {zygote.__file__} -m zorphan {marker}; sleep 60"],
                                env=env, stdout=subprocess.PIPE, text=True)
    assert int(launcher.stdout.readline()) == launcher.pid
    launcher.kill()
    launcher.wait(timeout=30)
    deadline = time.monotonic() + 30
    while not marker.exists():
        assert time.monotonic() < deadline, "the forked process did not get SIGTERM when its launcher died"
        time.sleep(0.05)
    assert marker.read_text() == "sigterm"
