"""docker/Dockerfile, checked without a Docker engine (there is none here).

A small parser reads the Dockerfile's instructions; the tests check what a build would trip over or
what would make the image wrong: an unpinned base, a COPY source missing from the build context
(the repository root), a root user, buffered Python output, and an entrypoint that does not run
the README's training command. Building and running the image is not tested.
"""

from __future__ import annotations

import glob
import json
import re
import shlex
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCKERFILE = REPO / "docker" / "Dockerfile"
README = REPO / "README.md"


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


def test_base_image_is_pinned(instructions):
    bases = [i for i in instructions if i.keyword == "FROM"]
    assert bases, "no FROM"
    for base in bases:
        image = [t for t in base.args.split() if not t.startswith("--")][0]
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
    if not README.exists():
        pytest.skip("README.md does not exist yet: cannot compare the entrypoint with its command")
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
