"""Bad input is a message naming the value and the rule, exit code 2, and leaves nothing behind."""

from __future__ import annotations

import pytest

from ddptrain.config.compose import compose_config
from ddptrain.runs import store as ckpt
from ddptrain.runs.lock import RunDirError
from ddptrain.runs.rundir import RunDir
from tests.helpers import import_optional


def _run_dir(*overrides: str) -> RunDir:
    return RunDir(compose_config(list(overrides)))


def test_a_run_dir_that_is_a_file_is_a_run_dir_error(tmp_path):
    (tmp_path / "a-file").write_text("not a directory")
    with pytest.raises(RunDirError, match=r"run.dir=.*a-file cannot be used: .*it must be a writable directory"):
        _run_dir(f"run.dir={tmp_path / 'a-file'}").lock()


def test_a_resume_path_that_does_not_exist_leaves_no_run_dir_behind(tmp_path):
    run_dir = tmp_path / "run"
    with pytest.raises(ckpt.CheckpointError, match=f"{tmp_path / 'nope'} does not exist"):
        _run_dir(f"run.dir={run_dir}", f"checkpoint.resume={tmp_path / 'nope'}").lock()
    assert not run_dir.exists()


def test_data_hf_on_a_directory_that_is_not_a_dataset_is_a_data_error(tmp_path):
    import_optional("datasets")
    from ddptrain.data import DataError
    from ddptrain.data.sources import hf_records

    (tmp_path / "notes.txt").write_text("not a dataset")
    with pytest.raises(DataError, match=r"is a directory but not a Hugging Face dataset saved with save_to_disk"):
        hf_records([tmp_path], "train", tmp_path / "cache")


def test_the_layout_line_says_what_the_global_batch_is_split_into():
    from ddptrain.train.builder import describe_layout

    fixed = compose_config(["batch.global_size=8", "batch.micro_size=2"])
    assert describe_layout(fixed, 2) == "global batch 8 sequences = micro 2 x accumulation 2 x world 2"
    packed = describe_layout(compose_config(["batch.global_size=8", "batch.micro_size=2", "batch.pack=true",
                                             "batch.seq_len=64"]), 1)
    assert packed.startswith("global batch 8 sequences, packed into rows of 64 tokens, 2 rows per microbatch, world 1")
    assert "=" not in packed, "rows x world is not the global batch when documents are packed"


@pytest.mark.slow
def test_exporting_an_unfinished_run_says_so_and_serving_a_custom_run_is_a_serve_error(tmp_path, capsys):
    import shutil

    from ddptrain.export import main as export_main
    from ddptrain.serving.servable import ServableError, servable_dir
    from tests.helpers import TINY_RUN, run_cli

    small = [*TINY_RUN, "batch.seq_len=32", "batch.global_size=4", "batch.micro_size=2", "trainer.max_steps=2"]
    gpt = tmp_path / "gpt"
    assert run_cli([*small, f"run.dir={gpt}", "checkpoint.every=1"]).returncode == 0
    shutil.rmtree(gpt / "final")  # as if the run were still going
    export_main([str(gpt), str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert "has no final/ yet" in err and "step_00000002" in err, err
    custom = tmp_path / "custom"
    result = run_cli([*(arg for arg in small if not arg.startswith("model.")), "model=custom", "model._target_=tests.toy_models.make_conv_lm", f"run.dir={custom}"])
    assert result.returncode == 0, result.stderr[-2000:]
    with pytest.raises(ServableError, match=r"cannot be served: model class tests.toy_models.CausalConvLM has no "
                                            r"transformers architecture"):
        servable_dir(custom)
