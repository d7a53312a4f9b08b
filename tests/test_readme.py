"""The README starts with the two commands, and .ci/run runs exactly the test one."""

from __future__ import annotations

import re

from tests.helpers import REPO


def _readme_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S)
    return [blocks[0].strip(), blocks[1].strip()]


def test_readme_starts_with_run_and_test_commands():
    run, test = _readme_commands()
    assert run.startswith("pip install torch==2.13.0") and run.endswith("python -m ddptrain")
    assert test.startswith("pip install torch==2.13.0") and "pytest" in test


def test_ci_runs_exactly_the_readme_test_command():
    _, test = _readme_commands()
    ci_lines = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    assert test in ci_lines, f"{test!r} is not a line of .ci/run"
