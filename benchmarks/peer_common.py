"""What bench_peer's modes share: the optimizer settings, the corpus, the model, and how a run is launched.

bench_peer (text), bench_peer_sft and bench_peer_step all train the same small Llama on examples
from ddptrain's own data pipeline with the same optimizer settings; bench_peer_sft and bench_peer_dpo
build the same pseudo-word tokenizer and Llama. They import these from here, so that no mode imports
another.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path

LR, BETAS, WEIGHT_DECAY, GRAD_CLIP, SEED = 1e-3, (0.9, 0.95), 0.1, 1.0, 1234
SPECIAL = ["<|im_start|>", "<|im_end|>", "<eos>"]
# ChatML; each assistant reply and its end-of-turn token inside {% generation %}, the newline after it outside.
FINETUNES = {"lora": ["model.lora.r=16"], "full": []}
"""ddptrain's overrides per fine-tuning mode (LoRA: alpha 16, no dropout, every linear layer, as TRL's peft config)."""
TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
            "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}"
            "{% else %}{{ m['content'] + '<|im_end|>' }}{% endif %}{{ '\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def stdlib_glob() -> str:
    from ddptrain.data.sources import stdlib_root

    return str(stdlib_root() / "*.py")



def data_overrides(args) -> list[str]:
    return ["data=text", f"data.paths=[{args.data_glob}]", "data.split_by=paragraph", "data.tokenizer=byte"]



def training_examples(args):
    """ddptrain's training examples for `data_overrides` (through its cache): what every contender trains on."""
    from omegaconf import OmegaConf

    from ddptrain.config import DataConfig
    from ddptrain.data import load_splits

    data_cfg = OmegaConf.structured(DataConfig(name="text", paths=[args.data_glob], split_by="paragraph",
                                               tokenizer="byte"))
    return load_splits(data_cfg, args.seq_len).train



def packed_rows(args, examples) -> int:
    """Packed rows per step holding about as many valid targets as global_batch average examples."""
    mean_targets = examples.valid_targets() / len(examples)
    return max(args.world_size, round(args.global_batch * mean_targets / args.seq_len))



def write_model_dir(directory: Path, seq_len: int, width: int, layers: int) -> None:
    """config.json of a small Llama (GQA, RoPE, SwiGLU) over byte tokens; no weights."""
    import transformers

    transformers.LlamaConfig(vocab_size=256, hidden_size=width, intermediate_size=int(width * 8 / 3) // 8 * 8,
                             num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=seq_len, use_cache=False,
                             tie_word_embeddings=False).save_pretrained(directory)



def windowed_rates(run_dir: Path, log_every: int) -> tuple[float, float]:
    """(valid tokens per second, valid targets / positions computed) of a ddptrain run's windows after the first
    (warm-up); metrics.jsonl written before `valid_target_fraction` had that ratio as `padding_efficiency`."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    timed = [r for r in records if r["step"] > log_every and r.get("tokens_per_second")]
    if not timed:
        raise RuntimeError(f"{run_dir}/metrics.jsonl has no window after step {log_every}: {records}")
    # tokens_per_second = window tokens / window seconds: recombine the windows after the first.
    seconds = [r["step_time_s"] * log_every for r in timed]
    tokens = [r["tokens_per_second"] * s for r, s in zip(timed, seconds)]
    padded = [t / r.get("valid_target_fraction", r["padding_efficiency"]) for r, t in zip(timed, tokens)]
    return sum(tokens) / sum(seconds), sum(tokens) / sum(padded)



def torchrun(args) -> list[str]:
    """torchrun of args.world_size ranks on this machine, to be followed by `-m MODULE ARGS` or a script.
    Under the tests (DDPTRAIN_TEST_ZYGOTE names their fork server, tests/zygote.py) the launcher and its
    `-m` workers are forked from that server, torch already imported: the tests check the report's shape."""
    if os.environ.get("DDPTRAIN_TEST_ZYGOTE"):
        from tests.zygote import torchrun_prefix

        return torchrun_prefix(args.world_size)
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.world_size}"]



def execute(cmd: list[str], args, extra_env: dict[str, str] | None = None) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "CUDA_VISIBLE_DEVICES": "",
           "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(Path.cwd()), **(extra_env or {})}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}\nfailed with exit code {done.returncode}:\n{done.stderr[-4000:]}")


# -- the chat modes' local inputs (sft, dpo): pseudo-words, their tokenizer, a Llama ----------------


def pseudo_words(count: int, seed: int) -> list[str]:
    """`count` distinct pronounceable words of 1 to 3 syllables."""
    rng = random.Random(seed)
    syllables = [c + v for c in "bdfghklmnprstvz" for v in "aeiou"]
    words: set[str] = set()
    while len(words) < count:
        words.add("".join(rng.choice(syllables) for _ in range(rng.choice([1, 2, 2, 3]))))
    return sorted(words)


def zipf_weights(words: list[str]) -> list[float]:
    """Zipf-like word frequencies: the k-th word is drawn in proportion to 1 / k."""
    return [1 / (rank + 1) for rank in range(len(words))]


def sentence(rng: random.Random, words: list[str], weights: list[float], length: int) -> str:
    return " ".join(rng.choices(words, weights, k=length))


def write_tokenizer(directory: Path, words: list[str], vocab_size: int) -> None:
    """A byte-level BPE trained here on the words, with EOS <eos> and the marked chat template."""
    import tokenizers
    import transformers

    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    rng = random.Random(0)
    corpus = ["system\nuser\nassistant\n", *(" ".join(rng.sample(words, 20)) for _ in range(2000))]
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(directory)


def save_llama(model_dir: Path, tokenizer, args) -> None:
    """A Llama (GQA, RoPE, SwiGLU) of args.width x args.layers over `tokenizer`, random weights, saved beside it."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=args.width, intermediate_size=int(args.width * 8 / 3) // 8 * 8,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=max(1, args.heads // 2),
        max_position_embeddings=args.seq_len + 1, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=None, use_cache=False, tie_word_embeddings=False)
    torch.manual_seed(SEED)
    # save_pretrained imports DeepSpeed where installed, which logs "Setting accelerator to CPU" to
    # stdout: keep stdout for the report.
    with contextlib.redirect_stdout(sys.stderr):
        transformers.LlamaForCausalLM(config).save_pretrained(model_dir)


def write_chat_inputs(work: Path, args, records, splits: tuple[tuple[str, int], ...]) -> tuple[Path, ...]:
    """(model dir, one JSONL file per (name, count) of `splits`) under `work`: the pseudo-word tokenizer,
    `records(count, seed, words, fits)` (seeds 1, 2, ...; `fits(messages)`: they render within
    seq_len + 1 tokens) and the Llama."""
    import transformers

    model_dir, words = work / "llama", pseudo_words(args.words, SEED)
    write_tokenizer(model_dir, words, args.vocab)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)

    def fits(messages) -> bool:
        ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
        return len(ids) <= args.seq_len + 1

    paths = []
    for seed, (name, count) in enumerate(splits, start=1):
        path = work / name
        path.write_text("".join(json.dumps(record) + "\n" for record in records(count, seed, words, fits)))
        paths.append(path)
    save_llama(model_dir, tokenizer, args)
    return (model_dir, *paths)


def run_chat_ddptrain(args, model_dir: Path, run_dir: Path, overrides: list[str]) -> tuple[float, float]:
    """The chat modes' ddptrain run (`overrides`: data, layout, fine-tuning) on a torchrun of args.world_size
    ranks with the shared optimizer settings; windowed_rates of its metrics."""
    cmd = [*torchrun(args), "-m", "ddptrain", "model=hf", f"model.path={model_dir}", *overrides,
           f"batch.seq_len={args.seq_len}", f"batch.global_size={args.global_batch}",
           f"trainer.max_steps={args.steps}", f"trainer.log_every={args.log_every}", "trainer.eval_examples=1",
           f"optim.lr={LR}", f"optim.betas=[{BETAS[0]},{BETAS[1]}]", f"optim.weight_decay={WEIGHT_DECAY}",
           "optim.schedule=constant", "optim.warmup_steps=0", f"trainer.grad_clip={GRAD_CLIP}",
           "trainer.precision=fp32", f"run.seed={SEED}", f"run.dir={run_dir}", "logger.progress=lines"]
    execute(cmd, args)
    print(f"  {run_dir.name}: {step_phases(run_dir, args.log_every)}", flush=True)
    return windowed_rates(run_dir, args.log_every)


def step_phases(run_dir: Path, log_every: int) -> str:
    """Where rank 0's timed steps went, in seconds per step (the mean of the windows after the first):
    forward + backward (DDP's gradient all-reduce runs in the last microbatch's backward) and the
    optimizer (clipping included)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    timed = [r for r in records if r["step"] > log_every and "forward_backward_s" in r]
    if not timed:
        return "no timed step"
    mean = {key: sum(r[key] for r in timed) / len(timed) for key in ("step_time_s", "forward_backward_s", "optimizer_s")}
    return (f"step {mean['step_time_s']:.2f} s: forward+backward {mean['forward_backward_s']:.2f}, optimizer "
            f"{mean['optimizer_s']:.2f} (mean of {len(timed)} windows)")
