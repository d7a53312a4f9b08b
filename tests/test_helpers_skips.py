"""The rule for optional dependencies (tests/helpers.py): a test skips only when the distribution is
not installed; an installed one whose import raises fails the run with its own error.

One pytest session in a subprocess, over generated test files, with a PYTHONPATH shim in front:
a `deepspeed` package whose import raises ImportError (with a dist-info, so it counts as installed
whether or not the real DeepSpeed is), and `ddptrain-test-broken`, whose import raises RuntimeError.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from tests.helpers import REPO

BROKEN_DEEPSPEED = "shim: this deepspeed is installed but its import fails"
BROKEN_OTHER = "shim: ddptrain-test-broken raises at import"

SHIM = {
    "deepspeed/__init__.py": f"raise ImportError({BROKEN_DEEPSPEED!r})\n",
    "deepspeed-0.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: deepspeed\nVersion: 0.0\n",
    "ddptrain_test_broken/__init__.py": f"raise RuntimeError({BROKEN_OTHER!r})\n",
    "ddptrain_test_broken-0.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: ddptrain-test-broken\nVersion: 0.0\n",
}

TESTS = {
    "test_in_tests.py": '''
from tests.helpers import import_deepspeed, import_optional, requires, requires_deepspeed


@requires_deepspeed
def test_marked_broken():
    pass


def test_imported_broken():
    import_deepspeed()


@requires("ddptrain-test-broken", module="ddptrain_test_broken")
def test_marked_broken_other_error():
    pass


@requires("ddptrain-test-absent")
def test_marked_absent():
    raise AssertionError("ran without its distribution")


def test_imported_absent():
    import_optional("ddptrain_test_absent", "ddptrain-test-absent")
    raise AssertionError("ran without its distribution")


@requires("pytest")
def test_marked_installed_gets_its_fixtures(tmp_path):
    assert tmp_path.is_dir()
''',
    "test_top_level_broken.py": '''
from tests.helpers import import_optional

deepspeed = import_optional("deepspeed")


def test_never_collected():
    pass
''',
    "test_top_level_absent.py": '''
from tests.helpers import import_optional

absent = import_optional("ddptrain_test_absent", "ddptrain-test-absent")


def test_never_run():
    raise AssertionError("ran without its distribution")
''',
}


def _outcomes(junit) -> dict[str, tuple[str, str]]:
    """test name (or file, for a collection error) -> (outcome, the report's text)."""
    outcomes = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        reports = [child for child in case if child.tag in ("failure", "error", "skipped")]
        outcome = reports[0].tag if reports else "passed"
        text = "".join(f"{r.get('message', '')}\n{r.text or ''}" for r in reports)
        outcomes[case.get("name")] = (outcome, text)
    return outcomes


@pytest.mark.slow  # over 4 s (a process launch or ranks): out of the fast tier
def test_installed_but_broken_fails_with_its_error_and_absent_skips(tmp_path):
    shim, suite = tmp_path / "shim", tmp_path / "suite"
    for relative, text in SHIM.items():
        (shim / relative).parent.mkdir(parents=True, exist_ok=True)
        (shim / relative).write_text(text)
    suite.mkdir()
    for name, text in TESTS.items():
        (suite / name).write_text(text)
    junit = tmp_path / "junit.xml"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shim), str(REPO)]), "CUDA_VISIBLE_DEVICES": "",
           "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rA",
                             "--continue-on-collection-errors", f"--junitxml={junit}", str(suite)],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 1, f"the session must fail (exit 1), got {result.returncode}:\n{output[-4000:]}"
    outcomes = _outcomes(junit)

    for name in ("test_marked_broken", "test_imported_broken"):
        outcome, text = outcomes[name]
        assert outcome == "failure" and f"ImportError: {BROKEN_DEEPSPEED}" in text, (name, outcome, text[-2000:])
    outcome, text = outcomes["test_marked_broken_other_error"]
    assert outcome == "failure" and f"RuntimeError: {BROKEN_OTHER}" in text, (outcome, text[-2000:])
    collection = {name: report for name, report in outcomes.items() if "top_level_broken" in name}
    assert len(collection) == 1, outcomes.keys()
    outcome, text = next(iter(collection.values()))
    assert outcome == "error" and f"ImportError: {BROKEN_DEEPSPEED}" in text, (outcome, text[-2000:])

    for name in ("test_marked_absent", "test_imported_absent"):
        outcome, text = outcomes[name]
        assert outcome == "skipped" and "ddptrain-test-absent is not installed" in text, (name, outcome, text)
    absent_file = [report for name, report in outcomes.items() if "top_level_absent" in name]
    assert [outcome for outcome, _ in absent_file] == ["skipped"], outcomes
    assert outcomes["test_marked_installed_gets_its_fixtures"][0] == "passed", outcomes
    assert "test_never_run" not in outcomes and "test_never_collected" not in outcomes, outcomes
