"""`python -m ddptrain.evaluate RUN_DIR|MODEL_DIR TASK.jsonl [TASK.jsonl ...]`: multiple-choice task
accuracy (acc, acc_norm) of a finished run or of any transformers model directory, scored as the
training loop scores trainer.eval_tasks (ddptrain/train/tasks.py), in one process.

A run directory gives its final/ weights (else its newest checkpoint), or best/ with `--which best`,
and its tokenizer (final/'s tokenizer.json, else the run's data.tokenizer; bytes for the built-in
default). A transformers directory is loaded with AutoModelForCausalLM and its tokenizer.json. One
JSON line per task goes to stdout: {"task", "acc", "acc_norm", "items"}.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from ddptrain.contract.outputs import logits_of
from ddptrain.data.sources import DataError
from ddptrain.distributed import DistInfo, backend_for
from ddptrain.models.spec import ModelError
from ddptrain.runs.store import CheckpointError
from ddptrain.runs.weights import FINAL, SPEC_FILE, WHICH, find_weights, load_trained
from ddptrain.train.tasks import TaskScorer, read_task, run_tokenizer


def _is_model_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and not (path / "config.yaml").is_file()


def _run_tokenizer(run_dir: Path, weights_dir: Path) -> tuple[str, str | None]:
    """(data.tokenizer, data.chat_template) as the weights directory holds them, else as the run's config."""
    template = weights_dir / "chat_template.jinja"
    template = str(template) if template.is_file() else None
    if (weights_dir / "tokenizer.json").is_file():
        return str(weights_dir / "tokenizer.json"), template
    from omegaconf import OmegaConf

    config = run_dir / "config.yaml"
    data = OmegaConf.load(config).get("data", {}) if config.is_file() else {}
    return data.get("tokenizer") or "byte", template or data.get("chat_template")


def load(path: Path, which: str = FINAL) -> tuple[torch.nn.Module, str, str | None, int | None]:
    """(model, tokenizer, chat template, the model's length) of a run directory or a transformers directory."""
    if _is_model_dir(path):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True).eval()
        config = model.config
        length = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
        return model, str(path / "tokenizer.json"), None, length
    weights = find_weights(path, which)
    model = load_trained(weights)
    spec = json.loads((weights.directory / SPEC_FILE).read_text()) if weights.is_final else \
        weights.trainer_state["model_spec"]
    tokenizer, template = _run_tokenizer(path, weights.directory)
    return model, tokenizer, template, spec.get("max_seq_len")


def evaluate(path: str | Path, task_files: list[str | Path], which: str = FINAL, chat_template: bool = False,
             batch_size: int = 8, max_length: int | None = None, device: str = "cpu") -> dict[str, float]:
    """{"eval/<task>/acc": ..., "eval/<task>/acc_norm": ...} of the model at `path`."""
    tasks = [read_task(file) for file in task_files]  # a bad task file is named before the model loads
    model, tokenizer, template, length = load(Path(path), which)
    device = torch.device(device)
    model.to(device)
    encode, render = run_tokenizer(tokenizer, chat_template, template, "evaluate --chat-template")
    scorer = TaskScorer(tasks, encode, DistInfo(0, 1, 0, device, backend_for(device)), max_length or length or 2048,
                        batch_size, render=render)
    return scorer.score(lambda inputs: logits_of(model(inputs)), model)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ddptrain.evaluate", description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path, help="a ddptrain run directory or a transformers model directory")
    parser.add_argument("tasks", nargs="+", type=Path, help='task JSONL files: {"context", "choices", "label"} a line')
    parser.add_argument("--which", choices=WHICH, default=FINAL, help="a run's final/ (default) or best/ weights")
    parser.add_argument("--chat-template", action="store_true", help="wrap each context in the chat template")
    parser.add_argument("--batch-size", type=int, default=8, help="rows (choices) per forward (default: 8)")
    parser.add_argument("--max-length", type=int, default=None, help="tokens per row (default: the model's)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, ... (default: cpu)")
    args = parser.parse_args(argv)
    try:
        scores = evaluate(args.path, args.tasks, args.which, args.chat_template, args.batch_size, args.max_length,
                          args.device)
    except (FileNotFoundError, DataError, ValueError, CheckpointError, ModelError) as error:
        print(f"evaluate error: {error}", file=sys.stderr)
        sys.exit(2)
    for file in args.tasks:
        task = read_task(file)
        print(json.dumps({"task": task.name, "acc": scores[f"eval/{task.name}/acc"],
                          "acc_norm": scores[f"eval/{task.name}/acc_norm"], "items": len(task.items)}))


if __name__ == "__main__":
    main()
