"""Loss curves of one or more runs: `python -m ddptrain.plot RUN_DIR [RUN_DIR ...] -o FILE.png`.

Two panels, loss against optimizer step and against valid training tokens seen; each run is one
solid line (training loss) in its own colour, with its validation loss as dashed markers of the
same colour; runs that scored multiple-choice tasks (trainer.eval_tasks) get a third panel, each
task's acc (solid) and acc_norm (dotted) against the step. Runs are named by their directory's
name, or by --labels. It reads only `<run_dir>/metrics.jsonl`, so it also works on runs copied
from a cluster.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def read_run(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: is {run_dir} a ddptrain run dir?")
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue  # a line cut by a crash
    return rows


def _tokens_seen(rows: list[dict]) -> list[float]:
    """Cumulative valid tokens per logged step: `tokens_seen` when logged, else summed `tokens`."""
    if all("tokens_seen" in row for row in rows):
        return [row["tokens_seen"] for row in rows]
    total, out = 0, []
    for row in rows:  # older files: exact only with trainer.log_every=1
        total += row.get("tokens") or 0
        out.append(total)
    return out


def make_figure(run_dirs: list[str | Path], labels: list[str] | None = None, title: str | None = None):
    """The matplotlib Figure: axes[0] loss vs step, axes[1] loss vs tokens; one training line per run."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    labels = list(labels) if labels else [Path(run).resolve().name for run in run_dirs]
    if len(labels) != len(run_dirs):
        raise ValueError(f"{len(labels)} labels for {len(run_dirs)} run dirs: give one label per run dir")
    runs = [read_run(run) for run in run_dirs]
    task_keys = sorted({key for rows in runs for row in rows for key in row if key.startswith("eval/")})
    fig, axes = plt.subplots(1, 3 if task_keys else 2, figsize=(18 if task_keys else 12, 4.5), constrained_layout=True)
    for index, (rows, label) in enumerate(zip(runs, labels)):
        color = f"C{index % 10}"
        x_by_axis = ([row["step"] for row in rows], _tokens_seen(rows))
        for ax, xs in zip(axes, x_by_axis):
            points = [(x, row["loss"]) for x, row in zip(xs, rows) if row.get("loss") is not None]
            ax.plot([p[0] for p in points], [p[1] for p in points], color=color, label=label, linewidth=1.5)
            val = [(x, row["val_loss"]) for x, row in zip(xs, rows) if row.get("val_loss") is not None]
            if val:
                ax.plot([p[0] for p in val], [p[1] for p in val], color=color, linestyle="--", marker="o",
                        markersize=4, label=f"{label} (val)")
        for key in task_keys:
            points = [(row["step"], row[key]) for row in rows if row.get(key) is not None]
            if points:
                axes[2].plot([p[0] for p in points], [p[1] for p in points], color=color, marker=".",
                             linestyle=":" if key.endswith("acc_norm") else "-", label=f"{label} {key[5:]}")
    if task_keys:
        axes[2].set_xlabel("optimizer step")
        axes[2].set_ylabel("task accuracy")
        axes[2].grid(alpha=0.3)
        axes[2].legend(fontsize="small")
    for ax, xlabel in zip(axes, ("optimizer step", "valid training tokens")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("loss (global mean over valid tokens)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    return fig


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ddptrain.plot", description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+", help="run directories holding metrics.jsonl")
    parser.add_argument("-o", "--output", required=True, help="image file to write (.png, .pdf, .svg)")
    parser.add_argument("--labels", nargs="+", help="one name per run dir (default: the dirs' names)")
    parser.add_argument("--title", help="figure title")
    args = parser.parse_args(argv)
    try:
        fig = make_figure(args.run_dirs, args.labels, args.title)
    except (FileNotFoundError, ValueError) as error:
        parser.error(str(error))
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.output, dpi=120)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
