"""A PNG of a run's curves (every metric logged in metrics.jsonl against the optimizer step)."""

from __future__ import annotations

from pathlib import Path

from attnzoo.training.tracking import read_metrics

# Shown first and on their own panels; everything else numeric follows in name order.
PREFERRED_ORDER = ("train_loss", "train_bits_per_dim", "eval_bits_per_dim", "eval_bleu", "eval_accuracy", "lr")
SKIPPED = {"step", "elapsed_s", "epoch"}


def plot_curves(metrics_path: str | Path, png_path: str | Path, title: str = "") -> Path | None:
    """One panel per metric; returns the PNG path, or None when there is nothing to plot."""
    import matplotlib

    matplotlib.use("Agg")  # no display on training machines
    import matplotlib.pyplot as plt

    records = [r for r in read_metrics(metrics_path) if isinstance(r.get("step"), int)]
    names = sorted({k for r in records for k, v in r.items()
                    if k not in SKIPPED and isinstance(v, int | float) and not isinstance(v, bool)},
                   key=lambda n: (PREFERRED_ORDER.index(n) if n in PREFERRED_ORDER else len(PREFERRED_ORDER), n))
    if not names:
        return None
    columns = min(3, len(names))
    rows = -(-len(names) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.0 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names, strict=False):
        points = [(r["step"], r[name]) for r in records if isinstance(r.get(name), int | float)]
        steps, values = zip(*points, strict=True)
        ax.plot(steps, values, marker="o" if len(points) < 30 else None, markersize=3)
        ax.set_title(name)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    png_path = Path(png_path)
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return png_path
