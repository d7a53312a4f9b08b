"""`python -m ddptrain.export RUN_DIR OUT_DIR [--merge]`: a run's trained weights as a Hugging Face model
directory (`AutoModelForCausalLM.from_pretrained(OUT_DIR)`), with the run's tokenizer files if any.

The built-in GPT becomes a GPT2LMHeadModel with the same logits (ddptrain.models.convert); a model=hf
run's PreTrainedModel is saved as it is. A LoRA run (model.lora) exports its PEFT adapter directory
(`peft.PeftModel.from_pretrained(base, OUT_DIR)`), or with `--merge` the base with the adapter
folded into its weights: a plain save_pretrained directory (other runs export the same with or
without `--merge`). The directory appears under its name only when complete.

From a checkpoint (a run without final/ yet) the export holds what final/ would: the run's
tokenizer files, chat template and generation_config.json's stop tokens (ddptrain.runs.weights)."""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from torch import nn

from ddptrain.models import GPT, lora
from ddptrain.models.adapters import GENERATION_CONFIG
from ddptrain.models.hf import TOKENIZER_FILES
from ddptrain.models.spec import ModelError
from ddptrain.runs.layout import RUN_ENTRIES
from ddptrain.runs.rundir import managing_run
from ddptrain.runs.store import CheckpointError
from ddptrain.runs.weights import (FINAL, WHICH, TrainedWeights, checkpoint_tokenizer_files, find_weights,
                                  load_trained, save_tokenizer_files)


class ExportError(RuntimeError):
    """The run cannot be exported as asked; the message names the path or model class."""


def export(run_dir: str | Path, out_dir: str | Path, merge: bool = False,
           weights: TrainedWeights | None = None, which: str = FINAL) -> Path:
    """Write the run's model (final weights, else the newest checkpoint's) to `out_dir`; return it.
    `merge`: a LoRA run's adapter folded into the base weights (else its adapter directory); a run
    that trained every weight exports the same with or without it. `weights`: the run's, where the
    caller has found them already (ddptrain.runs.weights.find_weights), so they are read once.
    `which`: "best" exports best/ (checkpoint.keep_best) instead."""
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    check_paths(run_dir, out_dir)
    weights = find_weights(run_dir, which) if weights is None else weights
    model = load_trained(weights)
    if lora.is_adapted(model):
        hf_model = lora.merge(model) if merge else model  # a PeftModel saves its adapter directory
    else:  # `merge` has nothing to fold: the run trained every weight
        hf_model = _to_hf(model, run_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # A sibling on the same filesystem, so the final rename is atomic and a failure leaves no OUT_DIR.
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        hf_model.save_pretrained(staging)
        _copy_tokenizer_files(weights, staging)
        staging.replace(out_dir)  # rename(2) may replace an empty directory
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def check_paths(run_dir: Path, out_dir: Path) -> None:
    """An ExportError unless `run_dir` is a directory and `out_dir` is new or empty, and not inside a
    directory that a run manages (runs.rundir.managing_run)."""
    if not run_dir.is_dir():
        raise ExportError(f"run directory {run_dir} does not exist")
    managed = managing_run(out_dir)
    if managed is not None:
        run, name = managed
        what = RUN_ENTRIES[name]
        where = "is" if Path(out_dir).expanduser().resolve() == (run / name).resolve() else "is inside"
        raise ExportError(f"output directory {out_dir} {where} {run / name}, which the run manages ({what}): a later "
                          f"launch, serve or resume replaces, purges, rebuilds or moves it, and the export with it; "
                          f"pick a path outside a run dir's own entries ({', '.join(RUN_ENTRIES)})")
    if out_dir.exists() and not _is_empty_dir(out_dir):
        raise ExportError(f"output directory {out_dir} already exists and is not empty; pick a new path")


def _is_empty_dir(path: Path) -> bool:
    return path.is_dir() and not any(path.iterdir())


def _to_hf(model: nn.Module, run_dir: Path) -> nn.Module:
    if isinstance(model, GPT):
        from ddptrain.models.convert import gpt_to_hf
        return gpt_to_hf(model)
    try:
        from transformers import PreTrainedModel
    except ImportError:  # then the model cannot be one
        PreTrainedModel = None
    if PreTrainedModel is not None and isinstance(model, PreTrainedModel):
        return model
    cls = type(model)
    raise ExportError(f"model class {cls.__module__}.{cls.__qualname__} has no transformers architecture to "
                      f"export it to (only the built-in GPT and transformers PreTrainedModels export); "
                      f"load it with ddptrain.load_model({str(run_dir)!r}) instead")


def _copy_tokenizer_files(weights: TrainedWeights, out_dir: Path) -> None:
    """final/'s tokenizer files, and its generation_config.json where save_pretrained wrote none (a
    PEFT adapter directory, so that an adapter exported from final/ stops where one exported from a
    checkpoint does); for a checkpoint, what save_final would have put beside its weights
    (the tokenizer files, the chat template and the tokens generation stops at, from its run's config)."""
    source = weights.directory  # the directory the model was loaded from
    if not weights.is_final:
        save_tokenizer_files(out_dir, *checkpoint_tokenizer_files(source, weights.trainer_state))
        return
    names = [*TOKENIZER_FILES, *([] if (out_dir / GENERATION_CONFIG).exists() else [GENERATION_CONFIG])]
    for name in names:
        if (source / name).is_file():
            shutil.copy2(source / name, out_dir / name)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m ddptrain.export",
        description="Export a ddptrain run's weights as a Hugging Face model directory (from_pretrained).")
    parser.add_argument("run_dir", type=Path, help="the run's directory (run.dir)")
    parser.add_argument("out_dir", type=Path, help="a new or empty directory to write the model to")
    parser.add_argument("--merge", action="store_true",
                        help="a LoRA run: fold the adapter into the base weights (a plain transformers directory) "
                             "instead of writing the PEFT adapter directory; other runs: no difference")
    parser.add_argument("--which", choices=WHICH, default=FINAL,
                        help="final/ (default; the newest checkpoint without it) or best/ (checkpoint.keep_best)")
    args = parser.parse_args(argv)
    try:
        check_paths(args.run_dir, args.out_dir)  # before the weights are looked for, as export does
        weights = find_weights(args.run_dir, args.which)
        out_dir = export(args.run_dir, args.out_dir, merge=args.merge, weights=weights)
    except (ExportError, FileNotFoundError, CheckpointError, ModelError) as error:
        print(f"export error: {error}", file=sys.stderr)
        sys.exit(2)
    except OSError as error:  # out_dir under a file, a read-only or full disk: nothing was written there
        print(f"export error: cannot write {args.out_dir}: {error}", file=sys.stderr)
        sys.exit(2)
    if not weights.is_final:  # load_model's fallback: say which weights these are
        print(f"note: {args.run_dir} has no final/ yet (the run has not finished or been preempted): exported the "
              f"newest checkpoint, {weights.directory.name}", file=sys.stderr)
    print(f"exported {args.run_dir} to {out_dir}")


if __name__ == "__main__":
    main()
