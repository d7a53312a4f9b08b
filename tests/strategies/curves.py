"""Loss curves of the command line on ragged data: every layout and strategy that trains the same
global batches must log the same curve (same token counts, losses within a tolerance).
"""

from __future__ import annotations

import math

import torch

from tests.helpers import TINY_RUN, read_metrics, run_cli

RAGGED_RUN = [*TINY_RUN, "batch.global_size=8", "batch.seq_len=128", "trainer.max_steps=6"]


def ragged_corpus(tmp_path) -> list[str]:
    """Paragraphs of 20 to 400 characters: most examples are shorter than seq_len."""
    corpus = tmp_path / "corpus.txt"
    if not corpus.exists():
        gen = torch.Generator().manual_seed(0)
        words = ["tensor", "rank", "token", "gradient", "step", "loss", "model", "batch", "sum", "mean"]
        paragraphs = []
        for _ in range(300):
            length = int(torch.randint(4, 60, (1,), generator=gen))
            paragraphs.append(" ".join(words[int(i)] for i in torch.randint(0, len(words), (length,), generator=gen)))
        corpus.write_text("\n\n".join(paragraphs))
    return ["data=text", f"data.paths=[{corpus}]", "data.split_by=paragraph", f"data.cache_dir={tmp_path / 'cache'}"]


def loss_curve(tmp_path, name: str, ranks: int, args: list[str]) -> list[dict]:
    run_dir = tmp_path / name
    result = run_cli([*RAGGED_RUN, *ragged_corpus(tmp_path), *args, f"run.dir={run_dir}"], nproc=ranks)
    assert result.returncode == 0, result.stderr[-3000:]
    return read_metrics(run_dir)


def assert_same_curves(curves: dict, tolerance: float) -> None:
    (ref_name, reference), *others = curves.items()
    assert any(m["tokens"] < 8 * 128 for m in reference), "no ragged step: the test would not show the objective"
    for name, curve in others:
        assert [m["tokens"] for m in curve] == [m["tokens"] for m in reference], name
        for mine, ref in zip(curve, reference):
            assert math.isclose(mine["loss"], ref["loss"], rel_tol=tolerance), (name, ref_name, mine["step"])
