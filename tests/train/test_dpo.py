"""objective=dpo through the command line: the same losses and rewards for every layout on one and
two ranks (torchrun, gloo), and the loss after one update equal to TRL DPOTrainer's on the same pairs."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from ddptrain.config.compose import compose_config
from ddptrain.config.schema import ConfigError
from ddptrain.config.validation import validate
from ddptrain.data.cache import array_digest
from tests.data.chats import write_jsonl
from tests.data.pairs import random_pairs
from tests.data.test_sft import _llama_with_chat_tokenizer
from tests.helpers import import_deepspeed, import_optional, read_metrics, run_cli

transformers = import_optional("transformers")
SEQ = 96
# A token budget under which the 48 pairs leave a rank short of microbatches in training steps 2 and 3 and in
# evaluation (a rank runs fillers, the reference's forward included): at 2 * SEQ both ranks hold as many
BUDGET = 5 * SEQ // 4
METRICS = ("loss", "reward_chosen", "reward_rejected", "reward_margin", "reward_accuracy")
DPO_RUN = ["model=hf", "data=preference", "objective=dpo", "trainer.precision=fp64", "trainer.log_every=1",
           "trainer.max_steps=3", "optim=sgd", "optim.lr=0.5", "trainer.grad_clip=null", "trainer.eval_examples=4",
           f"batch.seq_len={SEQ}", "batch.global_size=8"]


def test_dpo_and_preference_data_go_together_and_dpo_keys_need_dpo():
    with pytest.raises(ConfigError, match="objective=dpo with data=stdlib: objective=dpo trains on preference pairs"):
        validate(compose_config(["objective=dpo"]), 1)
    with pytest.raises(ConfigError, match="objective=token with data=preference"):
        validate(compose_config(["data=preference", "data.paths=[p.jsonl]"]), 1)
    with pytest.raises(ConfigError, match=r"objective.beta=0.5 is read only when objective.name is dpo"):
        validate(compose_config(["objective.beta=0.5"]), 1)
    with pytest.raises(ConfigError, match=r"objective.loss_type='hinge' is not one of sigmoid, ipo"):
        validate(compose_config(["objective=dpo", "data=preference", "data.paths=[p.jsonl]",
                                 "objective.loss_type=hinge"]), 1)
    cfg = compose_config(["objective=dpo", "data=preference", "data.paths=[p.jsonl]"])
    validate(cfg, 1)
    assert OmegaConf.to_container(cfg.objective) == {"name": "dpo", "label_smoothing": 0.0, "z_loss": 0.0,
                                                     "beta": 0.1, "loss_type": "sigmoid",
                                                     "precompute_reference": False}


class LaunchedOnce:
    """The 48 training pairs both layout tests train on, and each one-launch run of theirs launched once
    in this file (the ddp run under a token budget is in both); a test reads these runs, never changes them."""

    def __init__(self, root: Path):
        self.root, self.launched = root, {}
        model_dir = _llama_with_chat_tokenizer(root / "model")
        train = write_jsonl(root / "train.jsonl", random_pairs(48, seed=11, conversational=True))
        val = write_jsonl(root / "val.jsonl", random_pairs(6, seed=12, conversational=True))
        self.common = [*DPO_RUN, f"model.path={model_dir}", f"data.paths=[{train}]", f"data.val_paths=[{val}]",
                       # at lr 0.5 the loss climbs and amplifies fp32's rounding (zero2's other reduction order)
                       f"data.cache_dir={root / 'cache'}", "optim.lr=0.05"]

    def base(self, lora: bool) -> list[str]:
        return [*self.common, *(["model.lora.r=4"] if lora else [])]

    def run(self, lora: bool, ranks: int, options: list[str]) -> tuple[Path, str]:
        """(run dir, stderr) of these pairs trained with `options` on `ranks` ranks."""
        key = (lora, ranks, tuple(sorted(options)))
        if key not in self.launched:
            run_dir = self.root / f"run{len(self.launched)}"
            result = run_cli([*self.base(lora), *options, f"run.dir={run_dir}"], nproc=ranks)
            assert result.returncode == 0, (key, result.stderr[-3000:])
            self.launched[key] = run_dir, result.stderr
        return self.launched[key]


@pytest.fixture(scope="module")
def pairs_48(tmp_path_factory) -> LaunchedOnce:
    return LaunchedOnce(tmp_path_factory.mktemp("pairs-48"))


@pytest.mark.slow
@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_dpo_is_exact_over_layouts_ranks_budgets_packing_and_resume(pairs_48, tmp_path, lora):
    layouts = {"1x8": (1, ["batch.pack=false", "batch.micro_size=8"]),
               "2x2": (2, ["batch.pack=false", "batch.micro_size=2"]),  # resumed in the default layout
               "2 ranks, budget": (2, [f"batch.micro_tokens={BUDGET}"]),
               "packed": (1, ["batch.pack=true", "batch.micro_size=1"]),
               "2 ranks, packed, budget": (2, ["batch.pack=true", f"batch.micro_tokens={4 * SEQ}"])}
    curves, outputs = {}, {}
    for name, (ranks, options) in layouts.items():
        if name == "2x2":  # two steps, then a re-run with three resumes from the final checkpoint
            run_dir = tmp_path / "2x2"
            first = run_cli([*pairs_48.base(lora), *options, "trainer.max_steps=2", f"run.dir={run_dir}"],
                            nproc=ranks)
            assert first.returncode == 0, first.stderr[-3000:]
            # resumed in the default layout (packed pairs, one row per microbatch): the same sample
            result = run_cli([*pairs_48.base(lora), f"run.dir={run_dir}"], nproc=ranks)
            assert result.returncode == 0, result.stderr[-3000:]
            stderr = result.stderr
            assert "layout: packed pairs (the default for data=preference)" in stderr
            assert "batch.pack changed from False to True (applied)" in stderr
            assert "batch.micro_size changed from 2 to 1 (applied)" in stderr
        else:
            run_dir, stderr = pairs_48.run(lora, ranks, options)
        curves[name], outputs[name] = read_metrics(run_dir), stderr
    assert "resumed from" in outputs["2x2"]
    reference = curves["1x8"]
    assert reference[0]["loss"] == pytest.approx(math.log(2), rel=1e-12), "step 1: the policy is the reference"
    assert reference[2]["loss"] != reference[0]["loss"] and reference[2]["reward_margin"] != 0, "it trained"
    for name, curve in curves.items():
        assert [m["step"] for m in curve] == [1, 2, 3], name
        for mine, ref in zip(curve, reference):
            assert mine["tokens"] == ref["tokens"] == 8, (name, "pairs per step")
            for key in METRICS:
                assert math.isclose(mine[key], ref[key], rel_tol=1e-9, abs_tol=1e-12), (name, key, mine[key], ref[key])
        assert math.isclose(curve[-1]["val_loss"], reference[-1]["val_loss"], rel_tol=1e-9), name


# -- against the peer: TRL's DPOTrainer ------------------------------------------------------------


def _trl_loss_after_one_update(model_dir, records, lora: bool, loss_type: str, lr: float, seed: int, tmp_path):
    """TRL DPOTrainer's own loss of the 8 pairs after one SGD update on them (fp32, no clipping): the
    model is the one ddptrain's build gives (the same base, the same LoRA initialisation)."""
    datasets = import_optional("datasets")
    trl = import_optional("trl")
    from ddptrain.train.builder import build_model

    overrides = ["model=hf", f"model.path={model_dir}", f"run.seed={seed}", f"batch.seq_len={SEQ}",
                 *(["model.lora.r=4"] if lora else [])]
    cfg = compose_config(overrides)
    model, _, _ = build_model(cfg, 600, torch.device("cpu"), "fp32")
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    args = trl.DPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=8, max_steps=2,
                         learning_rate=lr, optim="sgd", lr_scheduler_type="constant", warmup_steps=0,
                         max_grad_norm=0.0, weight_decay=0.0, beta=0.1, loss_type=[loss_type], logging_steps=1,
                         max_length=None, report_to=[], save_strategy="no", bf16=False, use_cpu=True, seed=seed,
                         dataloader_drop_last=False)
    trainer = trl.DPOTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(records),
                             processing_class=tokenizer)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return losses[1]  # step 2's loss: the same 8 pairs after one update


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_the_loss_after_one_update_is_trl_dpo_trainers(tmp_path, lora, loss_type):
    model_dir = _llama_with_chat_tokenizer(tmp_path / "model")
    records = random_pairs(8, seed=21, conversational=True)
    path = write_jsonl(tmp_path / "pairs.jsonl", records)
    lr = 2.0 if loss_type == "sigmoid" else 0.002
    run_dir = tmp_path / "run"
    result = run_cli(["model=hf", f"model.path={model_dir}", "data=preference", "objective=dpo",
                      f"objective.loss_type={loss_type}", f"data.paths=[{path}]", f"data.val_paths=[{path}]",
                      f"data.cache_dir={tmp_path / 'cache'}", "optim=sgd", f"optim.lr={lr}", "trainer.grad_clip=null",
                      "trainer.max_steps=2", "trainer.log_every=1", "trainer.eval_examples=8", f"batch.seq_len={SEQ}",
                      "batch.global_size=8", "batch.micro_size=8", "run.seed=5", f"run.dir={run_dir}",
                      *(["model.lora.r=4"] if lora else [])])
    assert result.returncode == 0, result.stderr[-3000:]
    ours = read_metrics(run_dir)[1]["loss"]
    theirs = _trl_loss_after_one_update(model_dir, records, lora, loss_type, lr, 5, tmp_path)
    first = read_metrics(run_dir)[0]["loss"]
    print(f"\n{'LoRA' if lora else 'full'} {loss_type}: loss before {first:.6f}, after one update: ddptrain "
          f"{ours:.8f}, TRL DPOTrainer {theirs:.8f}, relative difference {abs(ours - theirs) / abs(theirs):.2e}")
    assert abs(ours - first) > 1e-3 * abs(first), "the update changed the loss"
    assert math.isclose(ours, theirs, rel_tol=1e-5)


@pytest.mark.slow
def test_precomputed_reference_log_probs_give_the_same_run_survive_a_resume_and_refuse_another_model(tmp_path):
    model_dir = _llama_with_chat_tokenizer(tmp_path / "model")
    train = write_jsonl(tmp_path / "train.jsonl", random_pairs(24, seed=13, conversational=True))
    val = write_jsonl(tmp_path / "val.jsonl", random_pairs(4, seed=14, conversational=True))
    base = [*DPO_RUN, f"model.path={model_dir}", f"data.paths=[{train}]", f"data.val_paths=[{val}]",
            f"data.cache_dir={tmp_path / 'cache'}", "model.lora.r=4", "batch.micro_size=2"]
    each_step = run_cli([*base, f"run.dir={tmp_path / 'each_step'}"], nproc=2)
    assert each_step.returncode == 0, each_step.stderr[-3000:]
    precomputed = [*base, "objective.precompute_reference=true"]
    first = run_cli([*precomputed, "trainer.max_steps=2", f"run.dir={tmp_path / 'pre'}"], nproc=2)
    assert first.returncode == 0 and "computed before step 1" in first.stderr, first.stderr[-3000:]
    resumed = run_cli([*precomputed, f"run.dir={tmp_path / 'pre'}"], nproc=2)
    assert resumed.returncode == 0 and "resumed from" in resumed.stderr, resumed.stderr[-3000:]
    assert "reused from" in resumed.stderr and "computed before step 1" not in resumed.stderr
    for mine, ref in zip(read_metrics(tmp_path / "pre"), read_metrics(tmp_path / "each_step"), strict=True):
        for key in (*METRICS, "val_loss"):
            # Step 1's rewards are 0 up to rounding (policy = reference, computed in other batch shapes):
            # which of two zeros is larger is noise.
            if key in ref and not (key == "reward_accuracy" and mine["step"] == 1):
                assert math.isclose(mine[key], ref[key], rel_tol=1e-9, abs_tol=1e-12), (mine["step"], key)
    other = _llama_with_chat_tokenizer(tmp_path / "other")  # other weights: the same files, rescaled head
    model = transformers.AutoModelForCausalLM.from_pretrained(other)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.5)
    model.save_pretrained(model_dir)
    refused = run_cli([*precomputed, "trainer.max_steps=4", f"run.dir={tmp_path / 'pre'}"], nproc=2)
    assert refused.returncode != 0 and "the run's inputs differ from the checkpoint's: data.reference: " in \
        refused.stderr, refused.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_dpo_gives_the_same_losses_and_rewards_on_fsdp_and_zero2_as_ddp(pairs_48, lora):
    """fsdp in fp64 to 1e-9 and zero2 in fp32 to 1e-6 against ddp, 2 ranks under a token budget (ragged
    microbatch counts in training and evaluation: a rank runs filler forwards, the reference's included)."""
    import_deepspeed()
    runs = {"ddp fp64": [], "fsdp fp64": ["strategy=fsdp"], "ddp fp32": ["trainer.precision=fp32"],
            "zero2 fp32": ["strategy=zero2", "trainer.precision=fp32"]}
    curves = {name: read_metrics(pairs_48.run(lora, 2, [f"batch.micro_tokens={BUDGET}", *options])[0])
              for name, options in runs.items()}
    assert any(m["filler_microbatches"] > 0 for m in curves["fsdp fp64"]), "the budget must leave a rank short"
    # (relative, absolute) tolerances; the rewards' margin can pass near 0, where only an absolute one holds
    pairs = {("ddp fp64", "fsdp fp64"): (1e-9, 1e-12), ("ddp fp32", "zero2 fp32"): (1e-6, 1e-6)}
    for (reference, other), (tolerance, absolute) in pairs.items():
        assert curves[reference][2]["loss"] != curves[reference][0]["loss"], "it trained"
        for mine, ref in zip(curves[other], curves[reference], strict=True):
            for key in METRICS:
                # Step 1's rewards are 0 up to rounding (policy = reference): which of two zeros is larger is noise.
                if not (key == "reward_accuracy" and mine["step"] == 1):
                    assert math.isclose(mine[key], ref[key], rel_tol=tolerance, abs_tol=absolute), \
                        (other, mine["step"], key, mine[key], ref[key])
        # the evaluation's fillers (a rank short of microbatches runs the reference's forward too): the same loss
        assert math.isclose(curves[other][-1]["val_loss"], curves[reference][-1]["val_loss"], rel_tol=tolerance)


def _tree(directory) -> dict[str, bytes]:
    """Every file under `directory` (relative name -> bytes): what a refused launch must leave as it was."""
    return {str(path.relative_to(directory)): path.read_bytes() for path in sorted(directory.rglob("*"))
            if path.is_file() and path.name != "train.log"}


@pytest.mark.slow
def test_a_full_fine_tune_does_not_resume_against_other_weights_at_model_path(tmp_path):
    """The frozen reference is rebuilt from model.path at every launch: other weights there are refused
    by name, leaving the run as it was; the original weights put back, the run resumes exactly."""
    model_dir = _llama_with_chat_tokenizer(tmp_path / "model")
    train = write_jsonl(tmp_path / "train.jsonl", random_pairs(24, seed=15, conversational=True))
    base = [*DPO_RUN, f"model.path={model_dir}", f"data.paths=[{train}]",
            f"data.cache_dir={tmp_path / 'cache'}", "batch.micro_size=4"]
    straight = run_cli([*base, f"run.dir={tmp_path / 'straight'}"])
    assert straight.returncode == 0, straight.stderr[-3000:]
    run_dir = tmp_path / "run"
    first = run_cli([*base, "trainer.max_steps=2", f"run.dir={run_dir}"])
    assert first.returncode == 0, first.stderr[-3000:]
    weights = model_dir / "model.safetensors"
    original = weights.read_bytes()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.5)  # a re-download of another revision, an overwrite
    model.save_pretrained(model_dir)
    assert weights.read_bytes() != original
    before = _tree(run_dir)
    refused = run_cli([*base, f"run.dir={run_dir}"])
    assert refused.returncode != 0, refused.stderr[-3000:]
    assert "the run's inputs differ from the checkpoint's: reference.weights: " in refused.stderr, refused.stderr[-3000:]
    assert "put the weights the run started from back at model.path" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert _tree(run_dir) == before, "a refused resume leaves the run's checkpoints, final/, metrics and config"
    weights.write_bytes(original)
    resumed = run_cli([*base, f"run.dir={run_dir}"])
    assert resumed.returncode == 0 and "resumed from" in resumed.stderr, resumed.stderr[-3000:]
    assert read_metrics(run_dir) == read_metrics(tmp_path / "straight") or all(
        math.isclose(mine[key], ref[key], rel_tol=1e-12, abs_tol=1e-15)
        for mine, ref in zip(read_metrics(run_dir), read_metrics(tmp_path / "straight"), strict=True)
        for key in METRICS)


def _flip_bytes(path):
    data = bytearray(path.read_bytes())
    for offset in (len(data) - 8, len(data) - 3):  # inside the last value: a log-prob off by orders of magnitude
        data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def _saved_with_its_checksum(values):
    """A well-formed entry of other values, its checksum rewritten to match: the length and finiteness checks."""
    def damage(path):
        np.save(path, values(np.load(path)))
        path.with_name(path.name + ".sha256").write_text(array_digest(path) + "\n")
    return damage


@pytest.mark.slow
def test_a_damaged_reference_cache_entry_is_recomputed_with_a_warning_never_trained_against(tmp_path):
    """Flipped bits, a truncated file, a file that is no array, a missing checksum, too few values, a
    NaN: each is named in a warning and recomputed, and the run's step-1 loss is the clean run's."""
    model_dir = _llama_with_chat_tokenizer(tmp_path / "model")
    train = write_jsonl(tmp_path / "train.jsonl", random_pairs(16, seed=17, conversational=True))
    val = write_jsonl(tmp_path / "val.jsonl", random_pairs(4, seed=18, conversational=True))
    cache = tmp_path / "cache"
    base = [*DPO_RUN, f"model.path={model_dir}", f"data.paths=[{train}]", f"data.val_paths=[{val}]",
            f"data.cache_dir={cache}", "batch.micro_size=4", "trainer.max_steps=1",
            "objective.precompute_reference=true"]
    clean = run_cli([*base, f"run.dir={tmp_path / 'clean'}"])
    assert clean.returncode == 0 and "computed before step 1" in clean.stderr, clean.stderr[-3000:]
    [train_entry] = (cache / "reference").glob("*.train.npy")
    [val_entry] = (cache / "reference").glob("*.val.npy")
    entries = {"train": train_entry, "val": val_entry}
    written = {split: path.read_bytes() for split, path in entries.items()}
    damages = [
        {"train": _flip_bytes, "val": lambda path: path.write_bytes(path.read_bytes()[:100])},
        {"train": lambda path: path.write_text("not an array\n"),
         "val": lambda path: path.with_name(path.name + ".sha256").unlink()},
        {"train": _saved_with_its_checksum(lambda values: values[:-2]),
         "val": _saved_with_its_checksum(lambda values: np.where(np.arange(len(values)) == 3, np.nan, values))},
    ]
    for launch, damage in enumerate(damages):
        for split, path in entries.items():
            damage[split](path)
        result = run_cli([*base, f"run.dir={tmp_path / f'damaged{launch}'}"])
        assert result.returncode == 0, result.stderr[-3000:]
        assert "Traceback" not in result.stderr
        for split, path in entries.items():
            assert f"reference: cache entry {path} is damaged (" in result.stderr, (launch, split, result.stderr[-3000:])
            assert path.read_bytes() == written[split], "recomputed, the same values, verified by the next launch"
        assert "reused from" not in result.stderr
        for mine, ref in zip(read_metrics(tmp_path / f"damaged{launch}"), read_metrics(tmp_path / "clean"), strict=True):
            assert mine["loss"] == ref["loss"] and mine["val_loss"] == ref["val_loss"], (launch, mine, ref)
