"""docker/Dockerfile: static checks, and a real build that trains in the image.

A small parser reads the Dockerfile's instructions; the static tests check what a build would trip
over or what would make the image wrong: an unpinned base, a COPY source missing from the build
context (the repository root), a root user, buffered Python output, a torch other than the one CI
tests, and an entrypoint that does not run the README's training command.

`test_image_builds_and_trains` (slow, about 3 minutes; needs root) builds the image for real and
runs two CPU ranks in it. It installs Debian's docker.io and debootstrap with apt-get when they are
missing, starts dockerd when no engine answers (and stops it afterwards), builds the base image
from `debootstrap --variant=minbase bookworm` (Docker Hub is not reachable here) and installs torch
from the CPU wheel in pip's own find-links directory, so nothing downloads the CUDA build.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "docker" / "Dockerfile"
README = REPO / "README.md"

pytestmark = pytest.mark.system


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case: FROM, RUN, COPY, ...
    args: str  # everything after the keyword, continuation lines joined
    line: int  # 1-based line of the keyword, for messages


def parse_dockerfile(text: str) -> list[Instruction]:
    """Instructions in order. Handles `\\` continuations and comment lines (also inside a
    continuation, which Docker strips). Parser directives (`# syntax=`) are comments here."""
    instructions: list[Instruction] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if not pending:
            start = number
        continued = stripped.endswith("\\")
        pending.append(stripped[:-1].strip() if continued else stripped)
        if continued:
            continue
        keyword, _, args = " ".join(pending).partition(" ")
        instructions.append(Instruction(keyword.upper(), args.strip(), start))
        pending = []
    if pending:
        raise ValueError(f"line {start}: instruction ends in a line continuation")
    return instructions


def exec_or_shell_form(args: str) -> list[str]:
    """ENTRYPOINT/CMD arguments: a JSON array (exec form) or a shell string (shell form)."""
    if args.startswith("["):
        value = json.loads(args)
        assert isinstance(value, list) and all(isinstance(v, str) for v in value), args
        return value
    return ["/bin/sh", "-c", args]


def env_pairs(args: str) -> dict[str, str]:
    """`ENV A=1 B="x y"` or the legacy `ENV A 1`."""
    tokens = shlex.split(args)
    if tokens and "=" not in tokens[0]:
        return {tokens[0]: " ".join(tokens[1:])}
    return dict(token.split("=", 1) for token in tokens)


def without_flags(args: str) -> list[str]:
    """COPY/ADD operands without leading `--chown=...`-style flags."""
    tokens = json.loads(args) if args.startswith("[") else shlex.split(args)
    return [t for t in tokens if not t.startswith("--")]


@pytest.fixture(scope="module")
def instructions() -> list[Instruction]:
    return parse_dockerfile(DOCKERFILE.read_text())


def test_parser_handles_continuations_and_comments():
    text = "# syntax=docker/dockerfile:1\nFROM a:1\nRUN echo 1 \\\n    # inside\n    && echo 2\n"
    parsed = parse_dockerfile(text)
    assert [(i.keyword, i.args, i.line) for i in parsed] == [
        ("FROM", "a:1", 2),
        ("RUN", "echo 1 && echo 2", 3),
    ]


def test_every_instruction_is_known(instructions):
    known = {"FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME",
             "USER", "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL"}
    assert instructions and instructions[0].keyword in {"FROM", "ARG"}
    unknown = [(i.line, i.keyword) for i in instructions if i.keyword not in known]
    assert not unknown, f"unknown Dockerfile instructions (line, keyword): {unknown}"


def build_args(instructions: list[Instruction]) -> dict[str, str]:
    """Default values of the ARGs: `ARG NAME=value`."""
    return dict(i.args.split("=", 1) for i in instructions if i.keyword == "ARG" and "=" in i.args)


def test_base_image_is_pinned(instructions):
    bases = [i for i in instructions if i.keyword == "FROM"]
    assert bases, "no FROM"
    defaults = build_args(instructions)
    for base in bases:
        image = [t for t in base.args.split() if not t.startswith("--")][0]
        variable = re.fullmatch(r"\$\{?(\w+)\}?", image)
        if variable:  # FROM ${BASE_IMAGE}: its default must be pinned
            assert variable.group(1) in defaults, f"line {base.line}: {image} has no default"
            image = defaults[variable.group(1)]
        assert "$" not in image, f"line {base.line}: base image {image!r} comes from a variable"
        if "@sha256:" in image:
            continue
        name, _, tag = image.rpartition(":")
        assert name and "/" not in tag, f"line {base.line}: base image {image!r} has no tag"
        assert tag != "latest", f"line {base.line}: base image {image!r} is not pinned"
        assert re.search(r"\d", tag), f"line {base.line}: tag {tag!r} names no version"


def test_copy_sources_exist_in_build_context(instructions):
    """The build context is the repository root (`docker build -f docker/Dockerfile .`)."""
    missing = []
    for instruction in instructions:
        if instruction.keyword not in {"COPY", "ADD"} or "--from=" in instruction.args:
            continue  # --from copies from another stage or image, not the context
        *sources, _destination = without_flags(instruction.args)
        assert sources, f"line {instruction.line}: {instruction.keyword} without a source"
        for source in sources:
            if re.match(r"^[a-z]+://", source):
                continue  # ADD of a URL
            if not glob.glob(str(REPO / source)):
                missing.append(f"line {instruction.line}: {source}")
    assert not missing, f"COPY/ADD sources missing from the build context: {missing}"


def test_runs_as_non_root_user(instructions):
    users = [i for i in instructions if i.keyword == "USER"]
    assert users, "no USER: the container would run as root"
    user = users[-1].args.split(":")[0]
    assert user not in {"root", "0"}, f"line {users[-1].line}: final USER is {user!r}"


def test_python_output_is_unbuffered(instructions):
    env: dict[str, str] = {}
    for instruction in instructions:
        if instruction.keyword == "ENV":
            env.update(env_pairs(instruction.args))
    assert env.get("PYTHONUNBUFFERED") == "1", f"ENV PYTHONUNBUFFERED is {env.get('PYTHONUNBUFFERED')!r}"


def readme_torch_version() -> str:
    run = re.search(r"```bash\n(.*?)```", README.read_text(), flags=re.S).group(1)
    return re.search(r"pip install torch==([\w.]+)", run).group(1)


def test_installs_the_torch_that_ci_tests(instructions):
    """The README's first command and .ci/run pin torch; the image installs the same version."""
    version = readme_torch_version()
    assert f"pip install torch=={version}" in (REPO / ".ci" / "run").read_text()
    assert build_args(instructions).get("TORCH_VERSION") == version
    runs = " ".join(i.args for i in instructions if i.keyword == "RUN")
    assert '"torch==${TORCH_VERSION}"' in runs, "no RUN installs torch==${TORCH_VERSION}"


def test_installs_the_deepspeed_extra_that_pyproject_declares(instructions):
    runs = " ".join(i.args for i in instructions if i.keyword == "RUN")
    extras = set(re.findall(r"\.\[([\w,-]+)\]", runs))
    assert extras, "no `pip install .[extra]` in any RUN"
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    requested = {extra for group in extras for extra in group.split(",")}
    assert "deepspeed" in requested
    assert requested <= set(declared), f"extras {requested - set(declared)} are not in pyproject.toml"


def entrypoint_command(instructions: list[Instruction]) -> str:
    """The command line the container runs, as one string (ENTRYPOINT, else CMD)."""
    for keyword in ("ENTRYPOINT", "CMD"):
        found = [i for i in instructions if i.keyword == keyword]
        if found and exec_or_shell_form(found[-1].args):
            argv = exec_or_shell_form(found[-1].args)
            if argv[:2] == ["/usr/bin/tini", "--"]:  # an init as PID 1 runs the command
                argv = argv[2:]
            # `sh -c "SCRIPT" name`: the script is the command.
            if len(argv) >= 3 and argv[0].endswith("sh") and argv[1] == "-c":
                return argv[2]
            return shlex.join(argv)
    raise AssertionError("no ENTRYPOINT or CMD")


def test_entrypoint_runs_torchrun_with_overrides_passed_through(instructions):
    command = entrypoint_command(instructions)
    assert "torchrun" in command and "-m ddptrain" in command, command
    assert '"$@"' in command, f"`docker run IMAGE overrides...` must reach ddptrain: {command}"


def readme_code_blocks() -> list[str]:
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", README.read_text(), flags=re.S | re.M)
    assert blocks, "README.md has no fenced code block"
    return blocks


def test_readme_first_code_block_runs_ddptrain():
    first = readme_code_blocks()[0]
    assert "-m ddptrain" in first, f"README.md's first code block does not run `-m ddptrain`:\n{first}"


def readme_torchrun_command() -> str:
    """The README's first `torchrun ... -m ddptrain` line: the command the image must run."""
    for block in readme_code_blocks():
        for line in block.splitlines():
            line = line.strip()
            if line.startswith("torchrun") and "-m ddptrain" in line:
                return line
    raise AssertionError("README.md shows no `torchrun ... -m ddptrain` command")


def test_entrypoint_matches_readme_command(instructions):
    readme = readme_torchrun_command()
    command = entrypoint_command(instructions)
    assert re.search(r"(^|\s)(exec\s+)?torchrun\s", command), f"the image runs {command!r}, not torchrun"
    # Every torchrun option the README uses (--standalone, --nproc_per_node) is in the entrypoint.
    before_module = readme.split("-m ddptrain")[0]
    options = {opt.split("=")[0].replace("-", "_") for opt in re.findall(r"--[\w-]+(?:=\S+)?", before_module)}
    image_options = {opt.split("=")[0].replace("-", "_") for opt in re.findall(r"--[\w-]+", command)}
    assert options <= image_options, f"README options {options - image_options} missing from the entrypoint"


# -- building and running the image ---------------------------------------------------------------

BASE_IMAGE = "ddptrain-test/debian-bookworm:minbase"
IMAGE = "ddptrain-test:latest"
DEBIAN_MIRROR = "http://deb.debian.org/debian"


def _run(cmd: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)


def _tail(result: subprocess.CompletedProcess, chars: int = 3000) -> str:
    return (result.stdout + result.stderr)[-chars:]


def _apt_install(*packages: str) -> None:
    """Install Debian packages, or skip saying why not (no root, apt-get failed)."""
    if os.geteuid() != 0:
        pytest.skip(f"{', '.join(packages)} missing, and installing them with apt-get needs root")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", *packages]):
        result = _run(cmd, timeout=600, env=env)
        if result.returncode != 0:
            pytest.skip(f"apt-get could not install {', '.join(packages)}:\n{_tail(result)}")


def _engine_answers() -> bool:
    return _run(["docker", "info"], timeout=60).returncode == 0


@pytest.fixture(scope="module")
def docker_engine(tmp_path_factory):
    """A Docker engine: the running one, or dockerd started here (and stopped afterwards)."""
    if not (shutil.which("docker") and shutil.which("dockerd")):
        _apt_install("docker.io")
    if _engine_answers():
        yield
        return
    if os.geteuid() != 0:
        pytest.skip("no Docker engine answers, and starting dockerd needs root")
    log_path = tmp_path_factory.mktemp("dockerd") / "dockerd.log"
    with open(log_path, "w") as log:
        daemon = subprocess.Popen(["dockerd"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        for _ in range(120):
            if daemon.poll() is not None or _engine_answers():
                break
            time.sleep(0.5)
        if not _engine_answers():
            pytest.skip(f"dockerd could not start on this machine (exit {daemon.poll()}):\n"
                        f"{log_path.read_text()[-3000:]}")
        yield
    finally:
        if daemon.poll() is None:
            daemon.terminate()
            try:
                daemon.wait(timeout=60)
            except subprocess.TimeoutExpired:
                daemon.kill()


@pytest.fixture(scope="module")
def base_image(docker_engine, tmp_path_factory) -> str:
    """Debian bookworm (minbase) imported from debootstrap: Docker Hub is not reachable here."""
    if _run(["docker", "image", "inspect", BASE_IMAGE], timeout=60).returncode == 0:
        return BASE_IMAGE
    if not shutil.which("debootstrap"):
        _apt_install("debootstrap")
    root = tmp_path_factory.mktemp("rootfs")
    made = _run(["debootstrap", "--variant=minbase", "bookworm", str(root), DEBIAN_MIRROR], timeout=900)
    if made.returncode != 0:
        pytest.skip(f"debootstrap could not build Debian bookworm from {DEBIAN_MIRROR}:\n{_tail(made)}")
    tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
    imported = _run(["docker", "import", "-", BASE_IMAGE], timeout=600, stdin=tar.stdout)
    tar.wait()
    assert imported.returncode == 0, _tail(imported)
    shutil.rmtree(root, ignore_errors=True)
    return BASE_IMAGE


def _local_torch_wheel(version: str) -> Path | None:
    """A torch `version` wheel in the find-links directories of pip's own configuration."""
    shown = _run([sys.executable, "-m", "pip", "config", "list"], timeout=60).stdout
    for line in shown.splitlines():
        key, _, value = line.partition("=")
        if key.endswith("find-links"):
            for folder in value.strip("'\"").split():
                found = sorted(Path(folder.removeprefix("file://")).glob(f"torch-{version}*.whl"))
                if found:
                    return found[0]
    return None


def _build_context(target: Path, version: str) -> Path:
    """The repository files the image copies, and in docker/wheels/ every wheel it installs: torch from
    the local find-links directory (CPU build), the rest from PyPI through pip on this machine."""
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, target / name)
    for name in ("conf", "ddptrain"):
        shutil.copytree(REPO / name, target / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    (target / "docker" / "wheels").mkdir(parents=True)
    shutil.copy2(DOCKERFILE, target / "docker" / "Dockerfile")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    requirements = [f"torch=={version}", *project["project"]["dependencies"],
                    *project["project"]["optional-dependencies"]["deepspeed"], *project["build-system"]["requires"]]
    wheels = _run([sys.executable, "-m", "pip", "wheel", "-q", "-w", str(target / "docker" / "wheels"),
                   *requirements], timeout=900)
    assert wheels.returncode == 0, _tail(wheels)
    return target


@pytest.mark.slow
def test_image_builds_and_trains(base_image, tmp_path):
    """`docker build` with the local base and wheels (no network for pip), then `docker run` with two
    CPU ranks: the entrypoint trains, and the image holds the torch that CI tests."""
    version = readme_torch_version()
    if _local_torch_wheel(version) is None:
        pytest.skip(f"pip's find-links directories hold no torch {version} wheel: the build would download "
                    "PyPI's CUDA build of torch (several GB)")
    context = _build_context(tmp_path, version)
    built = _run(["docker", "build", "--network=host", f"--build-arg=BASE_IMAGE={base_image}",
                  "--build-arg=PIP_INSTALL_OPTIONS=--no-index", "-f", str(context / "docker" / "Dockerfile"),
                  "-t", IMAGE, str(context)], timeout=900, env={**os.environ, "DOCKER_BUILDKIT": "0"})
    assert built.returncode == 0, _tail(built, 6000)

    torch_version = _run(["docker", "run", "--rm", "--entrypoint", "python", IMAGE, "-c",
                          "import torch; print(torch.__version__)"], timeout=120)
    assert torch_version.stdout.strip().split("+")[0] == version, _tail(torch_version)

    trained = _run(["docker", "run", "--rm", "-e", "NPROC_PER_NODE=2", "-e", "OMP_NUM_THREADS=1", IMAGE,
                    "trainer.max_steps=3", "trainer.log_every=1", "data.max_docs=40", "model.n_layer=1",
                    "model.n_head=2", "model.n_embd=32", "batch.seq_len=32"], timeout=300)
    assert trained.returncode == 0, _tail(trained, 6000)
    assert "world: 2 rank(s)" in trained.stderr and "step 3/3" in trained.stderr, _tail(trained, 6000)
