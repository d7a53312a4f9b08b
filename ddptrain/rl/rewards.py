"""Reward functions: TRL's signature, ddptrain's built-ins, and their weighted sum.

A reward function is called as TRL calls it, `f(prompts, completions, **fields) -> list[float | None]`:
`prompts` and `completions` are parallel lists (a completion is a string, or for a prompt given as
messages TRL's `[{"role": "assistant", "content": text}]`), and each other field of the prompt
records is a keyword argument holding one value per completion. None means "does not apply" and
counts as 0 in the weighted sum (TRL's nansum); NaN skips the step (ddptrain/rl/step.py).
"""

from __future__ import annotations

import importlib
import math
import re
from dataclasses import dataclass
from typing import Any, Callable

from ddptrain.config.schema import ConfigError, RewardConfig


class RewardError(RuntimeError):
    """A reward function raised or returned what a reward cannot be; the message names it and the prompt."""


_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_answer(text: str) -> str | None:
    """The final answer of a completion: after the last `####`, else in the last `\\boxed{}`, else the
    last number; None when there is none."""
    if "####" in text:
        answer = text.rsplit("####", 1)[1].strip().splitlines()
        return answer[0].strip() if answer else None
    boxed = _BOXED.findall(text)
    if boxed:
        return boxed[-1].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _normal(answer: Any) -> str:
    """Numbers compared as numbers ("1,000" == "1000.0"), anything else as stripped text."""
    text = str(answer).strip().rstrip(".")
    try:
        return repr(float(text.replace(",", "")))
    except ValueError:
        return text


def _text(completion: Any) -> str:
    if isinstance(completion, list):  # TRL's conversational completion: [{"role": "assistant", "content": ...}]
        return "".join(str(message.get("content", "")) for message in completion)
    return str(completion)


def exact_match(answer_field: str) -> Callable:
    """Reward 1 where the completion's final answer equals the record's `answer_field`, else 0."""
    def exact_match(prompts, completions, **fields) -> list[float]:
        if answer_field not in fields:
            raise KeyError(f"the prompt records have no field {answer_field!r} (reward.answer_field); they have "
                           f"{sorted(fields)}")
        rewards = []
        for completion, expected in zip(completions, fields[answer_field]):
            found = final_answer(_text(completion))
            rewards.append(float(found is not None and _normal(found) == _normal(expected)))
        return rewards
    return exact_match


def format_reward(pattern: str) -> Callable:
    """Reward 1 where the whole completion matches `pattern` (re.fullmatch, DOTALL), else 0."""
    compiled = re.compile(pattern, re.DOTALL)

    def format(prompts, completions, **fields) -> list[float]:
        return [float(compiled.fullmatch(_text(completion)) is not None) for completion in completions]
    return format


def _import(path: str) -> Callable:
    module_name, _, attribute = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # noqa: BLE001 - any failure to import is the user's path
        raise ConfigError(f"reward.functions: {path!r}: module {module_name!r} does not import "
                          f"({type(error).__name__}: {error})") from None
    function = getattr(module, attribute, None)
    if not callable(function):
        raise ConfigError(f"reward.functions: {path!r}: module {module_name!r} has no callable {attribute!r}")
    return function


@dataclass
class Scores:
    """The rewards of a list of completions."""

    total: list[float]
    """The weighted sum per completion (None counted as 0); NaN where a function returned NaN."""
    per_function: dict[str, list[float]]
    """Each function's own rewards by its name (None as NaN: left out of its mean)."""


class Rewards:
    """reward.functions with their weights; `score` checks what each returns."""

    def __init__(self, cfg: RewardConfig):
        re_error = None
        try:
            re.compile(cfg.format_pattern)
        except re.error as error:
            re_error = error
        self.functions: list[tuple[str, Callable, float]] = []
        weights = list(cfg.weights) if cfg.weights is not None else [1.0] * len(cfg.functions)
        for name, weight in zip(cfg.functions, weights):
            if name == "exact_match":
                function = exact_match(cfg.answer_field)
            elif name == "format":
                if re_error is not None:
                    raise ConfigError(f"reward.format_pattern={cfg.format_pattern!r} is not a regular expression: "
                                      f"{re_error}")
                function = format_reward(cfg.format_pattern)
            else:
                function = _import(name)
            self.functions.append((name, function, float(weight)))

    @property
    def names(self) -> list[str]:
        return [name for name, _, _ in self.functions]

    def score(self, prompts: list, completions: list, fields: list[dict], names: list[str]) -> Scores:
        """Rewards of completions[i] of prompts[i] (the record fields[i], named names[i]); a function that
        raises or returns a list of another length is a RewardError naming it and the prompt."""
        keys = sorted({key for record in fields for key in record})
        columns = {key: [record.get(key) for record in fields] for key in keys}
        total = [0.0] * len(completions)
        per_function = {}
        for name, function, weight in self.functions:
            try:
                values = function(prompts=prompts, completions=completions, **columns)
            except Exception as error:  # noqa: BLE001 - the user's function: named, with the prompt
                raise RewardError(f"reward function {name} raised {type(error).__name__}: {error} (scoring "
                                  f"{len(completions)} completions, the first of prompt {names[0]})") from error
            if not isinstance(values, (list, tuple)) or len(values) != len(completions):
                got = f"{len(values)} values" if isinstance(values, (list, tuple)) else type(values).__name__
                raise RewardError(f"reward function {name} returned {got} for {len(completions)} completions (of "
                                  f"prompts {names[0]} ...): it must return one float or None per completion")
            own = []
            for i, value in enumerate(values):
                if value is None:
                    own.append(math.nan)
                    continue
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise RewardError(f"reward function {name} returned {value!r} for a completion of prompt "
                                      f"{names[i]}: a reward is a float or None")
                own.append(float(value))
                total[i] += weight * float(value)  # NaN stays NaN: the step is skipped
            per_function[name] = own
        return Scores(total, per_function)
