"""A fork server for the tests' command-line launches: `python -m MODULE ARGS` without importing
torch afresh.

A short test run is mostly process start-up: `python -m ddptrain` spends about 4 s importing torch,
torch._dynamo, FSDP and DCP before its first step (and model=hf 3 s more on transformers, and 2.4 s on
DeepSpeed at its final save), and a 2-rank torchrun run pays that three times (the launcher and both
workers). The server imports those modules once; each launch forks from it.

The launch is still real: `run_cli` starts `python -S tests/zygote.py -m ddptrain ARGS` (a client
that imports nothing beyond the standard library), and under torchrun the workers are real torchrun
workers (`torchrun --no-python python -S tests/zygote.py -m ddptrain ARGS`), each its own process with
its own environment, working directory, argv, stdin, stdout and stderr (the client's, passed over
the socket), exit status and signals (the client forwards them). `os.getppid()` in the forked
process gives the client's parent (the launcher, which ddptrain names its launch after), and the
launcher's death reaches it as SIGTERM through the client (what ddptrain's PR_SET_PDEATHSIG asks of
the kernel for a worker that torchrun started itself). What a forked process shares with the server
is only what importing those modules did, which `python -m` would have done the same.

A launch whose environment would have changed what those imports did (PYTHON*, TORCHDYNAMO*,
TORCHINDUCTOR*, CUDA_* and the thread-count variables other than OMP_NUM_THREADS, which the
child applies; HF_*, TRANSFORMERS*, TOKENIZERS*, DS_* and ACCELERATE* where transformers or DeepSpeed
is preloaded) becomes a plain `python -m` instead (the client execs it), as does every launch when
no server is up. HF_DATASETS_* are the launch's own: the server does not import `datasets`.

    python tests/zygote.py serve SOCKET     the server (tests/conftest.py starts one per test process)
    python -S tests/zygote.py -m MODULE ... a launch through the server named by DDPTRAIN_TEST_ZYGOTE
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import struct
import sys

ENV_VAR = "DDPTRAIN_TEST_ZYGOTE"
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "torch.distributed.fsdp", "torch.distributed.checkpoint",
           "torch.distributed.tensor", "torch.optim", "numpy", "hydra", "hydra.utils", "omegaconf", "yaml", "deepspeed",
           "transformers", "transformers.modeling_utils", "transformers.models.auto.modeling_auto",
           "transformers.models.auto.tokenization_auto", "transformers.models.llama.modeling_llama", "peft")
"""What `python -m ddptrain` imports anyway (not a module that a launch runs: runpy warns): torch, Hydra
and the rest before its first step; transformers and PEFT where model=hf (the tests' models are Llamas);
DeepSpeed where a ZeRO run starts and where a model=hf run saves its final weights (transformers'
save_pretrained asks accelerate to unwrap the model, which imports DeepSpeed, and DeepSpeed mlflow,
where they are installed: 2.4 s of CPU, 7 s of wall under load). Importing DeepSpeed leaves
`compiler.compile` as it was, so ddptrain's `import_deepspeed` still defers the Muon kernels' compiles
in the launch. transformers and PEFT take 3 s of CPU, in each process of each model=hf launch."""
FROZEN_PREFIXES = ("PYTHON", "TORCH_LOGS", "TORCHDYNAMO", "TORCHINDUCTOR", "TORCH_COMPILE", "PYTORCH", "HF_",
                   "TRANSFORMERS", "CUDA_", "OMP_", "KMP_", "MKL_", "OPENBLAS", "LD_", "GOMP", "TOKENIZERS", "DS_",
                   "ACCELERATE")
"""Environment variables that importing PRELOAD may have read: a launch must match the server on them
(torchrun's own RANK, TORCHELASTIC_* and the rest are read later, by the launched module)."""
APPLIED = {"PYTHONPATH", "PYTHONUNBUFFERED", "OMP_NUM_THREADS", "TORCHINDUCTOR_CACHE_DIR"}
"""Those of them that the child applies itself (sys.path, unbuffered stdio, torch's thread count) or
that are read later (inductor's cache, which torchrun sets for each worker)."""
HF_PREFIXES = ("HF_", "TRANSFORMERS", "TOKENIZERS", "ACCELERATE")
HF_LIBRARIES = {"huggingface_hub", "transformers", "tokenizers", "datasets", "safetensors", "accelerate", "peft", "trl"}
DATASETS_PREFIX = "HF_DATASETS_"
"""Variables that only the Hugging Face libraries read (torch and numpy read none of them), and those
libraries; of those variables, HF_DATASETS_* only `datasets` reads (the benchmarks give TRL's workers a
cache of their own). Where the server has imported none of those libraries (PRELOAD without
transformers and PEFT installed), a launch's own HF_* and the rest are read later, by the launched
module's imports, from the environment the child is given; where it has, only HF_DATASETS_* are,
while `datasets` is not imported. tests/conftest.py gives the whole session HF_HUB_OFFLINE=1 and
TOKENIZERS_PARALLELISM=false, the values the benchmarks set for their workers, so that those fork too."""
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def frozen(env: dict, read_later: tuple[str, ...] = ()) -> dict:
    """The variables of `env` that a launch must share with the server (`read_later`: prefixes that it need not)."""
    return {key: value for key, value in env.items()
            if key.startswith(FROZEN_PREFIXES) and key not in APPLIED and not key.startswith(read_later)}


def read_later() -> tuple[str, ...]:
    """The prefixes of the variables that no library imported in this process has read: HF_PREFIXES while
    no Hugging Face library is imported, else HF_DATASETS_ while `datasets` is not."""
    imported = {name.partition(".")[0] for name in sys.modules}
    if not imported & HF_LIBRARIES:
        return HF_PREFIXES
    return () if "datasets" in imported else (DATASETS_PREFIX,)


def _send(sock: socket.socket, message: dict, fds: list[int] | None = None) -> None:
    payload = json.dumps(message).encode()
    header = struct.pack("!I", len(payload))
    if fds:
        socket.send_fds(sock, [header], fds)
    else:
        sock.sendall(header)
    sock.sendall(payload)


def _receive(sock: socket.socket, with_fds: bool = False) -> tuple[dict | None, list[int]]:
    if with_fds:
        header, fds, _, _ = socket.recv_fds(sock, 4, 3)
    else:
        header, fds = sock.recv(4), []
    if len(header) < 4:
        return None, fds
    (size,) = struct.unpack("!I", header)
    payload = b""
    while len(payload) < size:
        chunk = sock.recv(size - len(payload))
        if not chunk:
            return None, fds
        payload += chunk
    return json.loads(payload), fds


# -- the client -----------------------------------------------------------------------------------

def client(argv: list[str]) -> int:
    """Run `python -m argv...` through the server, as if it were this process; return its exit code
    (or die of its signal)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    parent = os.getppid()
    try:
        sock.connect(os.environ[ENV_VAR])
        _send(sock, {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "ppid": parent}, fds=[0, 1, 2])
    except (KeyError, OSError):
        _plain(argv)
    for signum in FORWARDED:
        signal.signal(signum, lambda signum, _frame: _send(sock, {"signal": signum}))
    _on_parent_death(signal.SIGTERM, parent)
    while True:
        try:
            message, _ = _receive(sock)
            break
        except InterruptedError:
            continue
    if message is None:
        sys.stderr.write("tests/zygote.py: the fork server closed the launch without an exit status\n")
        return 1
    if message.get("refused"):
        _plain(argv)
    status = message["status"]
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    return os.waitstatus_to_exitcode(status)


def _on_parent_death(signum: int, parent: int) -> None:
    """SIGTERM to this client (forwarded like any other) when its parent dies: the forked process's
    parent is the server, so the launcher's death (torchrun's) reaches it this way, as ddptrain's
    PR_SET_PDEATHSIG would have delivered it to a worker that torchrun started itself."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signum), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it died before the call
        os.kill(os.getpid(), signum)


def _module_argv(argv: list[str]) -> list[str] | None:
    """argv's `-m MODULE ARGS`, after an optional -u; None for any other form."""
    argv = argv[1:] if argv[:1] == ["-u"] else argv
    return argv if argv[:1] == ["-m"] and len(argv) > 1 else None


def _plain(argv: list[str]) -> None:
    """Become the plain `python ARGV` (the server is down, or the environment differs from its own)."""
    os.execv(sys.executable, [sys.executable, *argv])


# -- the server -----------------------------------------------------------------------------------

def serve(path: str) -> None:
    import gc
    import importlib

    server_frozen = frozen(dict(os.environ))  # before the imports, which set some (CUDA_MODULE_LOADING)
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    gc.collect()
    gc.freeze()  # the children share these pages instead of copying them when the collector touches them
    base_path = [entry for entry in sys.path[1:] if entry not in os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    set_by_imports = {key: value for key, value in frozen(dict(os.environ)).items() if key not in server_frozen}
    later = read_later()
    server_frozen = frozen(server_frozen, later)

    wakeup_read, wakeup_write = os.pipe()
    os.set_blocking(wakeup_write, False)
    os.set_blocking(wakeup_read, False)
    signal.set_wakeup_fd(wakeup_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # the path appears once the server accepts
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(wakeup_read, selectors.EVENT_READ, "child")
    children: dict[int, socket.socket] = {}  # pid -> its client's connection
    try:
        while True:
            for key, _ in selector.select():
                if key.data == "accept":
                    conn, _ = listener.accept()
                    request, fds = _receive(conn, with_fds=True)
                    if request is None:
                        conn.close()
                        continue
                    differing = _differing(frozen(request["env"], later), server_frozen, set_by_imports)
                    if differing or _module_argv(request["argv"]) is None:
                        print(f"refused {request['argv'][:3]}: {differing or 'not -m MODULE'}", file=sys.stderr, flush=True)
                        for fd in fds:
                            os.close(fd)
                        _send(conn, {"refused": True})
                        conn.close()
                        continue
                    sys.stdout.flush()
                    sys.stderr.flush()
                    pid = os.fork()
                    if pid == 0:
                        others = [other for other in children.values() if other is not None]
                        _child(request, fds, base_path, set_by_imports, [listener, conn, selector, wakeup_read, wakeup_write, others])
                    for fd in fds:
                        os.close(fd)
                    children[pid] = conn
                    selector.register(conn, selectors.EVENT_READ, pid)
                elif key.data == "child":
                    try:
                        while os.read(wakeup_read, 512):
                            pass
                    except BlockingIOError:
                        pass
                    _reap(children, selector)
                else:  # a client's signal, or its end (then its process goes too)
                    pid, conn = key.data, key.fileobj
                    try:
                        message, _ = _receive(conn)
                    except OSError:
                        message = None
                    if message is None:
                        selector.unregister(conn)
                        conn.close()
                        children[pid] = None
                        _kill(pid, signal.SIGKILL)
                    else:
                        _kill(pid, message["signal"])
    finally:
        for pid in children:
            _kill(pid, signal.SIGKILL)
        os.unlink(path)


def _differing(launch: dict, server: dict, set_by_imports: dict) -> list[str]:
    """The frozen variables on which a launch differs from the server, but for those that the server's
    imports set and the launch holds with the same value: a forked launcher passes them on to its own
    children (torchrun to its workers: DeepSpeed's import sets PYTORCH_NVML_BASED_CUDA_CHECK=1)."""
    launch = {key: value for key, value in launch.items() if set_by_imports.get(key) != value}
    return sorted(key for key in {*launch, *server} if launch.get(key) != server.get(key))


def _kill(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _reap(children: dict, selector) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            selector.unregister(conn)
            try:
                _send(conn, {"status": status})
            except OSError:
                pass
            conn.close()


def _child(request: dict, fds: list[int], base_path: list[str], set_by_imports: dict, inherited: list) -> None:
    """In the forked process: become `python -m argv...` in the client's place, then exit."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for signum in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(signum, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        listener, conn, selector, wakeup_read, wakeup_write, others = inherited
        selector.close()
        for item in [listener, conn, *others]:
            item.close()
        os.close(wakeup_read)
        os.close(wakeup_write)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        parent = request["ppid"]
        os.getppid = lambda: parent  # the launcher's pid, as the process would have had it (not the server's)
        os.chdir(request["cwd"])
        env = request["env"]
        os.environ.clear()
        os.environ.update({**set_by_imports, **env})
        python_path = [entry for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry]
        sys.path[:] = [os.getcwd(), *python_path, *base_path]
        argv = request["argv"]
        if env.get("PYTHONUNBUFFERED") or argv[:1] == ["-u"]:  # torchrun starts its workers with -u
            argv = argv[1:] if argv[:1] == ["-u"] else argv
            sys.stdout.reconfigure(write_through=True)
            sys.stderr.reconfigure(write_through=True)
        if "OMP_NUM_THREADS" in env:
            import torch

            torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
        import runpy

        sys.argv = [argv[1], *argv[2:]]  # runpy puts the module's file in argv[0], as `python -m` does
        runpy._run_module_as_main(argv[1], alter_argv=True)
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if stop.code is not None and not isinstance(stop.code, int):
            print(stop.code, file=sys.stderr)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    finally:
        _finish(code)


def _finish(code: int) -> None:
    """What the interpreter does at exit, then exit without returning into the server's loop."""
    import atexit
    import threading

    try:
        threading._shutdown()  # join non-daemon threads, as Py_Finalize does
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def launch_command(argv: list[str]) -> list[str]:
    """The command that runs `python ARGV` (ARGV: `[-u] -m MODULE ARGS`): through the fork server
    where one is up, else plainly."""
    if _server_up() and _module_argv(argv) is not None:
        return [sys.executable, "-S", os.path.abspath(__file__), *argv]
    return [sys.executable, *argv]


def _server_up() -> bool:
    path = os.environ.get(ENV_VAR)
    return bool(path) and os.path.exists(path)


def torchrun_prefix(nproc: int, torchrun_args: tuple | list = ()) -> list[str]:
    """`torchrun --standalone --nproc_per_node=NPROC TORCHRUN_ARGS`, to be followed by `-m MODULE ARGS` (or a
    script): the launcher and each worker forked from the fork server where one is up, else plainly."""
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *torchrun_args]
    if _server_up():  # torchrun's own `-m` starts `python -u -m MODULE`
        launcher += ["--no-python", sys.executable, "-S", os.path.abspath(__file__), "-u"]
    return launch_command(launcher)


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        serve(sys.argv[2])
    else:
        sys.exit(client(sys.argv[1:]))
