"""Export to Hugging Face: the converted GPT-2 computes the GPT's logits, round-trips through
save_pretrained / from_pretrained, generates greedily like the GPT, and the CLI refuses what it cannot do."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess

import pytest
import torch
from torch import nn

import ddptrain
from ddptrain.export import ExportError, export, main
from ddptrain.models import GPT, GPTConfig
from ddptrain.models.convert import gpt_to_hf
from ddptrain.runs.layout import RUN_ENTRIES
from tests.helpers import REPO, TINY_RUN, import_optional, run_cli, save_bpe_tokenizer
from tests.zygote import launch_command

transformers = import_optional("transformers")

VOCAB, SEQ = 256, 64
LENGTHS = (1, 7, SEQ)


def random_gpt(bias: bool, dtype: torch.dtype = torch.float32, seed: int = 0) -> GPT:
    """A GPT whose LayerNorm weights are not 1 and biases not 0, so a mapping that drops them shows."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=VOCAB, max_seq_len=SEQ, n_layer=2, n_head=4, n_embd=64, bias=bias))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    return model.to(dtype).eval()


def max_logit_difference(gpt: nn.Module, hf_model: nn.Module, seed: int = 1) -> float:
    gen = torch.Generator().manual_seed(seed)
    worst = 0.0
    with torch.no_grad():
        for length in LENGTHS:
            idx = torch.randint(0, VOCAB, (3, length), generator=gen)
            worst = max(worst, float((gpt(idx) - hf_model(idx).logits).abs().max()))
    return worst


def greedy(gpt: GPT, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    ids = prompt
    with torch.no_grad():
        for _ in range(new_tokens):
            next_id = gpt(ids)[:, -1].argmax(dim=-1, keepdim=True)  # (B, 1)
            ids = torch.cat([ids, next_id], dim=1)
    return ids


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-4), (torch.float64, 1e-10)], ids=["fp32", "fp64"])
def test_converted_gpt_gives_the_same_logits(bias, dtype, tolerance):
    gpt = random_gpt(bias, dtype)
    hf_model = gpt_to_hf(gpt)
    assert isinstance(hf_model, transformers.GPT2LMHeadModel)
    assert hf_model.dtype == dtype and not hf_model.training
    assert max_logit_difference(gpt, hf_model) <= tolerance


def test_config_pins_the_gpt_math():
    config = gpt_to_hf(random_gpt(bias=False)).config
    assert config.activation_function == "gelu"  # erf, as F.gelu; not gelu_new
    assert config.layer_norm_epsilon == 1e-5
    assert (config.n_positions, config.vocab_size, config.n_layer, config.n_head, config.n_embd) == (SEQ, VOCAB, 2, 4, 64)
    assert config.attn_pdrop == config.resid_pdrop == config.embd_pdrop == config.summary_first_dropout == 0
    assert not config.scale_attn_by_inverse_layer_idx and not config.reorder_and_upcast_attn
    assert config.tie_word_embeddings
    assert config.bos_token_id is None and config.eos_token_id is None and config.pad_token_id is None


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_save_pretrained_round_trips_through_auto_model(tmp_path, bias):
    gpt = random_gpt(bias)
    gpt_to_hf(gpt).save_pretrained(tmp_path / "hf")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert isinstance(loaded, transformers.GPT2LMHeadModel)
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr(), "embeddings must stay tied"
    assert max_logit_difference(gpt, loaded) <= 1e-4


class _WarningRecorder(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_generate_matches_a_greedy_loop_without_warnings():
    gpt = random_gpt(bias=True)
    hf_model = gpt_to_hf(gpt)
    prompt = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(2))
    prompt[:, 1] = 0  # byte 0 must stay an ordinary token, never inferred as padding
    recorder = _WarningRecorder()
    hf_logger = logging.getLogger("transformers")
    hf_logger.addHandler(recorder)
    try:
        generated = hf_model.generate(prompt, do_sample=False, max_new_tokens=8)
    finally:
        hf_logger.removeHandler(recorder)
    assert generated.shape == (2, 13)
    assert torch.equal(generated, greedy(gpt, prompt, 8))
    assert recorder.messages == []


def _run_whose_weights_load_as(monkeypatch, run_dir, model: nn.Module) -> None:
    """`run_dir` with a final/ whose marker alone verifies (as an older ddptrain wrote it), and the
    export's loader giving `model` for it."""
    (run_dir / "final").mkdir(parents=True, exist_ok=True)
    (run_dir / "final" / "ddptrain_model.json").write_text(json.dumps({"step": 1}))
    monkeypatch.setattr("ddptrain.export.load_trained", lambda weights: model)


def test_export_refuses_a_model_with_no_transformers_architecture(tmp_path, monkeypatch, capsys):
    _run_whose_weights_load_as(monkeypatch, tmp_path / "run", nn.Linear(2, 2))
    with pytest.raises(ExportError, match=r"torch\.nn\.modules\.linear\.Linear has no transformers "
                                          r"architecture.*ddptrain\.load_model"):
        export(tmp_path / "run", tmp_path / "out")
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path / "run"), str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert "no transformers architecture" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"], "nothing may be left behind"


def test_export_refuses_a_missing_run_dir_a_run_without_weights_and_a_non_empty_out_dir(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path / "missing"), str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert f"run directory {tmp_path / 'missing'} does not exist" in capsys.readouterr().err
    (tmp_path / "run").mkdir()
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path / "run"), str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert str(tmp_path / "run") in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path / "run"), str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert f"output directory {tmp_path / 'out'} already exists and is not empty" in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]


def test_a_failed_export_leaves_nothing_half_written(tmp_path, monkeypatch):
    _run_whose_weights_load_as(monkeypatch, tmp_path / "run", random_gpt(bias=False))

    def fail(weights, out_dir):
        assert (out_dir / "config.json").is_file(), "the weights are written before the tokenizer files"
        raise OSError("disk full")

    monkeypatch.setattr("ddptrain.export._copy_tokenizer_files", fail)
    with pytest.raises(OSError, match="disk full"):
        export(tmp_path / "run", tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_export_writes_the_model_and_the_run_tokenizer_files(tmp_path, monkeypatch):
    gpt = random_gpt(bias=True)
    weights = tmp_path / "run" / "final"
    weights.mkdir(parents=True)
    for name, text in [("tokenizer.json", "{}"), ("tokenizer_config.json", '{"a": 1}'), ("model.safetensors", "x")]:
        (weights / name).write_text(text)
    _run_whose_weights_load_as(monkeypatch, tmp_path / "run", gpt)
    (tmp_path / "out").mkdir()  # an existing empty directory is fine
    assert export(tmp_path / "run", tmp_path / "out") == tmp_path / "out"
    written = {p.name for p in (tmp_path / "out").iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= written
    assert (tmp_path / "out" / "tokenizer_config.json").read_text() == '{"a": 1}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "run"], "no staging directory may remain"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert max_logit_difference(gpt, loaded) <= 1e-4


@pytest.mark.slow
def test_exported_run_matches_load_model_end_to_end(tmp_path):
    run_dir, out_dir = tmp_path / "run", tmp_path / "hf"
    result = run_cli([*TINY_RUN, "trainer.max_steps=3", "batch.global_size=4", "batch.micro_size=4",
                      "batch.seq_len=64", f"run.dir={run_dir}"])
    assert result.returncode == 0, result.stderr[-3000:]
    result = subprocess.run([*launch_command(["-m", "ddptrain.export"]), str(run_dir), str(out_dir)], cwd=REPO,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""},
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (out_dir / "config.json").is_file()

    trained = ddptrain.load_model(run_dir)
    exported = transformers.AutoModelForCausalLM.from_pretrained(out_dir).eval()
    # 3 steps from a 0.02-std init keep activations small, where gelu_new ~ gelu: check the config too.
    assert exported.config.activation_function == "gelu"
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for length in (1, 17, 64):
            idx = torch.randint(0, trained.cfg.vocab_size, (2, length), generator=gen)
            assert float((trained(idx) - exported(idx).logits).abs().max()) <= 1e-4
    prompt = torch.tensor([list(b"def ")])
    generated = exported.generate(prompt, do_sample=False, max_new_tokens=8)
    assert torch.equal(generated, greedy(trained, prompt, 8))

    again = subprocess.run([*launch_command(["-m", "ddptrain.export"]), str(run_dir), str(out_dir)], cwd=REPO,
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 2 and "already exists and is not empty" in again.stderr


def test_an_out_dir_that_cannot_be_made_is_a_clear_error(tmp_path, monkeypatch, capsys):
    _run_whose_weights_load_as(monkeypatch, tmp_path / "run", random_gpt(bias=False))
    (tmp_path / "afile").write_text("mine")
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path / "run"), str(tmp_path / "afile" / "out")])
    assert exit_info.value.code == 2
    assert f"export error: cannot write {tmp_path / 'afile' / 'out'}" in capsys.readouterr().err
    assert (tmp_path / "afile").read_text() == "mine"


@pytest.mark.slow
def test_a_tokenizer_of_any_name_is_final_tokenizer_json_and_is_exported_and_served(tmp_path):
    from ddptrain.serving.servable import servable_dir

    (tmp_path / "tok").mkdir()
    tokenizer = save_bpe_tokenizer(tmp_path / "tok" / "code_bpe.json")
    run_dir = tmp_path / "run"
    result = run_cli([*TINY_RUN, f"data.tokenizer={tokenizer}", "trainer.max_steps=1", "batch.global_size=4",
                      "batch.micro_size=4", "batch.seq_len=32", f"run.dir={run_dir}"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in (run_dir / "final").glob("*.json")) == ["ddptrain_model.json", "tokenizer.json"]
    assert (run_dir / "final" / "tokenizer.json").read_bytes() == tokenizer.read_bytes()
    export(run_dir, tmp_path / "hf")
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == tokenizer.read_bytes()
    assert (servable_dir(run_dir) / "tokenizer.json").read_bytes() == tokenizer.read_bytes()


def test_a_checkpoint_without_a_model_spec_is_a_clear_error_in_export_and_serving(tmp_path, capsys):
    """An older ddptrain's checkpoint (no model spec in trainer.pt): exit 2 naming it, not a traceback."""
    from ddptrain.serving.servable import ServableError, servable_dir
    from ddptrain.runs.store import MARKER, checkpoint_dir
    from ddptrain.fsutil import sha256_file

    step = checkpoint_dir(tmp_path / "run") / "step_00000002"
    step.mkdir(parents=True)
    torch.save({"step": 2, "world_size": 1}, step / "trainer.pt")
    (step / MARKER).write_text(json.dumps({"step": 2, "sha256": {"trainer.pt": sha256_file(step / "trainer.pt")}}))
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path / "run"), str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert f"{step} was written by an older ddptrain without a model spec" in capsys.readouterr().err
    with pytest.raises(ServableError, match="without a model spec"):
        servable_dir(tmp_path / "run")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


@pytest.mark.parametrize("trained, rebuilt, mismatch", [
    ({"n_layer": 1}, {"n_layer": 2}, r"missing \['blocks\.1\."),
    ({"n_embd": 32}, {"n_embd": 64}, r"differ: size mismatch for tok_emb\.weight"),
], ids=["a_layer_more", "wider"])
def test_weights_that_do_not_fit_the_rebuilt_model_are_a_clear_export_and_serve_error(tmp_path, capsys, trained,
                                                                                       rebuilt, mismatch):
    """final/ whose spec rebuilds another shape than its weights (a hand-edited spec, a factory that
    changed since the run): export exits 2 naming final/ and the mismatch, serving is a ServableError."""
    from ddptrain.models.adapters import adapter_for
    from ddptrain.serving.servable import ServableError, servable_dir
    from ddptrain.runs.weights import save_final

    def built(fields):
        return adapter_for({"name": "gpt"}).build({"name": "gpt", "n_layer": 1, "n_head": 2, "n_embd": 32, **fields},
                                                   VOCAB, SEQ)

    module, _ = built(trained)
    _, spec = built(rebuilt)
    final = save_final(tmp_path / "run", module, module.state_dict(), spec, step=1, tokenizer_files={})
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path / "run"), str(tmp_path / "out")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"export error: {final}: the weights do not fit ddptrain.models.gpt.GPT (")
    assert re.search(mismatch, err) and "Traceback" not in err, err
    with pytest.raises(ServableError, match=rf"cannot be served: .*the weights do not fit.*{mismatch}"):
        servable_dir(tmp_path / "run")
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["final"], "nothing half-written is left"


def test_serving_and_exporting_a_checkpoint_read_its_trainer_state_once(tmp_path, monkeypatch, capsys):
    """A run without final/ yet: servable_dir (the stamp, the load, the tokenizer files, the stop
    tokens) and the export command each read the checkpoint's trainer.pt once, and still give its weights."""
    from ddptrain.models.adapters import adapter_for
    from ddptrain.serving.servable import servable_dir
    from ddptrain.runs import store as ckpt

    torch.manual_seed(0)
    module, spec = adapter_for({"name": "gpt"}).build({"name": "gpt", "n_layer": 1, "n_head": 2, "n_embd": 32},
                                                       VOCAB, SEQ)
    engine = ddptrain.Engine(module, torch.optim.SGD(module.parameters(), lr=0.1), "ddp", device=torch.device("cpu"))
    step = ckpt.write_checkpoint(tmp_path / "run", 1, {"step": 1, "model_spec": spec.to_dict(), "config": {"data": {}}},
                                 save_state=engine.save)
    loads, real_load = [], torch.load

    def counting_load(file, *args, **kwargs):  # counts, then loads as torch does
        loads.append(str(file))
        return real_load(file, *args, **kwargs)

    monkeypatch.setattr(torch, "load", counting_load)
    trainer_pt = str(step / "trainer.pt")
    served = servable_dir(tmp_path / "run")
    assert loads.count(trainer_pt) == 1, loads
    loads.clear()
    main([str(tmp_path / "run"), str(tmp_path / "out")])
    assert loads.count(trainer_pt) == 1, loads
    assert f"exported the newest checkpoint, {step.name}" in capsys.readouterr().err
    for directory in (served, tmp_path / "out"):
        exported = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
        assert max_logit_difference(module.eval(), exported) <= 1e-4


@pytest.mark.parametrize("inside", ["final/x", "checkpoints/step_00000002/x", "checkpoints/new", "servable/x",
                                    "previous/x", "final", "best", "servable-best", "tensorboard/x", "wandb",
                                    "mlflow.json", ".failpoints", "previous/20260101-000000/best"])
def test_an_export_into_a_directory_the_run_manages_is_refused_and_writes_nothing(tmp_path, capsys, inside):
    run = tmp_path / "run"
    for name in ("final", "checkpoints/step_00000002", "servable", "previous"):
        (run / name).mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 2}\n')
    before = sorted(str(path) for path in tmp_path.rglob("*"))
    with pytest.raises(SystemExit) as exit_info:
        main([str(run), str(run / inside)])  # the next launch would swap final/, purge the step, or rebuild servable/
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    [entry] = [name for name in RUN_ENTRIES if f"{run / name}, which the run manages ({RUN_ENTRIES[name]})" in error]
    assert f"{run / inside}" in error and inside.startswith(entry), error
    assert len(error.strip().splitlines()) == 1, error
    assert sorted(str(path) for path in tmp_path.rglob("*")) == before


@pytest.mark.slow
def test_an_export_into_a_run_dirs_best_or_servable_best_is_refused_on_the_command_line(tmp_path):
    """The next `serve --which best` or resume with checkpoint.keep_best would delete such an export:
    refused whether the entry is there yet or not, with one line naming it and the rule."""
    run_dir = tmp_path / "run"
    result = run_cli([*TINY_RUN, "trainer.max_steps=1", "batch.global_size=4", "batch.micro_size=4",
                      "batch.seq_len=64", f"run.dir={run_dir}"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert not (run_dir / "best").exists()
    for target in ("servable-best", "best", "tensorboard", "previous/x"):
        refused = subprocess.run([*launch_command(["-m", "ddptrain.export"]), str(run_dir), str(run_dir / target)],
                                 cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""},
                                 capture_output=True, text=True, timeout=300)
        assert refused.returncode == 2, (target, refused.stderr[-3000:])
        assert refused.stderr.strip().splitlines() == [refused.stderr.strip()], refused.stderr
        assert refused.stderr.startswith(f"export error: output directory {run_dir / target} is")
        assert "which the run manages" in refused.stderr and "pick a path outside" in refused.stderr
        assert not (run_dir / target).exists() and not (run_dir / "previous").exists(), target
