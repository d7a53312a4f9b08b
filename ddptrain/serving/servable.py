"""A run as a directory that transformers can load and serve: weights, config.json, tokenizer.json.

`servable_dir(path)` accepts either a transformers model directory (config.json and tokenizer.json:
used as it is) or a ddptrain run directory, which it turns into `RUN_DIR/servable/`:

    servable/
        config.json, model.safetensors ...   `python -m ddptrain.export` of the run's weights
        tokenizer.json                       the run's tokenizer; for the byte tokenizer, a
                                             byte-level one whose ids are the byte values
        ddptrain_servable.json               the files it was made from, by size and sha256, and its
                                             own files' sha256: remade when a source's content changes
                                             (the weights, a LoRA run's base) or its own files do

The byte tokenizer (ddptrain.data.tokenizer.ByteTokenizer) has no file: `byte_tokenizer()` builds
the `tokenizers` equivalent, so that text in and text out work in any Hugging Face tool.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path

from ddptrain.runs.layout import BEST, FINAL, SERVABLE, SERVABLE_BEST

MARKER = "ddptrain_servable.json"

log = logging.getLogger(__name__)


class ServableError(RuntimeError):
    """The path cannot be served; the message names the path and what is missing."""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 bytes to printable characters (the ByteLevel alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(char) for byte, char in zip(printable, chars)}


def byte_tokenizer():
    """A `tokenizers.Tokenizer` equal to ddptrain's byte tokenizer: ids are the UTF-8 bytes of the text.

    ByteLevel pre-tokenization maps each byte to one character of GPT-2's alphabet; a BPE model
    with those 256 characters as its vocabulary (id = byte value) and no merges then gives one id
    per byte, and the ByteLevel decoder maps ids back to bytes (invalid UTF-8 becomes U+FFFD)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # use_regex=False: no splitting into words, so no byte is ever dropped or merged.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def write_byte_tokenizer(directory: str | Path) -> Path:
    """tokenizer.json (and a tokenizer_config.json for transformers' AutoTokenizer) in `directory`."""
    directory = Path(directory)
    path = directory / "tokenizer.json"
    byte_tokenizer().save(str(path))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": _context_of(directory),
         "clean_up_tokenization_spaces": False}, indent=1))
    return path


def _context_of(directory: Path) -> int | None:
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config.get("n_positions") or config.get("max_position_embeddings")


def is_model_dir(path: Path) -> bool:
    """A transformers model directory, not a ddptrain run directory."""
    return (path / "config.json").is_file() and not (path / "config.yaml").is_file()


def servable_dir(path: str | Path, which: str = "final") -> Path:
    """The directory to serve for `path`: a transformers directory as it is, or RUN_DIR/servable/,
    made (or remade when the run's weights changed) from a run directory; which="best": its best/
    weights (checkpoint.keep_best), in RUN_DIR/servable-best/."""
    path = Path(path)
    if not path.is_dir():
        raise ServableError(f"{path}: no such directory (expected a ddptrain run directory or a transformers "
                            "model directory)")
    if is_model_dir(path):
        if not (path / "tokenizer.json").is_file():
            raise ServableError(f"{path} has no tokenizer.json: text cannot be turned into the model's ids "
                                "(save the tokenizer beside the model with tokenizer.save_pretrained)")
        return path
    return _from_run(path, which)


def _source_stamp(weights) -> dict:
    """What the servable directory is built from (final.TrainedWeights: final/, else the newest
    complete checkpoint), by content: the size and sha256 of each file (final.source_files: the
    weights' marker, a LoRA run's base files, a checkpoint's tokenizer files). A copy that kept the
    mtimes (cp -p, rsync -a) of other contents is not the same source."""
    from ddptrain.fsutil import sha256_file
    from ddptrain.runs.weights import source_files

    files = {str(file.resolve()): [file.stat().st_size, sha256_file(file)] for file in source_files(weights)}
    return {"source": str(weights.directory.resolve()), "files": files}


def _own_files(directory: Path) -> dict[str, str]:
    """The sha256 of each file of a servable directory but its marker."""
    from ddptrain.fsutil import sha256_file

    return {str(path.relative_to(directory)): sha256_file(path) for path in sorted(directory.rglob("*"))
            if path.is_file() and path.name != MARKER}


def _is_current(out: Path, stamp: dict) -> bool:
    """Whether `out` (RUN_DIR/servable) was made from the source of `stamp` and its own files are
    still the ones made: a damaged copy (a flipped byte, a truncated file) is rebuilt, never served."""
    try:
        made = json.loads((out / MARKER).read_text())
    except (OSError, ValueError):
        return False
    if {key: made.get(key) for key in stamp} != stamp:
        return False
    if made.get("own") != _own_files(out):  # None: made by an older ddptrain, which kept no sums of its own
        log.warning("%s: its files are not the ones made from %s (damaged, or made by an older ddptrain): "
                    "rebuilt", out, stamp["source"])
        return False
    return True


def _from_run(run_dir: Path, which: str = "final") -> Path:
    from ddptrain.export import ExportError, export
    from ddptrain.models.spec import ModelError
    from ddptrain.runs.store import CheckpointError
    from ddptrain.runs.weights import find_weights

    out = run_dir / {FINAL: SERVABLE, BEST: SERVABLE_BEST}[which]
    try:
        weights = find_weights(run_dir, which)  # verified and read once: the stamp and the export are of the same files
        stamp = _source_stamp(weights)
    except (FileNotFoundError, CheckpointError) as error:  # no weights, a damaged file or a moved tokenizer
        raise ServableError(str(error)) from None
    if _is_current(out, stamp):
        return out
    # Build beside it and rename into place: a reader sees the old or the new directory, never a mix.
    staging = Path(tempfile.mkdtemp(prefix=f".{SERVABLE}.", dir=run_dir))
    try:
        try:
            export(run_dir, staging / "model", merge=True, weights=weights, which=which)  # a LoRA run serves its merged weights
        except (ExportError, CheckpointError, ModelError) as error:  # a custom model, a damaged final/
            raise ServableError(f"{run_dir} cannot be served: {error}") from None
        model_dir = staging / "model"
        if not (model_dir / "tokenizer.json").is_file():
            _add_run_tokenizer(run_dir, model_dir)
        (model_dir / MARKER).write_text(json.dumps({**stamp, "own": _own_files(model_dir)}))
        old = run_dir / f".{out.name}.old"
        if out.exists():
            shutil.rmtree(old, ignore_errors=True)
            out.replace(old)
        model_dir.replace(out)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def _add_run_tokenizer(run_dir: Path, model_dir: Path) -> None:
    """The byte tokenizer as tokenizer.json when the run used it; anything else is an error."""
    tokenizer = _run_tokenizer(run_dir)
    if tokenizer not in (None, "byte"):
        raise ServableError(f"{run_dir}: the run used data.tokenizer={tokenizer}, but its weights directory has no "
                            "tokenizer.json; copy that file into the servable directory or serve an exported "
                            "directory that has it")
    vocab = json.loads((model_dir / "config.json").read_text()).get("vocab_size")
    if vocab is not None and vocab < 256:
        raise ServableError(f"{run_dir}: the model's vocabulary ({vocab} ids) is smaller than the byte tokenizer's "
                            "256 ids")
    write_byte_tokenizer(model_dir)


def _run_tokenizer(run_dir: Path) -> str | None:
    """data.tokenizer of the run, as the trainer resolved it into RUN_DIR/config.yaml (None if unknown)."""
    config = run_dir / "config.yaml"
    if not config.is_file():
        return None
    from omegaconf import OmegaConf

    return OmegaConf.select(OmegaConf.load(config), "data.tokenizer", default=None)
