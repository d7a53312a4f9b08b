"""data=preference: TRL's preference pairs tokenized as TRL's DPOTrainer tokenizes them, bad records
named by file:line, and every layout keeping a pair's chosen and rejected in one microbatch."""

from __future__ import annotations

import logging
import types

import pytest

from ddptrain.config import DataConfig
from ddptrain.config.compose import compose_config
from ddptrain.config.schema import ConfigError
from ddptrain.config.validation import validate
from ddptrain.contract.targets import IGNORE_INDEX
from ddptrain.data import DataError, TrainBatches, load_splits
from ddptrain.data.preference import PreferencePairs
from tests.data.chats import save_chat_tokenizer, write_jsonl
from tests.data.pairs import random_pairs
from tests.helpers import import_optional

transformers = import_optional("transformers")
SEQ = 96


def _cfg(tmp_path, paths, tokenizer_dir, **settings) -> DataConfig:
    return DataConfig(name="preference", paths=[str(p) for p in paths],
                      tokenizer=str(tokenizer_dir / "tokenizer.json"), cache_dir=str(tmp_path / "cache"), **settings)


def _load(tmp_path, records, tokenizer_dir=None, seq_len=SEQ, **settings):
    tokenizer_dir = tokenizer_dir or save_chat_tokenizer(tmp_path / "tok")
    path = write_jsonl(tmp_path / "p.jsonl", records)
    return load_splits(_cfg(tmp_path, [path], tokenizer_dir, val_percent=0.0, **settings), seq_len)


def _sequences(pairs: PreferencePairs) -> list[tuple[list[int], list[int]]]:
    """(tokens, completion mask) of every sequence, chosen then rejected per pair."""
    out = []
    examples = pairs.sequences
    for index in range(len(examples)):
        start, length = int(examples.starts[index]), int(examples.lengths[index])
        out.append((examples.tokens[start : start + length].tolist(), examples.mask[start : start + length].tolist()))
    return out


def trl_tokenized(records: list[dict], tokenizer_dir, max_length=None) -> list[dict]:
    """TRL DPOTrainer's own preprocessing (`_prepare_dataset`: EOS, tokenization, prompt split) of `records`."""
    datasets = import_optional("datasets")
    trl = import_optional("trl")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    args = trl.DPOConfig(output_dir="unused", max_length=max_length, report_to=[], bf16=False, use_cpu=True)
    trainer = types.SimpleNamespace(_tokenizer=tokenizer)  # the only attribute the method reads
    return list(trl.DPOTrainer._prepare_dataset(trainer, datasets.Dataset.from_list(records), tokenizer, args, "train"))


def _trl_sequences(rows: list[dict]) -> list[tuple[list[int], list[int]]]:
    out = []
    for row in rows:
        for key in ("chosen_ids", "rejected_ids"):
            out.append((row["prompt_ids"] + row[key], [0] * len(row["prompt_ids"]) + [1] * len(row[key])))
    return out


# -- tokens ------------------------------------------------------------------------------------


@pytest.mark.parametrize("conversational", [False, True], ids=["standard", "conversational"])
@pytest.mark.slow  # over 4 s (a process launch or ranks): out of the fast tier
def test_pairs_give_the_token_ids_of_trl_dpo_trainer(tmp_path, conversational):
    directory = save_chat_tokenizer(tmp_path / "tok")
    records = random_pairs(40, seed=1, conversational=conversational)
    if not conversational:  # a completion that already ends with EOS keeps it once; a prompt ending in a space
        records[0]["chosen"] += "<eos>"
        records[1]["prompt"] += " "
    data = _load(tmp_path, records, directory, seq_len=400)
    assert data.train.documents + data.val.documents == len(records)
    got = _sequences(data.train) + _sequences(data.val)
    assert sorted(got) == sorted(_trl_sequences(trl_tokenized(records, directory)))
    assert got[:2] != [] and all(mask[0] == 0 for _, mask in got)


def test_a_saved_hugging_face_dataset_gives_the_same_pairs_as_jsonl(tmp_path):
    datasets = import_optional("datasets")
    directory = save_chat_tokenizer(tmp_path / "tok")
    records = random_pairs(12, seed=2, conversational=True)
    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "ds"))
    from_dir = load_splits(_cfg(tmp_path, [tmp_path / "ds"], directory, val_percent=0.0), SEQ)
    from_jsonl = _load(tmp_path, records, directory)
    assert _sequences(from_dir.train) + _sequences(from_dir.val) == _sequences(from_jsonl.train) + \
        _sequences(from_jsonl.val)


def test_the_cache_is_built_once_and_reused(tmp_path, caplog):
    directory = save_chat_tokenizer(tmp_path / "tok")
    cfg = _cfg(tmp_path, [write_jsonl(tmp_path / "p.jsonl", random_pairs(10))], directory, val_percent=0.0)
    with caplog.at_level(logging.INFO, logger="ddptrain"):
        first = load_splits(cfg, SEQ)
        second = load_splits(cfg, SEQ)
    assert "built" in caplog.text and "reused" in caplog.text
    assert _sequences(first.train) == _sequences(second.train)


# -- truncation ---------------------------------------------------------------------------------


@pytest.mark.slow  # a trained run or a process launch (seconds): out of the fast tier
def test_truncation_right_cuts_both_sequences_as_trl_keep_start_does(tmp_path):
    directory = save_chat_tokenizer(tmp_path / "tok")
    records = random_pairs(30, seed=3)
    span = 16  # batch.seq_len + 1 tokens = TRL's max_length
    data = _load(tmp_path, records, directory, seq_len=span - 1, truncation="right")
    got = _sequences(data.train) + _sequences(data.val)
    expected = [(ids[:span], mask[:span]) for ids, mask in _trl_sequences(trl_tokenized(records, directory, span))]
    expected_pairs = [tuple(expected[i : i + 2]) for i in range(0, len(expected), 2)]
    kept = [pair for pair in expected_pairs if all(sum(mask[1:]) for _, mask in pair)]  # TRL drops the others
    assert sorted(got) == sorted(sequence for pair in kept for sequence in pair)


def test_drop_skips_a_pair_with_a_long_sequence_counted_and_warned(tmp_path, caplog):
    records = [*random_pairs(4, seed=4), {"prompt": "hello", "chosen": " the" * 60, "rejected": " a"}]
    with caplog.at_level(logging.WARNING, logger="ddptrain"):
        data = _load(tmp_path, records, seq_len=40)
    assert data.train.documents + data.val.documents == 4
    assert f"skipped 1 pair(s) with a sequence longer than batch.seq_len + 1 = 41 tokens (data.truncation=drop), " \
           f"e.g. {tmp_path / 'p.jsonl'}:5" in caplog.text


# -- bad input: the table in docs/data.md --------------------------------------------------------

USER = [{"role": "user", "content": "hello"}]
FINE = [{"role": "assistant", "content": "fine"}]
BAD_RECORDS = [
    ({"prompt": "hello", "chosen": " fine"}, r"no field 'rejected' \(a preference pair needs 'prompt', 'chosen' and "
                                             r"'rejected'\); the record has \['chosen', 'prompt'\]"),
    ({"chosen": " fine", "rejected": " bad"}, r"no field 'prompt'"),
    ({"prompt": "hello", "chosen": " fine", "rejected": "  "}, r"the rejected completion is empty: nothing to prefer"),
    ({"prompt": "hello", "chosen": FINE, "rejected": " bad"},
     r"prompt, chosen and rejected are str, list and str: all three must be strings, or all three lists of messages"),
    ({"prompt": USER, "chosen": [], "rejected": FINE},
     r"the chosen completion is an empty list, not a list of messages"),
    ({"prompt": USER, "chosen": [{"role": "bot", "content": "x"}], "rejected": FINE},
     r"message 1 has role 'bot', which is not one of system, user, assistant, tool"),
    ({"prompt": "", "chosen": " fine", "rejected": " bad"},
     r"the prompt gives no token before the completions \(an empty prompt, and a tokenizer without BOS\)"),
    ({"prompt": USER, "chosen": [{"role": "assistant", "content": "fine<|im_end|>"}], "rejected": FINE},
     r"message 1 \(assistant\) of the chosen completion holds '<\|im_end\|>', the text of a special token"),
    (["hello"], r"the line is a JSON list, not an object"),
]


@pytest.mark.parametrize("record, message", BAD_RECORDS, ids=[m[:30] for _, m in BAD_RECORDS])
def test_bad_records_stop_with_the_file_line_and_the_rule(tmp_path, record, message):
    path = tmp_path / "p.jsonl"
    with pytest.raises(DataError, match=rf"{path}:2: {message}"):
        _load(tmp_path, [random_pairs(1)[0], record])
    assert not [p for p in (tmp_path / "cache").iterdir() if ".tmp-" in p.name or (p / "meta.json").exists()], \
        "a failed build leaves nothing half-written in the cache"


def test_a_pair_longer_than_the_span_is_an_error_with_truncation_error(tmp_path):
    records = [random_pairs(1)[0], {"prompt": "hello", "chosen": " the" * 60, "rejected": " a"}]
    with pytest.raises(DataError, match=rf"{tmp_path / 'p.jsonl'}:2: the pair has a sequence of \d+ tokens, more than "
                                        r"batch.seq_len \+ 1 = 41 \(data.truncation=error; 'drop' skips the pair"):
        _load(tmp_path, records, seq_len=40, truncation="error")


def test_identical_completions_and_pairs_without_targets_are_skipped_counted_and_warned(tmp_path, caplog):
    records = [*random_pairs(4, seed=5), {"prompt": "hello", "chosen": " same", "rejected": " same"},
               {"prompt": "the " * 30, "chosen": " fine", "rejected": " bad"}]
    with caplog.at_level(logging.WARNING, logger="ddptrain"):
        data = _load(tmp_path, records, seq_len=20, truncation="right")
    assert data.train.documents + data.val.documents <= 4
    path = tmp_path / "p.jsonl"
    assert f"skipped 1 pair(s) whose chosen and rejected completions are the same tokens (nothing to prefer), " \
           f"e.g. {path}:5" in caplog.text
    assert f"skipped 1 pair(s) with a completion left without any target after truncation, e.g. {path}:6" in caplog.text


def test_a_corpus_whose_every_pair_is_skipped_says_how_many_were_read_and_why_each_was_dropped(tmp_path):
    """It said only 'the corpus is empty'."""
    records = [{"prompt": "hello", "chosen": " same", "rejected": " same"},
               {"prompt": "the " * 30, "chosen": " fine", "rejected": " bad"},
               {"prompt": "hi", "chosen": " yes", "rejected": " yes"}]
    path = tmp_path / "p.jsonl"
    with pytest.raises(DataError) as error:
        _load(tmp_path, records, seq_len=20, truncation="right")
    assert str(error.value) == (
        "the corpus is empty: no preference pair with targets in data.paths (read 3 pair(s): skipped 2 pair(s) whose "
        f"chosen and rejected completions are the same tokens (nothing to prefer), e.g. {path}:1; skipped 1 pair(s) "
        f"with a completion left without any target after truncation, e.g. {path}:2)")


def test_pairs_cut_by_truncation_are_warned_in_plain_words(tmp_path, caplog):
    """It said 'cut 1 pair(s) cut at'."""
    records = [*random_pairs(4, seed=4), {"prompt": "hello", "chosen": " the" * 60, "rejected": " a"}]
    with caplog.at_level(logging.WARNING, logger="ddptrain"):
        _load(tmp_path, records, seq_len=40, truncation="right")
    assert "cut 1 pair(s) at batch.seq_len + 1 = 41 tokens (data.truncation=right), e.g. " \
           f"{tmp_path / 'p.jsonl'}:5" in caplog.text, caplog.text
    assert "cut at" not in caplog.text


def test_the_byte_tokenizer_by_default_is_refused_in_the_words_of_data_preference(tmp_path):
    """data.tokenizer left unset (the byte tokenizer) was refused as 'data=sft needs a real tokenizer'."""
    path = write_jsonl(tmp_path / "p.jsonl", random_pairs(2))
    config = DataConfig(name="preference", paths=[str(path)], cache_dir=str(tmp_path / "cache"))
    with pytest.raises(DataError, match=r"^data=preference needs a real tokenizer with an EOS token, not the byte "):
        load_splits(config, SEQ)


def test_the_byte_tokenizer_is_refused():
    cfg = compose_config(["data=preference", "objective=dpo", "data.paths=[p.jsonl]", "data.tokenizer=byte"])
    with pytest.raises(ConfigError, match="data=preference needs a real tokenizer with an EOS token and a chat "
                                          "template, not data.tokenizer=byte"):
        validate(cfg, 1)


# -- layouts ------------------------------------------------------------------------------------


def _pairs_of(microbatch) -> list[tuple[list[int], list[int]]]:
    """The (chosen, rejected) token lists of each pair of a microbatch, read back from its tensors."""
    inputs, pairs = microbatch
    ids = inputs["idx"] if isinstance(inputs, dict) else inputs
    sequences = {}
    for s in range(pairs.count):
        where = pairs.sequences == s
        sequences[s] = pairs.tokens[where].tolist()
        assert sequences[s], "every sequence has targets"
        rows = where.nonzero()[:, 0].unique()
        assert len(rows) == 1, "a sequence lies in one row"
        assert ids[where].numel() == len(sequences[s])
    return [(sequences[2 * k], sequences[2 * k + 1]) for k in range(pairs.pairs)]


@pytest.mark.parametrize("layout", [dict(micro=2), dict(micro=3), dict(micro_tokens=200), dict(pack=True),
                                    dict(pack=True, micro_tokens=200)], ids=str)
def test_every_layout_keeps_each_pair_whole_in_one_microbatch_and_the_step_the_same(tmp_path, layout):
    data = _load(tmp_path, random_pairs(48, seed=6), seq_len=64)
    reference = TrainBatches(data.train, 12, 12, seed=3, rank=0, world_size=1)
    for step in range(3):
        expected = sorted(_pairs_of(reference.microbatches(step)[0]))
        got = []
        for rank in range(2):
            batches = TrainBatches(data.train, 12, layout.get("micro", 2), seed=3, rank=rank, world_size=2,
                                   micro_tokens=layout.get("micro_tokens"), pack=layout.get("pack", False),
                                   seq_len=64)
            for microbatch in batches.microbatches(step):
                got += _pairs_of(microbatch)
        assert sorted(got) == expected
    assert not any(IGNORE_INDEX == t for t in expected[0][0])
