"""Resumes notice changed inputs: the checkpoint records a fingerprint of what defines the run beyond
its config, and a difference is refused with the key, old and new value;
checkpoint.accept_changed_data accepts a changed corpus with a warning."""

from __future__ import annotations

import json

import pytest

from ddptrain.data.cache import relative_stamps
from ddptrain.models.adapters import HFAdapter
from ddptrain.runs import store as ckpt
from ddptrain.runs.fingerprint import check_fingerprint, run_fingerprint
from ddptrain.runs.resume import check_config
from tests.helpers import TINY_RUN, read_metrics, run_cli


def _corpus(directory, *names):
    directory.mkdir(exist_ok=True)
    for name in names:
        (directory / name).write_text(f"{name}\n" * 50)
    return sorted(directory.glob("*.txt"))


def test_a_changed_hf_config_json_is_refused_by_key(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"rms_norm_eps": 1e-6, "num_hidden_layers": 2,
                                                      "_name_or_path": "/elsewhere", "transformers_version": "4"}))
    before = run_fingerprint(HFAdapter().architecture({"path": str(tmp_path)}), {})
    assert "_name_or_path" not in before["model"], "where a model was saved from does not define it"
    (tmp_path / "config.json").write_text(json.dumps({"rms_norm_eps": 0.1, "num_hidden_layers": 3}))
    after = run_fingerprint(HFAdapter().architecture({"path": str(tmp_path)}), {})
    with pytest.raises(ckpt.CheckpointError, match=r"model.num_hidden_layers: 2 -> 3; model.rms_norm_eps: 1e-06 -> 0.1"):
        check_fingerprint(before, after, accept_changed_data=True)  # the override is for the corpus only


def test_a_changed_corpus_is_refused_by_file_and_accepted_with_a_warning_on_request(tmp_path, caplog):
    files = _corpus(tmp_path / "corpus", "a.txt", "b.txt")
    before = run_fingerprint({}, {"train": relative_stamps(files), "documents": 2})
    moved = tmp_path / "moved"
    (tmp_path / "corpus").rename(moved)
    assert relative_stamps(sorted(moved.glob("*.txt"))) == before["data"]["train"], "a corpus moved whole is the same"
    files = _corpus(moved, "c.txt")  # a new file matching the glob
    after = run_fingerprint({}, {"train": relative_stamps(files), "documents": 3})
    with pytest.raises(ckpt.CheckpointError, match=r"data.documents: 2 -> 3; data.train.c.txt: None -> \[.*"
                                                   r"checkpoint.accept_changed_data=true"):
        check_fingerprint(before, after, accept_changed_data=False)
    with caplog.at_level("WARNING", logger="ddptrain"):
        check_fingerprint(before, after, accept_changed_data=True)
    assert "the data order differs from here on" in caplog.text
    assert check_fingerprint(None, after, accept_changed_data=False) == [], "a checkpoint from before fingerprints"


@pytest.mark.slow
def test_a_corpus_appended_to_between_runs_is_refused_on_resume(tmp_path):
    corpus = tmp_path / "corpus"
    _corpus(corpus, "a.txt", "b.txt", "c.txt")
    run = [*TINY_RUN, "data=text", f"data.paths=[{corpus}/*.txt]", "data.split_by=paragraph", "data.max_docs=null",
           f"data.cache_dir={tmp_path / 'cache'}", "batch.seq_len=32", "batch.global_size=4", "batch.micro_size=2",
           f"run.dir={tmp_path / 'run'}"]
    first = run_cli([*run, "trainer.max_steps=2"])
    assert first.returncode == 0, first.stderr[-3000:]
    assert "inputs fingerprinted in" in first.stderr
    with open(corpus / "a.txt", "a") as handle:
        handle.write("\n\nanother paragraph\n")
    refused = run_cli([*run, "trainer.max_steps=3"])
    assert refused.returncode == 2 and "data.train.a.txt" in refused.stderr, refused.stderr[-3000:]
    accepted = run_cli([*run, "trainer.max_steps=3", "checkpoint.accept_changed_data=true"])
    assert accepted.returncode == 0, accepted.stderr[-3000:]
    assert "the data order differs from here on" in accepted.stderr
    assert "of start-up so far" in accepted.stderr


def test_input_paths_may_change_only_where_the_checkpoint_fingerprints_what_they_hold():
    saved = {"data": {"paths": ["/old/corpus/*.txt"], "tokenizer": "/old/tok.json"}, "model": {"path": "/old/m"}}
    current = {"data": {"paths": ["corpus/*.txt"], "tokenizer": "/new/tok.json"}, "model": {"path": "/new/m"}}
    assert [key for key, _, _ in check_config(saved, current, {}, fingerprinted=True)] == [
        "data.paths", "data.tokenizer", "model.path"]
    with pytest.raises(ckpt.CheckpointError, match=r"data.paths: \['/old/corpus/\*.txt'\] -> \['corpus/\*.txt'\]"):
        check_config(saved, current, {}, fingerprinted=False)  # an older checkpoint: nothing guards the content
    with pytest.raises(ckpt.CheckpointError, match="data.split_by"):
        check_config({"data": {"split_by": "file"}}, {"data": {"split_by": "paragraph"}}, {}, fingerprinted=True)


@pytest.mark.slow
def test_a_corpus_moved_whole_and_spelled_relatively_resumes_the_same_run(tmp_path):
    """Trained on /abs/corpus, the corpus moved, resumed as `moved/*.txt` from another directory: the
    config's data.paths differs but the fingerprint (and the hash split) do not, so the run resumes and
    its steps are those of the run that never stopped."""
    corpus = tmp_path / "corpus"
    _corpus(corpus, "a.txt", "b.txt", "c.txt", "d.txt")
    common = [*TINY_RUN, "data=text", "data.split_by=paragraph", "data.max_docs=null", "data.val_percent=30",
              f"data.cache_dir={tmp_path / 'cache'}", "batch.seq_len=32", "batch.global_size=4",
              "batch.micro_size=2", "optim.decay_steps=6", "checkpoint.every=2"]
    straight = run_cli([*common, f"data.paths=[{corpus}/*.txt]", f"run.dir={tmp_path / 'straight'}",
                        "trainer.max_steps=6"])
    assert straight.returncode == 0, straight.stderr[-3000:]
    first = run_cli([*common, f"data.paths=[{corpus}/*.txt]", f"run.dir={tmp_path / 'run'}", "trainer.max_steps=4"])
    assert first.returncode == 0, first.stderr[-3000:]
    corpus.rename(tmp_path / "moved")
    resumed = run_cli([*common, "data.paths=[moved/*.txt]", f"run.dir={tmp_path / 'run'}", "trainer.max_steps=6"],
                      cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "data.paths changed from" in resumed.stderr and "their fingerprint is compared" in resumed.stderr
    losses = {row["step"]: row["loss"] for row in read_metrics(tmp_path / "run") if "loss" in row}
    expected = {row["step"]: row["loss"] for row in read_metrics(tmp_path / "straight") if "loss" in row}
    assert losses == expected and sorted(losses) == [1, 2, 3, 4, 5, 6]


def test_a_changed_tokenizer_class_is_refused_and_a_checkpoint_from_before_it_was_recorded_resumes():
    """data=sft's tokenizer class (config.json's model_type can pick it) is fingerprinted; a checkpoint of an
    older ddptrain, which did not record it, is not compared on it, so the upgrade still resumes."""
    inputs = {"source": "sft", "tokenizer": "chat:abc", "documents": 5}
    before = run_fingerprint({}, {**inputs, "tokenizer_class": "PreTrainedTokenizerFast"})
    after = run_fingerprint({}, {**inputs, "tokenizer_class": "Qwen2TokenizerFast"})
    with pytest.raises(ckpt.CheckpointError, match="data.tokenizer_class: 'PreTrainedTokenizerFast' -> "
                                                   "'Qwen2TokenizerFast'"):
        check_fingerprint(before, after, accept_changed_data=False)
    assert check_fingerprint(run_fingerprint({}, inputs), after, accept_changed_data=False) == []
    with pytest.raises(ckpt.CheckpointError, match="data.documents: 5 -> 6"):  # other keys are still compared
        check_fingerprint(run_fingerprint({}, inputs), {**after, "data": {**after["data"], "documents": 6}}, False)


def test_the_same_files_made_into_other_targets_by_an_upgrade_are_refused_on_resume(tmp_path, monkeypatch):
    """Every stamp of the corpus stayed the same when a ddptrain upgrade tokenized or masked the same
    files another way (the chat target fix of CACHE_VERSION 6): the new cache entry was built and the
    resume went on, silently, on other targets. The count of valid training targets is fingerprinted."""
    from ddptrain.config import DataConfig
    from ddptrain.data import cache, load_splits
    from ddptrain.data.tokenizer import ByteTokenizer

    files = _corpus(tmp_path / "corpus", "a.txt", "b.txt", "c.txt")
    cfg = DataConfig(name="text", paths=[str(path) for path in files], val_percent=0.0, max_docs=None,
                     val_paths=[str(files[-1])], cache_dir=str(tmp_path / "cache"), tokenizer="byte")
    before = run_fingerprint({}, load_splits(cfg, 32, local_rank=0).fingerprint)
    cfg.cache_dir = str(tmp_path / "another-cache")  # rebuilt by the same ddptrain: the same inputs
    assert check_fingerprint(before, run_fingerprint({}, load_splits(cfg, 32, local_rank=0).fingerprint),
                             accept_changed_data=False) == []

    encode_batch = ByteTokenizer.encode_batch  # "the upgrade": the last byte of each document dropped
    monkeypatch.setattr(ByteTokenizer, "encode_batch", lambda self, texts: [ids[:-1] for ids in encode_batch(self, texts)])
    monkeypatch.setattr(cache, "CACHE_VERSION", cache.CACHE_VERSION + 1)
    after = run_fingerprint({}, load_splits(cfg, 32, local_rank=0).fingerprint)
    assert after["data"]["train"] == before["data"]["train"] and after["data"]["documents"] == before["data"]["documents"]
    with pytest.raises(ckpt.CheckpointError, match=r"data.targets: (\d+) -> (?!\1)\d+\. .*The same files now make other "
                                                   r"targets: this ddptrain tokenizes or masks them otherwise"):
        check_fingerprint(before, after, accept_changed_data=False)
    older = {"model": {}, "data": {key: value for key, value in before["data"].items() if key != "targets"}}
    assert check_fingerprint(older, after, accept_changed_data=False) == [], "a checkpoint from before the count"
