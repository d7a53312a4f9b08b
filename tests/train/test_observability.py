"""What users see: metrics fields, FLOP/s against a hand count, wandb offline read back and resumed,
rank-0-only progress in a 2-rank run, the progress bar, and the plot command. Real CLI runs, tiny."""

from __future__ import annotations

import io
import json
import logging
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ddptrain.train.flops import ModelFlops, device_peak_flops, lookup_peak_flops
from ddptrain.models import GPT, GPTConfig
from ddptrain.train.progress import Progress
from tests.helpers import REPO, TINY_RUN, read_metrics, run_cli

SMALL = [*TINY_RUN, "batch.seq_len=64", "batch.global_size=8", "batch.micro_size=4"]
TIME_SPLIT = ("data_wait_s", "forward_backward_s", "comm_wait_s", "optimizer_s")


def _ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("tiny")
    _ok(run_cli([*SMALL, "trainer.max_steps=4", "trainer.eval_every=2", f"run.dir={run_dir}"]))
    return run_dir


# -- metrics.jsonl ------------------------------------------------------------------------------


@pytest.mark.slow  # over 4 s (a process launch or ranks): out of the fast tier
def test_metrics_lines_carry_every_field(tiny_run):
    metrics = read_metrics(tiny_run)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    for m in metrics:
        for key in ("loss", "lr", "grad_norm", "tokens", "tokens_seen", "tokens_per_second", "flops_per_second",
                    "mfu", "padding_efficiency", "peak_memory_bytes", "step_time_s", "skipped_steps", *TIME_SPLIT):
            assert key in m, key
        assert m["tokens"] > 0 and m["tokens_per_second"] > 0 and m["flops_per_second"] > 0
        assert m["mfu"] > 0, "a CPU's peak FLOP/s is measured at start-up (logger.peak_flops=auto)"
        assert 0 < m["padding_efficiency"] <= 1
        assert m["peak_memory_bytes"] > 10 * 2**20, "peak RSS of a torch process"
        assert all(m[key] >= 0 for key in TIME_SPLIT)
        assert sum(m[key] for key in TIME_SPLIT) == pytest.approx(m["step_time_s"], rel=1e-6)
        assert m["skipped_steps"] == 0
    assert [("val_loss" in m) for m in metrics] == [False, True, False, True]
    assert [m["tokens_seen"] for m in metrics] == list(torch.tensor([m["tokens"] for m in metrics]).cumsum(0))


@pytest.mark.slow  # a trained run or a process launch (seconds): out of the fast tier
def test_padding_efficiency_is_valid_over_processed_tokens_of_the_step(tiny_run):
    """Recount the step's microbatch shapes from the data (the same global batch for any layout)."""
    from ddptrain.data import TrainBatches, load_stdlib

    data = load_stdlib(64, 5.0, 40)
    batches = TrainBatches(data.train, 8, 4, 1234, rank=0, world_size=1)
    for m in read_metrics(tiny_run):
        processed = valid = 0
        for inputs, targets in batches.microbatches(m["step"] - 1):
            processed += inputs.numel()
            valid += int((targets != -100).sum())
        assert valid == m["tokens"]
        assert m["padding_efficiency"] == pytest.approx(valid / processed, rel=1e-12)


# -- FLOPs ----------------------------------------------------------------------------------------


def _hand_count_per_token(model: GPT, seq_len: int) -> float:
    """6 x (parameters in matmuls) + 12 x n_layer x n_embd x T, counted from the parameter list."""
    matmul_params = sum(p.numel() for name, p in model.named_parameters() if name != "pos_emb.weight")
    return 6 * matmul_params + 12 * model.cfg.n_layer * model.cfg.n_embd * seq_len


def test_flops_per_token_of_the_default_model_match_a_hand_count_and_torch_flop_counter():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from ddptrain.config.schema import ModelConfig

    defaults, seq_len = ModelConfig(), 256
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, max_seq_len=seq_len, n_layer=defaults.n_layer, n_head=defaults.n_head,
                          n_embd=defaults.n_embd))
    hand = _hand_count_per_token(model, seq_len)
    assert ModelFlops.of_gpt(model).per_token(seq_len) == pytest.approx(hand, rel=0.05)
    # An independent count: torch's FLOP counter over a real forward + backward (the math SDPA
    # kernel, whose bmm's the counter sees; it counts the full T x T score matrix, as PaLM does).
    inputs = torch.randint(0, 256, (2, seq_len))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(inputs).sum().backward()
    measured_per_token = counter.get_total_flops() / inputs.numel()
    assert ModelFlops.of_gpt(model).per_token(seq_len) == pytest.approx(measured_per_token, rel=0.05)


def test_chunked_head_flops_match_torch_flop_counter():
    """ModelFlops with the chunked head counts what runs: torch's FLOP counter over a forward and
    backward through head_token_sum, half the targets ignored: the tied nn.Linear head's gradients
    taken in its forward (no recompute), and checkpointed where a hook makes the head opaque."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from ddptrain.engine.chunked import HeadLoss

    seq_len, rows = 64, 2
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=4096, max_seq_len=seq_len, n_layer=2, n_head=2, n_embd=64))  # a large head
    inputs = torch.randint(0, 4096, (rows, seq_len))
    targets = torch.randint(0, 4096, (rows, seq_len))
    targets[:, ::2] = -100
    valid = int((targets != -100).sum())
    for hooked in (False, True):
        if hooked:  # a module hook, as FSDP's or ZeRO-3's on a head of its own: the chunks are checkpointed
            model.head.register_forward_hook(lambda module, args, output: None)
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
            model(inputs, head_loss=HeadLoss(targets, chunk_tokens=16)).backward()
        flops = ModelFlops.of_gpt(model, chunked_head=True)
        assert flops.head_recomputed == hooked
        counted = flops.per_microbatch(rows, seq_len) + flops.per_valid_target() * valid
        assert counted == pytest.approx(counter.get_total_flops(), rel=0.05)
    full = ModelFlops.of_gpt(model).per_microbatch(rows, seq_len)
    assert counted < 0.9 * full, "half the targets ignored: the head's share of the FLOPs is smaller"


def _tiny_llama(lora: bool, tmp_path: Path):
    """A tiny tied-head Llama (SmolLM2's shape, shrunk), under an all-linear LoRA adapter or whole."""
    transformers = pytest.importorskip("transformers")
    from ddptrain.models import hf

    config = transformers.LlamaConfig(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=True, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    if lora:
        pytest.importorskip("peft")
        from ddptrain.models import lora as lora_module

        model = lora_module.wrap(model, {"r": 8, "alpha": 16.0}, tmp_path)
    hf.give_head_loss(model)
    return model


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.slow  # a trained run or a process launch (seconds): out of the fast tier
def test_lora_and_full_fine_tuning_flops_match_torch_flop_counter(tmp_path, lora):
    """What is computed: under LoRA the frozen base weights get no weight gradient (4 x N, not 6 x N)
    and the adapters cost 6 x theirs; torch's FLOP counter over a real forward + backward agrees,
    with the full logits and with the chunked head (a third of the targets ignored)."""
    from torch.utils.flop_counter import FlopCounterMode

    from ddptrain.engine.chunked import HeadLoss

    model = _tiny_llama(lora, tmp_path)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    rows, seq_len = 2, 48
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randint(0, 1024, (rows, seq_len), generator=generator)
    targets = torch.randint(0, 1024, (rows, seq_len), generator=generator)
    targets[:, ::3] = -100
    valid = int((targets != -100).sum())
    for chunked_head in (False, True):
        with FlopCounterMode(display=False) as counter:
            if chunked_head:
                model(input_ids=inputs, head_loss=HeadLoss(targets, chunk_tokens=16)).backward()
            else:
                model(input_ids=inputs).logits.sum().backward()
        flops = ModelFlops.of_module(model, chunked_head)
        assert (flops.frozen_params, flops.head_frozen) == ((frozen, True) if lora else (0, False))
        counted = flops.per_microbatch(rows, seq_len) + flops.per_valid_target() * valid
        print(f"chunked head {chunked_head}: counted {counted:.4g}, torch's counter {counter.get_total_flops():.4g} "
              f"({counted / counter.get_total_flops() - 1:+.2%})")
        # The rest: the rotary embedding's small matmul, and under LoRA the first block's q, k, v
        # input gradient (their input comes from the frozen embedding), counted but not computed.
        assert counted == pytest.approx(counter.get_total_flops(), rel=0.03)


@pytest.mark.slow  # over 4 s (a process launch or ranks): out of the fast tier
def test_logged_flops_per_second_match_the_hand_count_for_the_default_model(tmp_path):
    """flops_per_second / processed tokens per second = FLOPs per token of the default model."""
    seq_len = 256
    _ok(run_cli(["data.max_docs=40", "trainer.max_steps=2", "trainer.log_every=1", "trainer.eval_examples=8",
                 f"batch.seq_len={seq_len}", "batch.global_size=8", "batch.micro_size=8", f"run.dir={tmp_path}"]))
    model = GPT(GPTConfig(vocab_size=256, max_seq_len=seq_len))  # the default model's shape
    head = model.head.weight.numel()
    for m in read_metrics(tmp_path):
        processed_per_second = m["tokens_per_second"] / m["padding_efficiency"]
        logged = m["flops_per_second"] / processed_per_second
        # The chunked head (the default) runs on valid targets only, its gradients taken in its one
        # forward: 6 x head per valid target in place of 6 x head per processed position.
        hand = _hand_count_per_token(model, seq_len) - 6 * head + 6 * head * m["padding_efficiency"]
        print(f"step {m['step']}: logged {logged:.4g} FLOPs/token, hand count {hand:.4g} "
              f"({logged / hand - 1:+.2%}), {m['flops_per_second']:.3g} FLOP/s")
        # Microbatches narrower than seq_len (all examples short) make the attention term smaller.
        assert logged == pytest.approx(hand, rel=0.05)


def test_peak_flops_table_and_override():
    assert lookup_peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989.4e12
    assert lookup_peak_flops("NVIDIA H100 PCIe", "bf16") == 756e12
    assert lookup_peak_flops("NVIDIA H200", "bf16") == 989.4e12
    assert lookup_peak_flops("NVIDIA A100-SXM4-80GB", "tf32") == 156e12
    assert lookup_peak_flops("NVIDIA A10G", "bf16") == 70e12
    assert lookup_peak_flops("NVIDIA L40S", "fp32") == 91.6e12
    assert lookup_peak_flops("Tesla V100-SXM2-32GB", "bf16") is None
    assert lookup_peak_flops("AMD Instinct MI300X", "bf16") == 1307.4e12
    assert lookup_peak_flops("Some Future GPU", "bf16") is None
    assert device_peak_flops(torch.device("cpu"), "fp32", None) is None, "null: no MFU"


def test_the_peak_probe_runs_a_few_small_matmuls_within_its_budget():
    """The probe's cost is set by its budget and sizes, not asserted by the clock: at most 32 matmuls
    of 512 x 512 (268 MFLOP each), none started after 0.2 s; a clock that says 0.1 s per reading
    stops it after the two it always runs."""
    from ddptrain.train import flops

    assert flops.PROBE_BUDGET_S <= 0.25 and flops.PROBE_SIZE == 512 and flops.PROBE_MAX_MATMULS <= 32
    readings = iter(range(1000))
    fake = flops.probe_peak_flops(torch.device("cpu"), "fp32", clock=lambda: 0.1 * next(readings))
    assert fake.matmuls == 2, "the warm-up and one timed matmul, then the budget is spent"
    assert fake.flops_per_second == pytest.approx(2 * 512**3 / 0.1)
    for precision in ("fp32", "fp64"):
        probe = flops.probe_peak_flops(torch.device("cpu"), precision)
        assert 2 <= probe.matmuls <= flops.PROBE_MAX_MATMULS
        assert probe.flops_per_second > 1e8, "any CPU that runs torch does 0.1 GFLOP/s"
        print(f"{precision}: {probe.flops_per_second:.3g} FLOP/s, {probe.matmuls} matmuls in {probe.seconds:.3f} s")


def test_a_given_peak_skips_the_probe_and_auto_runs_it_where_the_table_has_no_entry(monkeypatch):
    from ddptrain.train import flops

    probed = []
    monkeypatch.setattr(flops, "probe_peak_flops",
                        lambda device, precision: probed.append(precision) or flops.PeakProbe(3e11, 2, 0.01))
    assert device_peak_flops(torch.device("cpu"), "fp32", 2e12) == 2e12
    assert device_peak_flops(torch.device("cpu"), "fp32", None) is None
    assert probed == [], "a peak given (or null) runs no probe"
    assert device_peak_flops(torch.device("cpu"), "bf16", "auto") == 3e11
    assert probed == ["bf16"], "at the run's precision"


@pytest.mark.parametrize("value", ["fast", "0", "-1e12", "true"])
def test_peak_flops_is_auto_a_positive_number_or_null(value):
    from ddptrain.config.compose import compose_config
    from ddptrain.config.schema import ConfigError
    from ddptrain.config.validation import validate

    with pytest.raises(ConfigError, match=r"logger.peak_flops=.* must be auto \(the device table, else a matmul "
                                          r"probe\), FLOP/s > 0, or null"):
        validate(compose_config([f"logger.peak_flops={value}"]), 1)


# -- rank-0 progress in a 2-rank run ------------------------------------------------------------


@pytest.mark.slow  # torchrun / resumed CLI runs
def test_two_ranks_rank0_prints_progress_and_rank1_only_warnings(tmp_path):
    """torchrun --redirects 3 puts each rank's stdout and stderr in its own files."""
    logs = tmp_path / "logs"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--redirects=3",
           f"--log-dir={logs}", "-m", "ddptrain", *SMALL, "trainer.max_steps=4", "trainer.log_every=2",
           "logger.peak_flops=1e12", f"run.dir={tmp_path / 'run'}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    _ok(subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300))

    def output(rank: int) -> str:
        files = sorted(logs.rglob(f"{rank}/std*.log"))
        assert len(files) == 2, files
        return "".join(f.read_text() for f in files)

    rank0, rank1 = output(0), output(1)
    assert "world: 2 rank(s)" in rank0 and "strategy: ddp" in rank0 and "run dir:" in rank0
    assert "memory plan: " in rank0 and "] hsdp 1x2 " in rank0 and "pick" not in rank0  # CPU: no device memory, no pick
    assert "step 2/4 (50%)" in rank0 and "step 4/4 (100%)" in rank0 and "ETA" in rank0
    noisy = [line for line in rank1.splitlines()
             if line.strip() and not any(word in line.lower() for word in ("warn", "error"))]
    assert noisy == [], f"rank 1 printed more than warnings and errors: {noisy[:5]}"
    metrics = read_metrics(tmp_path / "run")
    assert [m["step"] for m in metrics] == [2, 4]
    for m in metrics:  # MFU against 2 devices of 1e12 FLOP/s each
        assert m["mfu"] == pytest.approx(m["flops_per_second"] / 2e12, rel=1e-9)


def test_progress_bar_on_a_terminal_keeps_log_lines_above_it():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    screen = Terminal()
    logger = logging.getLogger("ddptrain.test_bar")
    handler = logging.StreamHandler(screen)
    logging.getLogger("ddptrain").addHandler(handler)
    try:
        progress = Progress(total_steps=4, mode="auto", stream=screen, min_interval_s=0)
        assert progress.is_bar
        progress.update(1, loss=3.5)
        logger.warning("checkpoint written")
        progress.update(4, loss=3.0)
        progress.close()
    finally:
        logging.getLogger("ddptrain").removeHandler(handler)
    text = screen.getvalue()
    assert "step 1/4 [######..................]  25% | loss 3.5000 | ETA" in text
    assert "\r\x1b[Kcheckpoint written\n\r\x1b[Kstep 1/4" in text, "the log line clears the bar, which is redrawn"
    assert "step 4/4 [########################] 100%" in text and text.endswith("\n")
    assert not Progress(total_steps=4, mode="auto", stream=io.StringIO()).is_bar, "not a terminal: lines"



def test_progress_bar_keeps_the_loss_of_the_last_read_step():
    """The trainer reads a step's loss only on log, eval and checkpoint steps; the bar shows that loss
    until the next read instead of dropping it on the steps in between."""
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    screen = Terminal()
    progress = Progress(total_steps=4, mode="bar", stream=screen, min_interval_s=0)
    progress.update(1, loss=3.5)
    progress.update(2, None)
    progress.update(3, loss=2.25)
    progress.close()
    text = screen.getvalue()
    assert "step 2/4 [############............]  50% | loss 3.5000 | ETA" in text
    assert "step 3/4 [##################......]  75% | loss 2.2500 | ETA" in text

# -- wandb offline ------------------------------------------------------------------------------


def read_wandb_records(path: Path):
    """The records of an offline run's `.wandb` file, parsed with wandb's own protobuf schema.

    wandb 0.31 has no Python reader of its transaction log any more (`wandb.sdk.internal.datastore`
    is gone; wandb-core reads it in Go). The file is ':W&B' + magic 0xBEE1 + version byte, then
    LevelDB-log framing: 32 KiB blocks of chunks (crc32c, little-endian length, type FULL=1,
    FIRST=2, MIDDLE=3, LAST=4), each whole payload a serialised `wandb_internal_pb2.Record`.
    """
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B" and struct.unpack("<HB", data[4:7]) == (0xBEE1, 0), data[:7]
    pos, block, payload = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a chunk header is zero padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        payload = chunk if kind in (1, 2) else payload + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(payload)
            yield record


def read_wandb_run(path: Path) -> dict:
    run_id, config, history = None, {}, []
    for record in read_wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id = record.run.run_id
            config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
        elif kind == "config":
            config.update({item.key: json.loads(item.value_json) for item in record.config.update})
        elif kind == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            assert row["_step"] == record.history.step.num
            history.append(row)
    return {"run_id": run_id, "config": config, "history": history}


@pytest.mark.slow  # torchrun / resumed CLI runs
def test_wandb_offline_run_reads_back_and_a_resumed_run_continues_it_without_duplicates(tmp_path):
    wandb_run = [*SMALL, "trainer.max_steps=8", "checkpoint.every=4", "logger.wandb.mode=offline",
                 "trainer.nonfinite=stop", f"run.dir={tmp_path}"]
    env = {"WANDB_SILENT": "true"}
    # Step 6 fails (NaN gradients, nonfinite=stop) after steps 1-5 were logged; the checkpoint is
    # of step 4, so the resumed run repeats step 5. The failed run still finishes its wandb run.
    failed = run_cli(wandb_run, env={**env, "DDPTRAIN_FAILPOINT": "nan@6:0"})
    assert failed.returncode != 0 and "non-finite gradient norm" in failed.stderr
    files = sorted((tmp_path / "wandb").glob("*run-*/run-*.wandb"))
    assert len(files) == 1
    first = read_wandb_run(files[0])
    assert [row["_step"] for row in first["history"]] == [1, 2, 3, 4, 5]
    assert first["config"]["trainer"]["max_steps"] == 8
    assert first["config"]["model"]["n_embd"] == 32
    jsonl = {m["step"]: m for m in read_metrics(tmp_path)}
    for row in first["history"]:  # the same numbers as metrics.jsonl
        assert row["loss"] == pytest.approx(jsonl[row["_step"]]["loss"], rel=1e-12)
        assert "flops_per_second" in row and "padding_efficiency" in row and "tokens_per_second" in row
    checkpoint = torch.load(tmp_path / "checkpoints" / "step_00000004" / "trainer.pt", weights_only=False)
    assert checkpoint["wandb_run_id"] == first["run_id"]

    _ok(run_cli(wandb_run, env=env))
    files = sorted((tmp_path / "wandb").glob("*run-*/run-*.wandb"))
    assert len(files) == 2, "the resumed run writes a second offline file of the same run"
    second = read_wandb_run(files[1])
    assert second["run_id"] == first["run_id"]
    assert second["config"]["trainer"]["max_steps"] == 8
    steps = [row["_step"] for run in (first, second) for row in run["history"]]
    assert steps == list(range(1, 9)), "every step once: step 5 is not sent again"
    assert "val_loss" in second["history"][-1]
    assert [m["step"] for m in read_metrics(tmp_path)] == list(range(1, 9))


# -- plots ----------------------------------------------------------------------------------------


@pytest.mark.slow  # a trained run or a process launch (seconds): out of the fast tier
def test_plot_command_draws_one_line_per_run(tiny_run, tmp_path):
    from ddptrain.plot import make_figure

    runs = []
    for index, name in enumerate(["layout_a", "layout_b"]):
        run = tmp_path / name
        run.mkdir()
        rows = [{**m, "loss": m["loss"] + 0.05 * (index + 1)} for m in read_metrics(tiny_run)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        runs.append(run)
    runs.append(tiny_run)
    out = tmp_path / "plots" / "loss.png"
    result = subprocess.run([sys.executable, "-m", "ddptrain.plot", *map(str, runs), "-o", str(out)], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert out.stat().st_size > 20_000
    from PIL import Image

    with Image.open(out) as image:
        assert image.size == (1440, 540)
        assert len(image.getcolors(maxcolors=1 << 20) or []) > 50, "not a blank image"

    fig = make_figure(runs, labels=["a", "b", "tiny"])
    for ax in fig.axes:
        training = [line.get_label() for line in ax.get_lines() if not line.get_label().endswith("(val)")]
        assert training == ["a", "b", "tiny"]
        assert [line.get_label() for line in ax.get_lines() if line.get_label().endswith("(val)")] == \
            ["a (val)", "b (val)", "tiny (val)"]

    bad = subprocess.run([sys.executable, "-m", "ddptrain.plot", str(tmp_path / "nope"), "-o", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "metrics.jsonl does not exist" in bad.stderr


@pytest.mark.slow  # a trained run or a process launch (seconds): out of the fast tier
def test_wandb_online_without_credentials_falls_back_to_offline_without_a_prompt(tmp_path, monkeypatch):
    from ddptrain.train.metrics import MetricsLogger

    warnings = io.StringIO()
    handler = logging.StreamHandler(warnings)
    logging.getLogger("ddptrain.train.metrics").addHandler(handler)

    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_MODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc, no wandb settings
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))  # a prompt would read here and fail
    logger = MetricsLogger(tmp_path / "run", "online", "ddptrain", config={"a": 1})
    try:
        logger.log({"step": 1, "loss": 2.0})
        assert logger._wandb_run.settings.mode == "offline"
    finally:
        logger.close()
        logging.getLogger("ddptrain.train.metrics").removeHandler(handler)
    assert "no wandb credentials" in warnings.getvalue()
    assert len(list((tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb"))) == 1


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="no /proc (not Linux): ru_maxrss is the measure")
@pytest.mark.slow  # over 4 s (a process launch or ranks): out of the fast tier
def test_a_processs_peak_memory_on_cpu_is_its_own_not_that_of_the_process_that_started_it():
    """getrusage's ru_maxrss survives exec: a run launched by a process holding 1.5 GiB (a test
    runner with a model loaded, a launcher) would report that as its own peak."""
    held = bytearray(1536 * 2**20)  # touched: resident in this process when the child is started
    held[::4096] = b"\x01" * len(held[::4096])
    code = ("import torch; from ddptrain.train.metrics import peak_memory_bytes; "
            "print(peak_memory_bytes(torch.device('cpu')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    del held
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) < 1024 * 2**20, f"the child reports {int(result.stdout) / 2**20:.0f} MiB"
