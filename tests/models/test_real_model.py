"""A real pretrained model (SmolLM2-135M-Instruct, tests/real_model.py) where the rest of the suite
uses tiny random ones: the conversion from GGUF is right (it answers), a LoRA fine-tune through the
CLI on real text lowers its held-out loss, and the plan reads its directory with weights in it."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from tests.helpers import import_optional, read_metrics, run_cli
from tests.real_model import smollm2_dir

pytestmark = pytest.mark.slow

transformers = import_optional("transformers")

# Real text: a few standard-library modules, to train on and to hold out (one document per file).
STDLIB = Path(sysconfig.get_paths()["stdlib"])
TRAIN_FILES = ["textwrap.py", "shlex.py", "string.py", "fnmatch.py"]
VAL_FILES = ["glob.py"]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return smollm2_dir()


@pytest.fixture(scope="module")
def loaded(model_dir):
    """(model, tokenizer) read back from the built directory, as a user of it would."""
    return (transformers.AutoModelForCausalLM.from_pretrained(model_dir),
            transformers.AutoTokenizer.from_pretrained(model_dir))


def test_the_built_model_answers_through_its_chat_template(loaded):
    model, tokenizer = loaded
    assert "<|im_start|>" in tokenizer.chat_template  # ChatML survived the conversion
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    answer = tokenizer.decode(out[0, prompt["input_ids"].shape[1]:])
    assert "Paris" in answer, answer


def test_a_lora_fine_tune_on_python_sources_lowers_the_held_out_loss(model_dir, tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli(["model=hf", f"model.path={model_dir}", "model.lora.r=8", "model.lora.alpha=16", "data=text",
                      f"data.paths=[{','.join(str(STDLIB / name) for name in TRAIN_FILES)}]",
                      f"data.val_paths=[{','.join(str(STDLIB / name) for name in VAL_FILES)}]",
                      f"data.cache_dir={tmp_path / 'cache'}", "batch.seq_len=128", "batch.global_size=4",
                      "batch.micro_size=4", "trainer.max_steps=6", "trainer.eval_every=2", "trainer.eval_examples=8",
                      "trainer.log_every=1", "optim.lr=1e-3", "optim.warmup_steps=1", f"run.dir={run_dir}"])
    assert result.returncode == 0, result.stderr[-3000:]
    evals = [line["val_loss"] for line in read_metrics(run_dir) if "val_loss" in line]
    assert len(evals) == 3 and evals[-1] < evals[0], evals


def test_the_plan_reads_the_directory_with_weights_and_counts_its_parameters(model_dir, loaded):
    result = subprocess.run([sys.executable, "-m", "ddptrain.plan", "model=hf", f"model.path={model_dir}"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    parameters = loaded[0].num_parameters()
    assert f"memory plan: {parameters:,} parameters" in result.stdout, result.stdout
