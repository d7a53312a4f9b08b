"""data=mixture's bad input, refused before anything is written, each naming the source and the rule."""

from __future__ import annotations

import pytest

from ddptrain.config.compose import compose_config
from ddptrain.config.schema import ConfigError
from ddptrain.config.validation import mixture_sources, refuse_repeated_sources
from ddptrain.train.builder import validate_run


def _refusal(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as error:
        validate_run(compose_config(["data=mixture", *overrides]), 1)
    return str(error.value)


def _sources(text: str) -> str:
    return f"data.sources={{{text}}}"


@pytest.mark.parametrize("sources, message", [
    ("web: {name: text, paths: [a.txt], weight: -1}",
     "data.sources.web.weight=-1 must be a finite number >= 0"),
    ("web: {name: text, paths: [a.txt], weight: nan}", "data.sources.web.weight=nan must be a finite number >= 0"),
    ("web: {name: text, paths: [a.txt], weight: heavy}",
     "data.sources.web.weight='heavy' must be a finite number >= 0"),
    ("web: {name: text, paths: [a.txt], weight: '0.5'}", "data.sources.web.weight='0.5' must be a finite number"),
    ("web: {name: text, paths: [a.txt], weight: 0}, code: {name: jsonl, paths: [b.jsonl], weight: 0}",
     "data.sources: every weight is 0 (web=0, code=0): at least one must be > 0"),
    ("web: {name: text, paths: [a.txt]}, pairs: {name: preference, paths: [p.jsonl]}",
     "data.sources.pairs (name=preference) cannot mix with data.sources.web (name=text)"),
    ("web: {name: text, paths: []}", "data.sources.web.paths is empty"),
    ("web: {name: text}", "data.sources.web.paths is empty"),
    ("web: {name: text, paths: [a.txt], colour: red}", "data.sources.web.colour is not a config key"),
    ("web: {name: text, paths: [a.txt], wieght: 2}", "data.sources.web.wieght is not a config key (did you mean "
                                                     "data.sources.web.weight?)"),
    ("web: {name: text, paths: [a.txt], field: body}",
     "data.sources.web (name=text): data.sources.web.field is read only when the source's name is jsonl or hf"),
    ("web: {name: stdlib, paths: [a.txt]}", "data.sources.web.name='stdlib' must be the source's kind, one of text"),
    ("web: {paths: [a.txt]}", "data.sources.web.name=None must be the source's kind"),
    ("web: {name: text, paths: [a.txt], max_repeat: -1}", "data.sources.web.max_repeat=-1 must be an integer >= 0"),
    ("web: {name: text, paths: [a.txt], on_exhausted: wrap}",
     "data.sources.web.on_exhausted='wrap' is not one of error, renormalize"),
    ("web: {name: text, paths: [a.txt], split_by: line}",
     "data.sources.web.split_by='line' is not one of file, paragraph"),
    ("web: {name: tokens, paths: [a.bin]}", "data.sources.web (name=tokens): data.vocab_size is required for "
                                            "data=tokens"),
])
def test_a_bad_source_is_a_config_error_naming_the_source_and_the_rule(sources, message):
    assert message in _refusal([_sources(sources)])


def test_a_source_name_must_be_able_to_name_its_metrics():
    """Hydra's command line takes no such key, a YAML file does."""
    cfg = compose_config(["data=mixture"])
    cfg.data.sources = {"web/x": {"name": "text", "paths": ["a.txt"]}}
    with pytest.raises(ConfigError, match="data.sources.web/x: the source's name 'web/x' must be a name of letters"):
        mixture_sources(cfg.data)


def test_a_mixture_needs_sources_and_a_plain_source_takes_none():
    assert "data.sources is empty: data=mixture needs sources" in _refusal([])
    assert "data.paths / data.val_paths are not used by data=mixture" in _refusal(
        ["data.paths=[a.txt]", _sources("web: {name: text, paths: [a.txt]}")])
    with pytest.raises(ConfigError, match="data.sources applies to data=mixture only, not data=text"):
        validate_run(compose_config(["data=text", "data.paths=[a.txt]", _sources("web: {name: text}")]), 1)


def test_a_source_named_twice_on_the_command_line_is_refused():
    """Hydra's dict literal keeps the last of two equal keys; the command line's text is read instead
    (a YAML file of the user's config group refuses a duplicate key when OmegaConf loads it)."""
    refuse_repeated_sources([_sources("web: {name: text, paths: [a.txt]}, code: {name: jsonl, paths: [b]}")])
    for text in ("web: {name: text, paths: [a.txt]}, web: {name: jsonl, paths: [b.jsonl]}",
                 "web: {name: text, paths: ['a:b.txt']}, 'web': {name: text, paths: [c.txt]}"):
        with pytest.raises(ConfigError, match="data.sources names web more than once"):
            refuse_repeated_sources([_sources(text)])


def test_the_other_data_keys_apply_to_every_source_unless_it_sets_its_own():
    cfg = compose_config(["data=mixture", "data.val_percent=20", "data.split_by=paragraph", _sources(
        "web: {name: text, paths: [a.txt], weight: 0.7}, "
        "books: {name: text, paths: [b.txt], split_by: file, val_percent: 0, weight: 0.3, max_repeat: 2}")])
    validate_run(cfg, 1)
    (web, web_cfg, web_mix), (books, books_cfg, books_mix) = mixture_sources(cfg.data)
    assert (web, web_cfg.split_by, web_cfg.val_percent, web_mix.weight) == ("web", "paragraph", 20.0, 0.7)
    assert (books, books_cfg.split_by, books_cfg.val_percent, books_mix.max_repeat) == ("books", "file", 0.0, 2)
    assert web_mix.max_repeat is None and web_mix.on_exhausted == "error"
