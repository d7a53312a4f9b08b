"""A real pretrained model (SmolLM2-135M-Instruct, tests/real_model.py) where the rest of the suite
uses tiny random ones: the conversion from GGUF is right (it answers); LoRA and full fine-tunes
through the CLI on real text lower its held-out loss through the chunked head; layouts and the full
logits give the same curve; the merged export and load_model give the same logits; the server
answers an OpenAI client; the plan reads its directory with weights in it."""

from __future__ import annotations

import re
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


def python_sources(cache: Path, seq_len: int = 128, global_size: int = 4) -> list[str]:
    return ["data=text", f"data.paths=[{','.join(str(STDLIB / name) for name in TRAIN_FILES)}]",
            f"data.val_paths=[{','.join(str(STDLIB / name) for name in VAL_FILES)}]", f"data.cache_dir={cache}",
            f"batch.seq_len={seq_len}", f"batch.global_size={global_size}", "trainer.log_every=1",
            "optim.warmup_steps=1"]


CHUNKED = "loss: the output head and the objective on the valid targets only"


@pytest.fixture(scope="module")
def lora_run(model_dir, tmp_path_factory):
    """A LoRA fine-tune of 4 steps on Python sources: (run dir, the launch's stderr)."""
    run_dir = tmp_path_factory.mktemp("lora") / "run"
    result = run_cli(["model=hf", f"model.path={model_dir}", "model.lora.r=8", "model.lora.alpha=16",
                      *python_sources(run_dir.parent / "cache"), "batch.micro_size=4", "trainer.max_steps=4",
                      "trainer.eval_every=2", "trainer.eval_examples=8", "optim.lr=1e-3", f"run.dir={run_dir}"])
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir, result.stderr


def test_a_lora_fine_tune_on_python_sources_lowers_the_held_out_loss(lora_run):
    run_dir, stderr = lora_run
    assert CHUNKED in stderr, "the real model trains through the chunked head"
    evals = [line["val_loss"] for line in read_metrics(run_dir) if "val_loss" in line]
    assert len(evals) == 2 and evals[-1] < evals[0], evals  # steps 2 and 4


def test_layouts_and_the_full_logits_give_the_same_curve_on_the_real_model(model_dir, tmp_path):
    """fp32 on the real model (vocabulary 49,152): 1 rank x 4 rows through the chunked head against
    2 ranks x 1 row through the full logits (trainer.chunked_head=false), each 3 steps of LoRA with the
    head adapted. One launch checks both: the layout or the head alone changing the curve fails it
    (the tiny models' tests take each apart, token budgets too)."""
    common = ["model=hf", f"model.path={model_dir}", "model.lora.r=4",
              "model.lora.target_modules=[q_proj,v_proj,lm_head]", *python_sources(tmp_path / "cache"),
              "trainer.max_steps=3", "optim.lr=1e-3", "trainer.eval_examples=4"]
    layouts = {"1x4": (1, ["batch.micro_size=4"]),
               "2x1 full logits": (2, ["batch.micro_size=1", "trainer.chunked_head=false"])}
    curves = {}
    for name, (ranks, layout) in layouts.items():
        run_dir = tmp_path / name.replace(" ", "_")
        result = run_cli([*common, *layout, f"run.dir={run_dir}"], nproc=ranks, timeout=600)
        assert result.returncode == 0, (name, result.stderr[-3000:])
        curves[name] = [(line["tokens"], line["loss"]) for line in read_metrics(run_dir)]
    reference = curves.pop("1x4")
    for name, curve in curves.items():
        assert [tokens for tokens, _ in curve] == [tokens for tokens, _ in reference], name
        assert [loss for _, loss in curve] == pytest.approx([loss for _, loss in reference], rel=1e-5), name


def test_the_merged_export_and_load_model_give_the_same_logits(lora_run, tmp_path):
    import ddptrain

    run_dir, _ = lora_run
    result = subprocess.run([sys.executable, "-m", "ddptrain.export", str(run_dir), str(tmp_path / "merged"),
                             "--merge"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    trained = ddptrain.load_model(run_dir)
    ids = transformers.AutoTokenizer.from_pretrained(tmp_path / "merged")("def main():\n    return 1",
                                                                            return_tensors="pt").input_ids
    with torch.no_grad():
        expected, got = trained(ids).logits, merged(ids).logits
    assert (got - expected).abs().max() <= 1e-4 * expected.abs().max()


def test_the_server_answers_an_openai_client(lora_run, tmp_path):
    openai = import_optional("openai")
    from tests.serving.test_serve import serve_cli

    run_dir, _ = lora_run
    with serve_cli(run_dir, tmp_path / "serve.log") as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
        reply = client.chat.completions.create(model="ddptrain", max_tokens=12, temperature=0,
                                               messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in reply.choices[0].message.content, reply


def test_the_plan_reads_the_directory_with_weights_and_counts_its_parameters(model_dir, loaded):
    result = subprocess.run([sys.executable, "-m", "ddptrain.plan", "model=hf", f"model.path={model_dir}"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    parameters = loaded[0].num_parameters()
    assert f"memory plan: {parameters:,} parameters" in result.stdout, result.stdout


def _planned_bytes(log: str, strategy: str = "ddp") -> float:
    """The plan's total per rank for `strategy`, from the start-up lines (e.g. "ddp ... 7.48G -")."""
    row = next(line for line in log.splitlines() if re.search(rf"\] {strategy} +\d", line))
    total = re.findall(r"([\d.]+)([MG])\b", row)[-1]  # weights, grads, ..., total: the last figure
    return float(total[0]) * {"M": 2**20, "G": 2**30}[total[1]]


def test_a_full_fine_tune_lowers_the_held_out_loss_through_the_chunked_head_at_the_planned_peak(model_dir, tmp_path):
    """A full fine-tune of 4 steps on Python sources, the head 100 rows at a time: the held-out loss falls
    (steps 2 and 4), and the start-up plan's ddp total per rank is within a quarter of what the run
    measured: on CPU its peak resident set less the peak before the model was built (metrics.jsonl:
    peak_memory_bytes and memory_baseline_bytes; the optimizer's state exists from the first step)."""
    run_dir = tmp_path / "run"
    result = run_cli(["model=hf", f"model.path={model_dir}", *python_sources(tmp_path / "cache", 512, 2),
                      "batch.micro_size=2", "trainer.max_steps=4", "trainer.eval_every=2", "trainer.eval_examples=8",
                      "optim.lr=3e-5", "trainer.head_chunk_tokens=100", f"run.dir={run_dir}"], timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"{CHUNKED}, 100 rows at a time" in result.stderr
    metrics = read_metrics(run_dir)
    evals = [line["val_loss"] for line in metrics if "val_loss" in line]
    assert len(evals) == 2 and evals[-1] < evals[0], evals  # steps 2 and 4
    planned = _planned_bytes(result.stderr)
    measured = metrics[-1]["peak_memory_bytes"] - metrics[-1]["memory_baseline_bytes"]
    print(f"planned {planned / 2**30:.2f} GiB, measured {measured / 2**30:.2f} GiB ({planned / measured:.2f}x)")
    assert abs(planned - measured) <= 0.25 * measured, (planned / 2**30, measured / 2**30)


def test_the_plan_of_a_lora_run_on_the_real_model_counts_the_adapter_alone_as_training(model_dir, capsys):
    from ddptrain.plan import main

    # The command's main() in this process (the test above runs the command itself).
    assert main(["model=hf", f"model.path={model_dir}", "model.lora.r=16"]) == 0, capsys.readouterr().err[-3000:]
    match = re.search(r"memory plan: ([\d,]+) parameters \(([\d,]+) train\)", capsys.readouterr().out)
    total, training = (int(group.replace(",", "")) for group in match.groups())
    assert 0 < training < total / 20, (training, total)  # r=16 on every linear layer: 3.5% of the weights
