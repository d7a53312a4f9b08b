"""Multiple-choice task accuracy: lm-evaluation-harness's encoding and acc / acc_norm, equal to a
reference computed here with transformers' own forward (model=hf) or the model's own forward on the
weights of that step; the same on 1 and 2 ranks and every strategy; `python -m ddptrain.evaluate`
prints the same numbers; the plot draws them."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ddptrain.data.sources import DataError
from ddptrain.runs import store as ckpt
from ddptrain.runs.weights import TrainedWeights, load_trained
from ddptrain.distributed import init_distributed
from ddptrain.train.tasks import Item, TaskScorer, encode_pair, read_task, run_tokenizer
from tests.helpers import (REPO, RESUME_RUN, import_optional, is_installed, read_metrics, run_cli,
                           save_pretrained_llama)
from tests.zygote import launch_command

WORDS = "the cat sat on a mat while dogs ran over hills and rivers flowed quietly under old stone bridges".split()


def write_task(path: Path, items: int = 24, seed: int = 0) -> Path:
    """Random items with the cases the encoding must get right: a context ending in spaces, a choice
    outside ASCII (its UTF-8 bytes differ from its characters), a target_delimiter of its own."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as file:
        for index in range(items):
            context = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9)))
            context += "  " if index % 5 == 0 else ""
            choices = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(2, 4))]
            if index % 7 == 0:
                choices[0] = "héllo wörld ÿ"
            item = {"context": context, "choices": choices, "label": rng.randrange(len(choices))}
            if index % 6 == 0:
                item["target_delimiter"] = ": "
            file.write(json.dumps(item) + "\n")
    return path


def harness_reference(forward, encode, task_file: Path, max_length: int) -> tuple[dict[str, float], list[float]]:
    """lm-evaluation-harness's multiple-choice scoring, written out here: each (context, delimiter +
    choice) pair encoded as TemplateLM._encode_pair does, the row cut to its last max_length + 1
    tokens, the continuation's log-probabilities summed in float64; acc and acc_norm (by bytes), and
    every choice's log-likelihood, item after item."""
    hits, every = np.zeros(2), []
    items = [json.loads(line) for line in task_file.read_text(encoding="utf-8").splitlines()]
    for item in items:
        lls = []
        for choice in item["choices"]:
            context, continuation = item["context"], item.get("target_delimiter", " ") + choice
            spaces = len(context) - len(context.rstrip())
            if spaces > 0:
                continuation, context = context[-spaces:] + continuation, context[:-spaces]
            whole, context_enc = encode(context + continuation), encode(context)
            continuation_enc = whole[len(context_enc):]
            inputs = (context_enc + continuation_enc)[-(max_length + 1):][:-1]
            with torch.no_grad():
                logits = forward(torch.tensor([inputs]))[0]  # (T, V)
            logprobs = torch.log_softmax(logits.double(), dim=-1)[len(inputs) - len(continuation_enc):]
            lls.append(float(logprobs.gather(1, torch.tensor(continuation_enc)[:, None]).sum()))
        lengths = np.array([len(choice.encode("utf-8")) for choice in item["choices"]], dtype=np.float64)
        hits += [np.argmax(lls) == item["label"], np.argmax(np.array(lls) / lengths) == item["label"]]
        every += lls
    return {"acc": hits[0] / len(items), "acc_norm": hits[1] / len(items)}, every


def _ok(result):
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def _evals(run_dir: Path, task: str = "mc") -> dict[int, tuple[float, float]]:
    return {row["step"]: (row[f"eval/{task}/acc"], row[f"eval/{task}/acc_norm"]) for row in read_metrics(run_dir)
            if f"eval/{task}/acc" in row}


def _byte_encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


# -- the encoding and the scores -----------------------------------------------------------------


def test_a_pair_is_encoded_as_the_harness_encodes_it(tmp_path):
    # Trailing spaces of the context move to the continuation; the context's own tokens are cut from the front.
    assert encode_pair(_byte_encode, "Q: a b  ", " c") == (_byte_encode("Q: a b"), _byte_encode("   c"))
    from tests.helpers import save_bpe_tokenizer

    tokenizers = import_optional("tokenizers")
    bpe = tokenizers.Tokenizer.from_file(str(save_bpe_tokenizer(tmp_path / "tokenizer.json",
                                                                texts=("the value returned", "return self.value"))))

    def encode(text):
        return bpe.encode(text, add_special_tokens=False).ids

    context, continuation = encode_pair(encode, "return", "ed the value")
    assert context + continuation == encode("returned the value")  # encoded whole: merges across the boundary
    assert context == encode("return")[: len(context)]


def test_acc_norm_divides_by_the_choice_length_in_utf8_bytes():
    """Two choices: 'ÿÿ' (2 characters, 4 bytes) with a log-likelihood of -3, 'abc' (3 bytes) with -2.5:
    acc picks 'abc'; per byte 'ÿÿ' wins (-0.75 > -0.83), where per character it would lose (-1.5)."""
    from ddptrain.train.tasks import item_hits

    assert item_hits(Item("ctx", ("ÿÿ", "abc"), 0), np.array([-3.0, -2.5])) == (False, True)
    assert item_hits(Item("ctx", ("ÿÿ", "abc"), 1), np.array([-3.0, -2.5])) == (True, False)


@pytest.mark.parametrize("line, words", [
    ('{"context": "", "choices": ["a", "b"], "label": 0}', "context='' must be a non-empty string"),
    ('{"context": "q", "choices": ["a"], "label": 0}', "must be a list of at least two strings"),
    ('{"context": "q", "choices": ["a", "b"], "label": 2}', "label=2 must be an index into its 2 choices"),
    ('{"context": "q", "choices": ["a", "b"], "label": 0', "not JSON"),
    # an empty continuation has log-likelihood 0, above any real choice's: it would always win
    ('{"context": "q", "choices": ["a", ""], "label": 0}', "choice 1 '' is empty or whitespace"),
    ('{"context": "q", "choices": [" \\t", "b"], "label": 1}', "choice 0 ' \\t' is empty or whitespace"),
])
def test_a_task_line_that_breaks_the_format_is_named_with_its_rule(tmp_path, line, words):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"context": "q", "choices": ["a", "b"], "label": 1}\n' + line + "\n")
    with pytest.raises(DataError, match=f"{path}:2: ") as error:
        read_task(path)
    assert words in str(error.value)


# -- bad input to `python -m ddptrain.evaluate` and trainer.eval_tasks: one line, no traceback ----------


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory) -> tuple[Path, Path]:
    """The built-in GPT trained 2 steps, a task scored and a checkpoint saved at each, with best/
    (checkpoint.keep_best) beside final/: (run dir, task file). One launch for the tests that read
    its scores and those that damage a copy of it."""
    root = tmp_path_factory.mktemp("gpt_tasks")
    task = write_task(root / "mc.jsonl", items=16, seed=1)
    run_dir = root / "run"
    _ok(run_cli([*RESUME_RUN, "trainer.max_steps=2", "trainer.eval_every=1", f"trainer.eval_tasks=[{task}]",
                 "checkpoint.every=1", "checkpoint.keep_best=val_loss", f"run.dir={run_dir}"]))
    return run_dir, task


@pytest.fixture(scope="module")
def run_with_best(gpt_run) -> Path:
    """The built-in GPT run with best/ beside final/ (the tests change a copy of it)."""
    return gpt_run[0]


def _one_line_error(result, prefix: str, *words: str) -> str:
    """The command failed with rc 2 and one line naming `words`, no traceback."""
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    (line,) = [line for line in result.stderr.splitlines() if prefix in line]
    for word in words:
        assert word in line, line
    return line


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-10] ^= 1
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("case", ["final tampered", "best truncated", "task is a directory", "task not utf-8",
                                  "chat template of the byte tokenizer"])
@pytest.mark.slow  # over 4 s (a process launch or ranks): out of the fast tier
def test_the_evaluate_command_names_a_damaged_run_or_a_bad_task_file_in_one_line(run_with_best, tmp_path, case,
                                                                                  capsys):
    """The first case runs the command (its exit status and stderr); the others call its main() in this
    process: the same one line and exit 2, without a process launch each."""
    import shutil

    from ddptrain.evaluate import main

    run_dir = tmp_path / "run"
    shutil.copytree(run_with_best, run_dir)
    task = tmp_path / "mc.jsonl"
    task.write_text('{"context": "the cat", "choices": ["sat", "ran"], "label": 0}\n')
    args, words = [str(run_dir), str(task)], []
    if case == "final tampered":
        _flip_a_byte(run_dir / "final" / "model.safetensors")
        words = [f"{run_dir / 'final' / 'model.safetensors'} is corrupted"]
    elif case == "best truncated":
        weights = run_dir / "best" / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:200])
        args, words = [*args, "--which", "best"], [f"{weights} is corrupted"]
    elif case == "task is a directory":
        task.unlink()
        task.mkdir()
        words = [f"{task} is a directory"]
    elif case == "chat template of the byte tokenizer":  # it named data=sft
        args, words = [*args, "--chat-template"], ["evaluate --chat-template needs a real tokenizer"]
    else:  # latin-1 on the second line
        task.write_bytes(task.read_bytes() + '{"context": "café", "choices": ["a", "b"], "label": 0}\n'.encode("latin-1"))
        words = [f"{task}:2: ", "is not UTF-8"]
    if case == "final tampered":
        result = subprocess.run([*launch_command(["-m", "ddptrain.evaluate"]), *args], cwd=REPO, capture_output=True,
                                text=True, timeout=300)
    else:
        with pytest.raises(SystemExit) as exited:
            main(args)
        captured = capsys.readouterr()
        result = subprocess.CompletedProcess(args, exited.value.code, captured.out, captured.err)
    _one_line_error(result, "evaluate error: ", *words)


@pytest.mark.slow  # over 4 s (a process launch or ranks): out of the fast tier
def test_a_task_file_that_is_not_utf8_in_trainer_eval_tasks_is_a_data_error_before_training(tmp_path):
    task = tmp_path / "mc.jsonl"
    task.write_bytes(b'{"context": "the cat", "choices": ["sat", "ran"], "label": 0}\n'
                     + '{"context": "café", "choices": ["a", "b"], "label": 0}\n'.encode("latin-1"))
    run_dir = tmp_path / "run"
    result = run_cli([*RESUME_RUN, "trainer.max_steps=2", f"trainer.eval_tasks=[{task}]", f"run.dir={run_dir}"])
    _one_line_error(result, "data error: ", f"{task}:2: ", "is not UTF-8")
    assert not (run_dir / "checkpoints").exists() and not read_metrics(run_dir)  # nothing trained


# -- in the loop: equal to the reference forward on the step's weights ------------------------------


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory) -> tuple[Path, Path, Path]:
    """model=hf (a tiny Llama and its BPE tokenizer) trained 4 steps, tasks scored at steps 2 and 4."""
    root = tmp_path_factory.mktemp("hf_tasks")
    model_dir = save_pretrained_llama(root / "llama")
    task = write_task(root / "mc.jsonl")
    run_dir = root / "run"
    resume_run = [override for override in RESUME_RUN if not override.startswith("model.")]
    _ok(run_cli([*resume_run, "model=hf", f"model.path={model_dir}", "trainer.max_steps=4", "trainer.eval_every=2",
                 f"trainer.eval_tasks=[{task}]", "checkpoint.every=2", f"run.dir={run_dir}"]))
    return run_dir, task, model_dir


@pytest.mark.slow  # over 4 s (a process launch or ranks): out of the fast tier
def test_task_accuracy_in_the_loop_equals_transformers_own_forward_on_the_weights_of_that_step(hf_run):
    run_dir, task, _ = hf_run
    transformers = import_optional("transformers")
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(run_dir / "final" / "tokenizer.json"))

    def encode(text):
        return tokenizer.encode(text, add_special_tokens=False)

    evals = _evals(run_dir)
    assert sorted(evals) == [2, 4]
    for step in (2, 4):
        path = run_dir / "checkpoints" / ckpt.step_name(step)
        model = load_trained(TrainedWeights(path, ckpt.load_trainer_state(path)))
        assert isinstance(model, transformers.PreTrainedModel)  # transformers' own forward
        reference, lls = harness_reference(lambda inputs: model(inputs).logits, encode, task, max_length=64)
        assert evals[step] == (reference["acc"], reference["acc_norm"]), step
    # Each choice's log-likelihood, not only the counts: the scorer on the final weights, with the run's tokenizer.
    final = transformers.AutoModelForCausalLM.from_pretrained(run_dir / "final").eval()  # load_model's directory
    reference, lls = harness_reference(lambda inputs: final(inputs).logits, encode, task, max_length=64)
    assert evals[4] == (reference["acc"], reference["acc_norm"])
    encode_run, _ = run_tokenizer(str(run_dir / "final" / "tokenizer.json"), chat=False)
    scorer = TaskScorer([read_task(task)], encode_run, init_distributed(), max_length=64, micro_batch_size=8)
    scored = scorer.loglikelihoods(lambda inputs: final(inputs).logits)
    assert np.allclose(scored, lls, rtol=0, atol=1e-4)


@pytest.mark.slow  # over 4 s (a process launch or ranks): out of the fast tier
def test_the_evaluate_command_prints_the_same_numbers_for_a_run_and_a_transformers_directory(hf_run):
    run_dir, task, _ = hf_run
    acc, acc_norm = _evals(run_dir)[4]
    result = _ok(subprocess.run([*launch_command(["-m", "ddptrain.evaluate"]), str(run_dir), str(task)],
                                cwd=REPO, capture_output=True, text=True, timeout=300))  # the run's length: 64
    printed = json.loads(result.stdout.strip().splitlines()[-1])
    assert printed == {"task": "mc", "acc": acc, "acc_norm": acc_norm, "items": 24}
    from ddptrain.evaluate import evaluate

    # final/ of model=hf is a transformers directory: read as any other one
    assert evaluate(run_dir / "final", [task], max_length=64) == {"eval/mc/acc": acc, "eval/mc/acc_norm": acc_norm}


@pytest.mark.slow  # over 4 s (a process launch or ranks): out of the fast tier
def test_the_evaluate_command_wraps_contexts_in_the_chat_template(hf_run, tmp_path):
    """A transformers directory with a chat template: each context rendered as a user turn with the
    generation prompt and no delimiter, as lm-evaluation-harness's --apply_chat_template does."""
    import shutil

    run_dir, task, _ = hf_run
    transformers, tokenizers = import_optional("transformers"), import_optional("tokenizers")
    chat_dir = tmp_path / "chat"
    shutil.copytree(run_dir / "final", chat_dir)
    tokenizer = tokenizers.Tokenizer.from_file(str(chat_dir / "tokenizer.json"))
    tokenizer.add_special_tokens(["<|end|>"])
    tokenizer.save(str(chat_dir / "tokenizer.json"))
    template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    (chat_dir / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|end|>", "chat_template": template}))
    result = _ok(subprocess.run([*launch_command(["-m", "ddptrain.evaluate"]), str(chat_dir), str(task), "--chat-template",
                                 "--max-length", "64"], cwd=REPO, capture_output=True, text=True, timeout=300))
    printed = json.loads(result.stdout.strip().splitlines()[-1])

    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(chat_dir)
    rendered = tmp_path / "mc.jsonl"
    with open(rendered, "w", encoding="utf-8") as file:
        for line in task.read_text(encoding="utf-8").splitlines():
            item = json.loads(line)
            item["context"] = hf_tokenizer.apply_chat_template([{"role": "user", "content": item["context"]}],
                                                               tokenize=False, add_generation_prompt=True)
            item["target_delimiter"] = ""
            file.write(json.dumps(item) + "\n")
    assert json.loads(rendered.read_text().splitlines()[0])["context"].startswith("<|user|>")
    model = transformers.AutoModelForCausalLM.from_pretrained(chat_dir).eval()
    reference, _ = harness_reference(lambda inputs: model(inputs).logits,
                                     lambda text: hf_tokenizer.encode(text, add_special_tokens=False), rendered, 64)
    assert printed == {"task": "mc", "acc": reference["acc"], "acc_norm": reference["acc_norm"], "items": 24}


@pytest.mark.slow  # over 4 s (a process launch or ranks): out of the fast tier
def test_task_accuracy_of_the_builtin_gpt_equals_its_own_forward_on_the_step_weights(gpt_run):
    run_dir, task = gpt_run
    evals = _evals(run_dir)
    assert sorted(evals) == [1, 2]
    for step in (1, 2):
        path = run_dir / "checkpoints" / ckpt.step_name(step)
        model = load_trained(TrainedWeights(path, ckpt.load_trainer_state(path))).double()
        reference, _ = harness_reference(model, _byte_encode, task, max_length=64)
        assert evals[step] == (reference["acc"], reference["acc_norm"]), step


@pytest.mark.slow  # a trained run or a process launch (seconds): out of the fast tier
def test_the_plot_draws_task_accuracy_in_a_third_panel(hf_run):
    import_optional("matplotlib")
    from ddptrain.plot import make_figure

    fig = make_figure([hf_run[0]])
    assert len(fig.axes) == 3
    assert {line.get_label() for line in fig.axes[2].lines} == {"run mc/acc", "run mc/acc_norm"}


# -- any layout, any strategy ---------------------------------------------------------------------


LAYOUTS = [(1, "ddp"), (2, "ddp"), (2, "fsdp"), (2, "zero1"), (2, "zero2"), (2, "zero3")]


@pytest.fixture(scope="module")
def task_file(tmp_path_factory) -> Path:
    return write_task(tmp_path_factory.mktemp("layouts") / "mc.jsonl", items=25, seed=2)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory, task_file) -> dict:
    run_dir = tmp_path_factory.mktemp("one") / "run"
    _ok(run_cli(_layout_run(task_file, run_dir, "ddp")))
    return _evals(run_dir)


def _layout_run(task_file: Path, run_dir: Path, strategy: str) -> list[str]:
    # micro_tokens: microbatches of a token budget; 25 items do not divide over 2 ranks
    return [*RESUME_RUN, "trainer.max_steps=2", "trainer.eval_every=1", f"trainer.eval_tasks=[{task_file}]",
            "batch.micro_tokens=96", f"strategy={strategy}", f"run.dir={run_dir}"]


@pytest.mark.slow  # torchrun runs
@pytest.mark.parametrize("nproc, strategy", LAYOUTS[1:])
def test_task_accuracy_is_the_same_on_one_and_two_ranks_and_every_strategy(tmp_path, task_file, one_rank,
                                                                            nproc, strategy):
    if strategy.startswith("zero") and not is_installed("deepspeed"):
        pytest.skip("deepspeed is not installed: pip install 'ddptrain[deepspeed]'")
    run_dir = tmp_path / "run"
    _ok(run_cli(_layout_run(task_file, run_dir, strategy), nproc=nproc, timeout=600))
    assert _evals(run_dir) == one_rank
    assert sorted(one_rank) == [1, 2]


@pytest.mark.slow  # a trained run or a process launch (seconds): out of the fast tier
def test_a_locally_saved_harness_data_set_converts_to_a_task_file(tmp_path):
    datasets = import_optional("datasets")
    arc = datasets.Dataset.from_list([
        {"question": "What melts ice?", "choices": {"text": ["heat", "cold"], "label": ["A", "B"]}, "answerKey": "A"},
        {"question": "Which is a gas?", "choices": {"text": ["rock", "steam", "wood"], "label": ["1", "2", "3"]},
         "answerKey": "2"}])
    arc.save_to_disk(str(tmp_path / "arc"))
    script = str(REPO / "scripts" / "task_jsonl.py")
    result = _ok(subprocess.run([sys.executable, script, "arc_easy", str(tmp_path / "arc"),
                                 str(tmp_path / "arc_easy.jsonl")], cwd=REPO, capture_output=True, text=True))
    assert "wrote 2 items" in result.stdout
    task = read_task(tmp_path / "arc_easy.jsonl")
    assert task.name == "arc_easy"
    assert [(item.context, item.choices, item.label) for item in task.items] == [
        ("Question: What melts ice?\nAnswer:", ("heat", "cold"), 0),
        ("Question: Which is a gas?\nAnswer:", ("rock", "steam", "wood"), 1)]
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({"question": "2 + 2 =", "options": ["3", "4"], "answer": 1}) + "\n")
    _ok(subprocess.run([sys.executable, script, "fields", str(plain), str(tmp_path / "sums.jsonl"),
                        "--context", "question", "--choices", "options", "--label", "answer"], cwd=REPO,
                       capture_output=True, text=True))
    assert read_task(tmp_path / "sums.jsonl").items[0] == Item("2 + 2 =", ("3", "4"), 1)
