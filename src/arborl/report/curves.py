"""curves.png of a run: one panel per question a user asks of a training run (is reward rising, is the
loss sane, how far did the policy move, is the rollout fast, does the held-out score improve), from
the rows of metrics.jsonl."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# (panel title, metric keys drawn in it, record kind they come from)
PANELS: list[tuple[str, tuple[str, ...], str]] = [
    ("reward / success", ("reward", "success"), "step"),
    ("loss", ("loss/total", "loss/pg"), "step"),
    ("KL", ("loss/kl", "loss/approx_kl"), "step"),
    ("grad norm", ("train/grad_norm",), "step"),
    ("clip fraction", ("loss/clip_frac", "loss/clip_frac_high", "loss/clip_frac_low"), "step"),
    ("train-inference mismatch", ("mismatch/k3_kl", "mismatch/logp_abs_diff_mean", "mismatch/masked_frac"), "step"),
    ("rollout tokens/s", ("rollout_tokens_per_s",), "step"),
    ("held-out evaluation", ("eval_success", "eval_reward"), "eval"),
]


def run_figure(records: list[dict[str, Any]], title: str = ""):
    """The matplotlib figure of ``records`` (rows of metrics.jsonl), one panel per entry of PANELS."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 4
    rows = (len(PANELS) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    for ax, (name, keys, kind) in zip(axes.flat, PANELS):
        drawn = 0
        for key in keys:
            pts = [(r["step"], r[key]) for r in records
                   if r.get("kind") == kind and r.get(key) is not None and "step" in r]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="o", ms=3, label=key)
                drawn += 1
        if drawn:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(PANELS):]:
        ax.axis("off")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_run(records: list[dict[str, Any]], path: str | Path, title: str = "") -> Path:
    import matplotlib.pyplot as plt

    fig = run_figure(records, title)
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
