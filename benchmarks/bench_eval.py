"""Task scoring's cost beside the validation loss's, per token, on the default model:

    python -m benchmarks.bench_eval [--items 500] [--val-examples 64] [--rounds 3] [--device cpu]

The default GPT (4 layers, 128 wide, byte tokenizer) scores `--items` random multiple-choice items
(4 choices, contexts of 100-400 bytes, as HellaSwag's are) with the loop's TaskScorer, and the
Evaluator computes the validation loss on `--val-examples` examples of the stdlib corpus, both in
batch.micro_size=8 rows of at most batch.seq_len=256 tokens. Printed side by side: seconds, input
tokens, and microseconds per input token (the median of --rounds); the target is task time per
token <= validation time per token.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ddptrain.config.compose import CONFIG_PATH, register_configs
from ddptrain.distributed import init_distributed
from ddptrain.train import builder
from ddptrain.train.evaluator import Evaluator
from ddptrain.train.tasks import Item, Task, TaskScorer

WORDS = ("the of and to in is was for on that with as by at from his he it an were are which this be or has "
         "had not first one their its new after but who they have her she two been other when there all").split()


def random_task(items: int, seed: int = 0) -> Task:
    rng = random.Random(seed)

    def text(low: int, high: int) -> str:
        words = []
        while len(" ".join(words)) < rng.randint(low, high):
            words.append(rng.choice(WORDS))
        return " ".join(words)

    return Task("bench", tuple(Item(text(100, 400), tuple(text(20, 120) for _ in range(4)), rng.randrange(4))
                               for _ in range(items)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=500)
    parser.add_argument("--val-examples", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-docs", type=int, default=200)
    args = parser.parse_args()
    from hydra import compose, initialize_config_dir

    register_configs()
    with tempfile.TemporaryDirectory() as run_dir, initialize_config_dir(config_dir=CONFIG_PATH, version_base="1.3"):
        cfg = compose("config", overrides=[f"run.dir={run_dir}", f"data.max_docs={args.max_docs}",
                                           f"trainer.eval_examples={args.val_examples}"])
        builder.validate_run(cfg, 1)
        builder.resolve_tokenizer(cfg)
        dist_info = init_distributed()
        built = builder.build(cfg, dist_info)
        engine = built.engine
        evaluator = Evaluator.from_config(built.data.val, cfg, dist_info, engine)
        scorer = TaskScorer([random_task(args.items)], lambda s: list(s.encode("utf-8")), dist_info,
                            cfg.batch.seq_len, cfg.batch.micro_size, cfg.batch.micro_tokens)
        val_tokens = int(sum(built.data.val.lengths[evaluator.ids] - 1))
        task_tokens = sum(len(row.tokens) - 1 for row in scorer.rows)
        timings = {"validation loss": [], "tasks": []}
        for _ in range(args.rounds):
            started = time.perf_counter()
            evaluator.run(engine)
            timings["validation loss"].append(time.perf_counter() - started)
            started = time.perf_counter()
            scorer.score(engine.forward, engine.model)
            timings["tasks"].append(time.perf_counter() - started)
    print(f"benchmarks.bench_eval: default GPT on {dist_info.device}, threads {torch.get_num_threads()}, "
          f"{args.items} items x 4 choices vs {len(evaluator.ids)} validation examples, seq_len {cfg.batch.seq_len}")
    print(f"{'':18}{'seconds':>10}{'tokens':>10}{'us/token':>10}")
    per_token = {}
    for (name, seconds), tokens in zip(timings.items(), (val_tokens, task_tokens)):
        median = statistics.median(seconds)
        per_token[name] = 1e6 * median / tokens
        print(f"{name:18}{median:10.3f}{tokens:10d}{per_token[name]:10.2f}")
    ratio = per_token["tasks"] / per_token["validation loss"]
    print(f"task time per token / validation time per token: {ratio:.2f} (target <= 1)")


if __name__ == "__main__":
    main()
