"""The demo's figures (matplotlib with the Agg backend; optional)."""

from __future__ import annotations

from typing import List, Optional


def _pyplot():
    """matplotlib.pyplot on the Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _smooth(values: List[float], beta: float = 0.9) -> List[float]:
    """Bias-corrected exponential moving average (as the curves of most training dashboards)."""
    out, avg = [], 0.0
    for i, v in enumerate(values):
        avg = beta * avg + (1 - beta) * v
        out.append(avg / (1 - beta ** (i + 1)))
    return out


COLORS = {"bf16": "#444444", "current": "#1f77b4", "delayed": "#d62728"}


def bf16_differences(runs: List[dict]) -> List[dict]:
    """Per non-bf16 run, its distance from the bf16 run (empty without a bf16 run):
    `step`, `train_pct` (100 * (smoothed training loss / smoothed bf16 training loss - 1), the same smoothing of
    both curves), `val_step`, `val_pct` (the same for each validation loss) and `final_pct` (the final validation
    loss, the "vs bf16" column of the results table)."""
    base = next((r for r in runs if r["recipe"] == "bf16"), None)
    if base is None:
        return []
    b = base["curves"]
    b_train, b_val = dict(zip(b["step"], _smooth(b["train_loss"]))), dict(zip(b["val_step"], b["val_loss"]))
    out = []
    for run in runs:
        if run is base:
            continue
        c = run["curves"]
        train = [(s, 100 * (v / b_train[s] - 1)) for s, v in zip(c["step"], _smooth(c["train_loss"])) if s in b_train]
        val = [(s, 100 * (v / b_val[s] - 1)) for s, v in zip(c["val_step"], c["val_loss"]) if s in b_val]
        out.append({"recipe": run["recipe"], "step": [s for s, _ in train], "train_pct": [d for _, d in train],
                    "val_step": [s for s, _ in val], "val_pct": [d for _, d in val],
                    "final_pct": 100 * (run["final_val_loss"] / base["final_val_loss"] - 1)})
    return out


def loss_figure(runs: List[dict], title: str = ""):
    """The matplotlib Figure of `plot_losses` (the caller closes it), or None without matplotlib."""
    plt = _pyplot()
    if plt is None:
        return None
    diffs = bf16_differences(runs)
    fig, axes = plt.subplots(1, 3 if diffs else 2, figsize=(13.5 if diffs else 9, 3.6), dpi=100)
    ax_train, ax_val = axes[0], axes[1]
    for run in runs:
        c = run["curves"]
        color = COLORS.get(run["recipe"])
        ax_train.plot(c["step"], _smooth(c["train_loss"]), label=run["recipe"], color=color, lw=1.3)
        ax_val.plot(c["val_step"], c["val_loss"], marker="o", ms=3, label=run["recipe"], color=color, lw=1.3)
    ax_train.set_title("training loss (smoothed)", fontsize=10)
    ax_val.set_title("validation loss", fontsize=10)
    if diffs:
        ax_diff = axes[2]
        ax_diff.axhline(0, color=COLORS["bf16"], lw=1, label="bf16")
        for d in diffs:
            color = COLORS.get(d["recipe"])
            ax_diff.plot(d["step"], d["train_pct"], color=color, lw=1.3,
                         label=f"{d['recipe']} train (final val {d['final_pct']:+.2f}%)")
            ax_diff.plot(d["val_step"], d["val_pct"], color=color, lw=0, marker="o", ms=3)
        ax_diff.set_title("difference from bf16, % (lines: training, smoothed; dots: validation)", fontsize=9)
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def plot_losses(runs: List[dict], path: str, title: str = "") -> Optional[str]:
    """Training loss (smoothed), validation loss and, with a bf16 run, each other run's difference from bf16 in %
    (smoothed; the final validation difference in the legend), against steps. Returns the path, or None without
    matplotlib."""
    fig = loss_figure(runs, title)
    if fig is None:
        return None
    fig.savefig(path)
    _pyplot().close(fig)
    return path


def plot_delayed_trace(trace: dict, path: str) -> Optional[str]:
    """The newest amax and the scale of each slot of one module under delayed scaling, per step."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, (ax_amax, ax_scale) = plt.subplots(1, 2, figsize=(9, 3.4), dpi=100)
    steps = range(1, len(trace["amax_input"]) + 1)
    for role, color in (("input", "#1f77b4"), ("weight", "#2ca02c"), ("grad_output", "#d62728")):
        ax_amax.plot(steps, trace[f"amax_{role}"], label=role, color=color, lw=1.2)
        ax_scale.plot(steps, trace[f"scale_{role}"], label=role, color=color, lw=1.2)
    ax_amax.set_title("amax (newest history row)", fontsize=10)
    ax_scale.set_title("scale used by the next step's casts", fontsize=10)
    for ax in (ax_amax, ax_scale):
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.suptitle(f"delayed scaling, {trace['module']} (history length {trace['history_len']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def matplotlib_available() -> bool:
    return _pyplot() is not None
