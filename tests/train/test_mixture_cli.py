"""data=mixture through the command line: the same per-source counts and loss curve on every layout,
a mixture of one source equal to that source's run, resume on another world size and with other
weights, and a source exhausted at the step it runs out."""

from __future__ import annotations

import json
import random
import shlex
from pathlib import Path

import pytest

from tests.helpers import REPO, read_metrics, run_cli

pytestmark = pytest.mark.slow

RUN = ["model.n_layer=1", "model.n_head=2", "model.n_embd=32", "trainer.log_every=1", "optim.warmup_steps=2",
       "optim.schedule=constant", "trainer.eval_examples=4", "trainer.eval_every=3", "batch.seq_len=32",
       "batch.global_size=8", "trainer.precision=fp64", "dist.timeout_s=60", "data=mixture"]
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def write_sources(root: Path) -> Path:
    """web: 30 text files; code: 40 JSONL records; books: 3 files cut into paragraphs (a small source)."""
    rng = random.Random(55)
    for name in ("web", "code", "books"):
        (root / name).mkdir(parents=True, exist_ok=True)
    for i in range(30):
        (root / "web" / f"{i}.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 80))))
    with open(root / "code" / "a.jsonl", "w") as records:
        for i in range(40):
            body = f"def f{i}(x):\n    return x + {rng.randint(0, 99)}\n" * rng.randint(1, 4)
            records.write(json.dumps({"content": body}) + "\n")
    for i in range(3):  # about 270 bytes: a pass in two or three steps at weight 0.6
        paragraphs = (" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 10))) for _ in range(2))
        (root / "books" / f"{i}.txt").write_text("\n\n".join(paragraphs))
    return root


def sources(root: Path, web: float = 0.5, code: float = 0.3, books: float = 0.2, books_extra: str = "") -> str:
    return ("data.sources={"
            f"web: {{name: text, paths: ['{root}/web/*.txt'], weight: {web}}}, "
            f"code: {{name: jsonl, paths: ['{root}/code/*.jsonl'], field: content, weight: {code}}}, "
            f"books: {{name: text, paths: ['{root}/books/*.txt'], split_by: paragraph, weight: {books}{books_extra}}}}}")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_sources(tmp_path_factory.mktemp("mix"))


def _train(run_dir: Path, args: list[str], nproc: int = 1) -> str:
    result = run_cli([*RUN, f"run.dir={run_dir}", f"data.cache_dir={run_dir.parent / 'cache'}", *args], nproc=nproc)
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stderr


def _curve(run_dir: Path, keys=("loss", "val_loss")) -> list[dict]:
    return [{key: value for key, value in line.items()
             if key in keys or key.startswith(("loss/", "val_loss/", "mix/"))} for line in read_metrics(run_dir)]


def _same_curve(a: list[dict], b: list[dict], tolerance: float = 1e-9) -> None:
    assert len(a) == len(b)
    for line_a, line_b in zip(a, b):
        train = lambda line: {key for key in line if not key.startswith("val_loss")}  # noqa: E731
        assert train(line_a) == train(line_b)  # a launch's last step is an eval step of its own
        for key, value in line_a.items():
            if key not in line_b:
                continue
            if key.startswith("mix/"):  # counts, shares, epochs: the plan's, exactly
                assert value == line_b[key], key
            elif value is not None:
                assert abs(value - line_b[key]) <= tolerance * abs(line_b[key]), (key, value, line_b[key])


def test_a_three_source_mixture_is_the_same_on_every_layout_and_exact_in_every_step(corpus, tmp_path):
    mix = sources(corpus)
    layouts = {"1x8": (1, ["batch.micro_size=8"]), "2x2": (2, ["batch.micro_size=2"]),
               "2 budgets": (2, ["batch.micro_size=2", "batch.micro_tokens=48", "batch.pack=false"])}
    curves, logs = {}, {}
    for name, (nproc, args) in layouts.items():
        run_dir = tmp_path / name.replace(" ", "-") / "run"
        logs[name] = _train(run_dir, [mix, "trainer.max_steps=6", *args], nproc)
        curves[name] = _curve(run_dir)
    for name in ("2x2", "2 budgets"):
        _same_curve(curves[name], curves["1x8"])
    lines = read_metrics(tmp_path / "1x8" / "run")
    bound = 32  # one example: a piece of seq_len + 1 tokens has at most 32 valid targets
    for line in lines:
        total = sum(line[f"mix/{s}/targets"] for s in ("web", "code", "books"))
        assert total == line["tokens"]  # the plan's per-source counts are the engine's N_t
        assert abs(sum(line[f"loss/{s}"] * line[f"mix/{s}/targets"] for s in ("web", "code", "books")) / total
                   - line["loss"]) < 1e-9 * line["loss"]  # each source's exact mean over its own targets
    seen = {s: 0 for s in ("web", "code", "books")}
    for line in lines:
        for s in seen:
            seen[s] += line[f"mix/{s}/targets"]
        total = sum(seen.values())
        for s, weight in (("web", 0.5), ("code", 0.3), ("books", 0.2)):
            assert abs(seen[s] - weight * total) <= bound, (line["step"], s, seen[s], weight * total)
            assert line[f"mix/{s}/share"] == pytest.approx(seen[s] / total)
    assert all(line[f"val_loss/{s}"] is not None for s in seen for line in lines if "val_loss" in line)
    assert "mix web " in logs["1x8"]


def test_packed_mixtures_are_the_same_on_every_layout(corpus, tmp_path):
    mix = sources(corpus)
    one = tmp_path / "one" / "run"
    two = tmp_path / "two" / "run"
    _train(one, [mix, "trainer.max_steps=4", "batch.pack=true", "batch.micro_size=4"])
    _train(two, [mix, "trainer.max_steps=4", "batch.pack=true", "batch.micro_size=2", "batch.micro_tokens=64"], 2)
    _same_curve(_curve(two), _curve(one))
    assert read_metrics(one)[0]["padding_efficiency"] > 0.9  # rows cut from each source's stream


def test_a_mixture_of_one_source_is_that_sources_run_bit_for_bit(corpus, tmp_path):
    plain, mixed = tmp_path / "plain" / "run", tmp_path / "mixed" / "run"
    common = ["trainer.max_steps=4", "batch.micro_size=4"]
    _train(plain, [*common, "data=text", f"data.paths=['{corpus}/web/*.txt']"])
    _train(mixed, [*common, f"data.sources={{web: {{name: text, paths: ['{corpus}/web/*.txt'], weight: 3}}}}"])
    for a, b in zip(read_metrics(plain), read_metrics(mixed)):
        for key in ("loss", "val_loss", "grad_norm", "tokens"):
            assert a.get(key) == b.get(key), key  # bit for bit
        assert b["loss/web"] == b["loss"] and b["mix/web/share"] == 1.0


def test_a_resume_on_another_world_size_continues_each_sources_stream(corpus, tmp_path):
    """Stopped in the middle of a later pass of the small source, resumed on 1 rank from 2: the curve and the per-source
    counts of the run that never stopped."""
    mix = sources(corpus, web=0.2, code=0.2, books=0.6)
    straight, resumed = tmp_path / "straight" / "run", tmp_path / "resumed" / "run"
    _train(straight, [mix, "trainer.max_steps=8", "batch.micro_size=4"], 2)
    _train(resumed, [mix, "trainer.max_steps=4", "batch.micro_size=2"], 2)
    stopped = read_metrics(resumed)[-1]
    assert stopped["mix/books/epoch"] > 1 and not float(stopped["mix/books/epoch"]).is_integer()  # mid-pass, repeated
    log = _train(resumed, [mix, "trainer.max_steps=8", "batch.micro_size=8"], 1)
    assert "resumed from" in log
    _same_curve(_curve(resumed), _curve(straight))


def test_a_weight_change_on_resume_continues_from_the_cursors(corpus, tmp_path):
    run_dir = tmp_path / "run"
    _train(run_dir, [sources(corpus), "trainer.max_steps=3", "batch.micro_size=8"])
    before = read_metrics(run_dir)[-1]
    log = _train(run_dir, [sources(corpus, web=0.1, code=0.1, books=0.8), "trainer.max_steps=9", "batch.micro_size=8"])
    assert "mixture weights changed on resume (web 0.5 -> 0.1, code 0.3 -> 0.1, books 0.2 -> 0.8)" in log
    lines = read_metrics(run_dir)
    assert lines[2] == before  # the steps before the resume are kept as they were
    after = lines[3]
    for s in ("web", "code", "books"):  # each stream goes on from where it stopped
        assert after[f"mix/{s}/epoch"] >= before[f"mix/{s}/epoch"]
    assert lines[-1]["mix/books/share"] > before["mix/books/share"] + 0.2  # toward its new weight


def test_a_source_past_its_max_repeat_stops_the_run_naming_it_or_is_dropped(corpus, tmp_path):
    limited = sources(corpus, web=0.2, code=0.2, books=0.6, books_extra=", max_repeat: 0")
    run_dir = tmp_path / "error" / "run"
    result = run_cli([*RUN, f"run.dir={run_dir}", f"data.cache_dir={tmp_path / 'cache'}", limited,
                      "trainer.max_steps=12", "batch.micro_size=8"])
    assert result.returncode == 2, result.stderr[-3000:]
    assert "data.sources.books is exhausted: its" in result.stderr and "(max_repeat=0)" in result.stderr
    assert "on_exhausted=error" in result.stderr
    failed_at = int(result.stderr.split("is exhausted")[0].rsplit("step ", 1)[1].split(":")[0])
    assert [line["step"] for line in read_metrics(run_dir)] == list(range(1, failed_at))
    dropped = sources(corpus, web=0.2, code=0.2, books=0.6, books_extra=", max_repeat: 0, on_exhausted: renormalize")
    run_dir = tmp_path / "renormalize" / "run"
    log = _train(run_dir, [dropped, "trainer.max_steps=12", "batch.micro_size=8"])
    assert "data.sources.books is exhausted" in log and "dropped" in log
    lines = read_metrics(run_dir)
    assert lines[-1]["mix/books/exhausted"] == 1 and lines[-1]["mix/books/targets"] == 0
    assert lines[-1]["mix/books/epoch"] == 1.0  # read once: max_repeat=0
    assert lines[failed_at - 2]["mix/books/exhausted"] == 0


def test_a_mixture_from_a_yaml_file_of_the_users_config_group(corpus, tmp_path):
    group = tmp_path / "conf" / "data"
    group.mkdir(parents=True)
    (group / "mymix.yaml").write_text(
        "defaults:\n  - mixture\n  - _self_\n"
        f"sources:\n  web: {{name: text, paths: ['{corpus}/web/*.txt'], weight: 0.7}}\n"
        f"  code: {{name: jsonl, paths: ['{corpus}/code/*.jsonl'], field: content, weight: 0.3}}\n")
    run_dir = tmp_path / "run"
    args = [arg for arg in RUN if arg != "data=mixture"]
    result = run_cli(["--config-dir", str(tmp_path / "conf"), *args, "data=mymix", f"run.dir={run_dir}",
                      f"data.cache_dir={tmp_path / 'cache'}", "trainer.max_steps=2", "batch.micro_size=8"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert set(k for k in read_metrics(run_dir)[-1] if k.startswith("loss/")) == {"loss/web", "loss/code"}
    (group / "twice.yaml").write_text(
        "defaults:\n  - mixture\n  - _self_\n"
        f"sources:\n  web: {{name: text, paths: ['{corpus}/web/*.txt']}}\n"
        f"  web: {{name: jsonl, paths: ['{corpus}/code/*.jsonl'], field: content}}\n")
    result = run_cli(["--config-dir", str(tmp_path / "conf"), *args, "data=twice", f"run.dir={tmp_path / 'x'}"])
    assert result.returncode != 0 and "duplicate key" in result.stderr.lower() and "web" in result.stderr
    assert not (tmp_path / "x").exists()  # before anything is written


def test_the_readme_mixture_runs_as_written(corpus, tmp_path):
    """README.md's two-source command, its words as written, in a directory holding web/ and code/ (with
    this file's small sizes after it)."""
    [command] = [line for line in (REPO / "README.md").read_text().splitlines()
                 if line.startswith("python -m ddptrain data=mixture")]
    words = shlex.split(command)[3:]
    assert words[0] == "data=mixture" and words[1].startswith("data.sources=")
    small = [arg for arg in RUN if arg != "data=mixture"]
    result = run_cli([*words, *small, "trainer.max_steps=2", "batch.micro_size=8", f"run.dir={tmp_path / 'run'}",
                      f"data.cache_dir={tmp_path / 'cache'}"], cwd=corpus)
    assert result.returncode == 0, result.stderr[-3000:]
    line = read_metrics(tmp_path / "run")[-1]
    assert line["mix/web/targets"] + line["mix/code/targets"] == line["tokens"]
    assert abs(line["mix/web/share"] - 0.7) * (line["tokens_seen"]) <= 32  # within one example of 0.7
