"""Multiple-choice tasks in lm-evaluation-harness's log-likelihood form: a component of the loop
(train/components.py) that scores trainer.eval_tasks on the evaluator's schedule, and the scoring
that `python -m ddptrain.evaluate` runs on a finished model.

A task is a JSONL file, one item a line: {"context": str, "choices": [str, ...], "label": int}, and
optionally "target_delimiter" (lm-evaluation-harness's, default " "). Each choice is scored as the
sum of its tokens' log-probabilities given the context, the pair encoded as the harness encodes it
(`encode_pair`): context + delimiter + choice encoded whole without special tokens, the context's
own tokens cut from the front, trailing spaces of the context moved to the continuation, the row
left-truncated to the model's length. `acc`: the argmax is the label; `acc_norm`: the argmax of
the sum divided by the choice's length in UTF-8 bytes. With a chat template the context is a user
turn with the generation prompt, and the delimiter is dropped (the harness does the same).

Items are strided over the ranks (an item's choices stay on one rank), cut into microbatches like
the training's (batch.micro_size rows, or batch.micro_tokens padded positions, or under packing the
positions of a training microbatch), and the per-task counts all-reduced: any world size gives the
same numbers. Every rank runs the same number of forwards (fillers), as sharded strategies gather
weights collectively.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ddptrain.config.evaluation import task_name
from ddptrain.config.layout import eval_micro_tokens
from ddptrain.config.schema import TrainConfig
from ddptrain.contract.targets import IGNORE_INDEX
from ddptrain.data.batches import budget_microbatches
from ddptrain.data.global_batch import split_micro
from ddptrain.data.sources import DataError
from ddptrain.distributed import DistInfo, all_reduce_sum, is_distributed
from ddptrain.train.components import StepEnd

log = logging.getLogger(__name__)

Encode = Callable[[str], list[int]]
"""Text -> token ids, without special tokens."""
Forward = Callable[[torch.Tensor], torch.Tensor]
"""(B, T) ids -> (B, T, V) logits."""


@dataclass(frozen=True)
class Item:
    context: str
    choices: tuple[str, ...]
    label: int
    target_delimiter: str = " "


@dataclass(frozen=True)
class Task:
    name: str
    items: tuple[Item, ...]


def read_task(path: str | Path) -> Task:
    """A task file; a DataError names the line and the rule it breaks."""
    path = Path(path).expanduser()
    items = []
    for number, line in enumerate(_task_text(path).splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except ValueError as error:
            raise DataError(f"{where}: not JSON ({error})") from None
        context, choices, label = record.get("context"), record.get("choices"), record.get("label")
        if not isinstance(context, str) or not context:
            raise DataError(f"{where}: context={context!r} must be a non-empty string (lm-evaluation-harness "
                            "scores an empty context after a BOS token, which a plain tokenizer does not have)")
        if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) for c in choices):
            raise DataError(f"{where}: choices={choices!r} must be a list of at least two strings")
        blank = [index for index, choice in enumerate(choices) if not choice.strip()]
        if blank:  # an empty continuation scores 0, above any real log-probability: it would always win
            raise DataError(f"{where}: choice {blank[0]} {choices[blank[0]]!r} is empty or whitespace: every "
                            "choice must hold text (an empty one has log-likelihood 0 and always wins)")
        if not isinstance(label, int) or isinstance(label, bool) or not 0 <= label < len(choices):
            raise DataError(f"{where}: label={label!r} must be an index into its {len(choices)} choices")
        delimiter = record.get("target_delimiter", " ")
        if not isinstance(delimiter, str):
            raise DataError(f"{where}: target_delimiter={delimiter!r} must be a string")
        items.append(Item(context, tuple(choices), label, delimiter))
    if not items:
        raise DataError(f"{path} holds no items")
    return Task(task_name(path), tuple(items))


def _task_text(path: Path) -> str:
    """The task file's text; a DataError for a directory, a file that cannot be read, bytes that are not UTF-8."""
    if path.is_dir():
        raise DataError(f"{path} is a directory: a task is a JSONL file (one item a line)")
    try:
        data = path.read_bytes()
    except OSError as error:
        raise DataError(f"{path}: cannot be read ({error.strerror or error})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        offset = error.start - (data.rfind(b"\n", 0, error.start) + 1)
        raise DataError(f"{path}:{line}: byte {offset} of the line ({data[error.start]:#04x}) is not UTF-8 (a task "
                        "file is UTF-8 JSONL: save it as UTF-8)") from None


def encode_pair(encode: Encode, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-evaluation-harness's causal encoding of a (context, continuation) pair (TemplateLM._encode_pair)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole, context_length = list(encode(context + continuation)), len(encode(context))
    return whole[:context_length], whole[context_length:]


def choice_length(choice: str) -> int:
    """acc_norm's divisor: the choice's length in UTF-8 bytes."""
    return len(choice.encode("utf-8"))


def item_hits(item: Item, lls: np.ndarray) -> tuple[bool, bool]:
    """(acc, acc_norm) of one item from its choices' log-likelihoods, in choice order (ties: the first)."""
    lengths = np.asarray([choice_length(choice) for choice in item.choices], dtype=np.float64)
    return bool(np.argmax(lls) == item.label), bool(np.argmax(lls / lengths) == item.label)


@dataclass(frozen=True)
class Row:
    """One (item, choice) to score: `tokens` the whole sequence, the last `scored` of them the choice's."""

    task: int
    item: int
    choice: int
    tokens: np.ndarray
    scored: int


def rows_of(task_index: int, task: Task, item_ids, encode: Encode, max_length: int,
            render: Callable[[str], str] | None = None) -> list[Row]:
    """The rows of these items, left-truncated to max_length + 1 tokens (the harness's window)."""
    rows = []
    for item_id in item_ids:
        item = task.items[item_id]
        context = render(item.context) if render else item.context
        delimiter = "" if render else item.target_delimiter
        for index, choice in enumerate(item.choices):
            context_ids, choice_ids = encode_pair(encode, context, delimiter + choice)
            if not choice_ids:
                raise DataError(f"task {task.name}, item {item_id}: choice {index} {choice!r} encodes to no token")
            tokens = np.asarray(context_ids + choice_ids, dtype=np.int64)[-(max_length + 1):]
            rows.append(Row(task_index, int(item_id), index, tokens, min(len(choice_ids), len(tokens) - 1)))
    return rows


def collate(rows: list[Row]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded inputs and targets (B, L): the targets of the choice's tokens, the rest ignored."""
    width = max(len(row.tokens) for row in rows) - 1
    inputs = torch.zeros(len(rows), width, dtype=torch.long)
    targets = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    for index, row in enumerate(rows):
        tokens = torch.from_numpy(row.tokens)
        inputs[index, : len(tokens) - 1] = tokens[:-1]
        targets[index, len(tokens) - 1 - row.scored : len(tokens) - 1] = tokens[len(tokens) - row.scored:]
    return inputs, targets


def row_loglikelihoods(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(B,) sum over each row's valid targets of log p(target) (float64), from (B, T, V) logits."""
    token = -F.cross_entropy(logits.float().transpose(1, 2), targets, ignore_index=IGNORE_INDEX, reduction="none")
    return token.double().sum(dim=1)


class TaskScorer:
    """The tasks' acc and acc_norm, the same on any world size; a component on the evaluator's schedule.
    Collective to build: the ranks agree on the number of forwards (the most microbatches of any rank)."""

    def __init__(self, tasks: list[Task], encode: Encode, dist_info: DistInfo, max_length: int,
                 micro_batch_size: int, micro_tokens: int | None = None, render: Callable[[str], str] | None = None,
                 should_run: Callable[[int], bool] = lambda step: False, engine=None):
        self.tasks = tasks
        self.dist = dist_info
        self.should_run = should_run
        self.engine = engine  # what `on_step_end` scores (ddptrain.engine.Engine: its forward, its precision)
        self.rows = self._rows(dist_info.rank, encode, max_length, render)  # collective: the rounds
        ids, lengths = np.arange(len(self.rows)), np.asarray([len(row.tokens) - 1 for row in self.rows], dtype=np.int64)
        self.microbatches = split_micro(ids, micro_batch_size) if micro_tokens is None else \
            budget_microbatches(ids, lengths, micro_tokens)
        rounds = torch.tensor([len(self.microbatches)], device=dist_info.device)
        if is_distributed():
            dist.all_reduce(rounds, op=dist.ReduceOp.MAX)
        self.rounds = int(rounds)  # the same on every rank: fillers pad the shorter lists

    def _rows(self, rank: int, encode: Encode, max_length: int, render) -> list[Row]:
        rows = []
        for index, task in enumerate(self.tasks):
            rows += rows_of(index, task, range(rank, len(task.items), self.dist.world_size), encode, max_length, render)
        return rows

    @classmethod
    def from_config(cls, cfg: TrainConfig, dist_info: DistInfo, engine,
                    should_run: Callable[[int], bool]) -> "TaskScorer | None":
        """trainer.eval_tasks with the run's tokenizer and microbatches; None without tasks."""
        if not cfg.trainer.eval_tasks:
            return None
        tasks = [read_task(path) for path in cfg.trainer.eval_tasks]
        encode, render = run_tokenizer(cfg.data.tokenizer, cfg.trainer.eval_chat_template, cfg.data.chat_template)
        return cls(tasks, encode, dist_info, cfg.batch.seq_len, cfg.batch.micro_size, eval_micro_tokens(cfg.batch),
                   render, should_run, engine)

    def reads(self, end: StepEnd) -> bool:
        return self.should_run(end.step)

    def on_step_end(self, end: StepEnd) -> None:
        if self.should_run(end.step):
            end.evals.update(self.score(self.engine.forward, self.engine.model))

    def on_fit_end(self, step: int) -> None:
        pass

    def score(self, forward: Forward, model: torch.nn.Module | None = None) -> dict[str, float]:
        """Collective: {"eval/<task>/acc": ..., "eval/<task>/acc_norm": ...}. `model` (the one `forward`
        runs) is put in eval mode for the scoring and back in train mode after."""
        return self._counts(self.loglikelihoods(forward, model))

    @torch.no_grad()
    def loglikelihoods(self, forward: Forward, model: torch.nn.Module | None = None) -> np.ndarray:
        """Collective: the log-likelihood of each of this rank's rows (`self.rows`), in their order."""
        device = self.dist.device
        scores = np.zeros(len(self.rows))
        training = model.training if model is not None else False
        if model is not None:
            model.eval()
        for index in range(self.rounds):  # every rank as many forwards: sharded strategies gather in each
            if index < len(self.microbatches):
                ids = self.microbatches[index]
                inputs, targets = collate([self.rows[i] for i in ids])
            else:  # a filler: this rank's rows are used up
                ids = np.zeros(0, dtype=np.int64)
                inputs, targets = torch.zeros(1, 1, dtype=torch.long), torch.full((1, 1), IGNORE_INDEX)
            logits = forward(inputs.to(device))  # (B, L, V)
            scores[ids] = row_loglikelihoods(logits, targets.to(device))[: len(ids)].cpu().numpy()
        if model is not None and training:
            model.train()
        return scores

    def _counts(self, scores: np.ndarray) -> dict[str, float]:
        """Per task (acc hits, acc_norm hits, items), summed over the ranks."""
        counts = torch.zeros(len(self.tasks), 3, dtype=torch.float64)
        by_item: dict[tuple[int, int], list[int]] = {}
        for index, row in enumerate(self.rows):
            by_item.setdefault((row.task, row.item), []).append(index)
        for (task, item_id), indices in by_item.items():
            hits = item_hits(self.tasks[task].items[item_id], scores[indices])  # rows_of keeps the choice order
            counts[task] += torch.tensor([*hits, 1.0], dtype=torch.float64)
        counts = all_reduce_sum(counts.to(self.dist.device)).cpu()
        result = {}
        for task, (acc, acc_norm, items) in zip(self.tasks, counts.tolist()):
            result[f"eval/{task.name}/acc"] = acc / items
            result[f"eval/{task.name}/acc_norm"] = acc_norm / items
        return result


def run_tokenizer(tokenizer: str | None, chat: bool, chat_template: str | None = None,
                  user: str = "trainer.eval_chat_template=true") -> tuple[Encode, Callable[[str], str] | None]:
    """(encode, render) for a run's data.tokenizer: `render` wraps a context in the chat template
    (transformers' apply_chat_template, as the harness calls it) when `chat`, else None. `user`: the
    switch that asked for the chat template, for the messages."""
    if not chat:
        from ddptrain.data.tokenizer import load_tokenizer

        plain = load_tokenizer(tokenizer)
        return (lambda text: plain.encode(text).tolist()), None
    from ddptrain.data.chat import ChatTokenizer

    chat_tokenizer = ChatTokenizer(tokenizer, chat_template, user)
    if not chat_tokenizer.template:
        raise DataError(f"{user} but {tokenizer} has no chat template (give data.chat_template=PATH)")
    hf = chat_tokenizer.tokenizer

    def render(context: str) -> str:
        return hf.apply_chat_template([{"role": "user", "content": context}], chat_template=chat_tokenizer.template,
                                      tokenize=False, add_generation_prompt=True)

    return chat_tokenizer.encode, render
