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


def plot_losses(runs: List[dict], path: str, title: str = "") -> Optional[str]:
    """Training loss (smoothed) and validation loss against steps, one line per run. Returns the path, or None
    without matplotlib."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, (ax_train, ax_val) = plt.subplots(1, 2, figsize=(9, 3.4), dpi=100)
    for run in runs:
        c = run["curves"]
        color = COLORS.get(run["recipe"])
        ax_train.plot(c["step"], _smooth(c["train_loss"]), label=run["recipe"], color=color, lw=1.3)
        ax_val.plot(c["val_step"], c["val_loss"], marker="o", ms=3, label=run["recipe"], color=color, lw=1.3)
    ax_train.set_title("training loss (smoothed)", fontsize=10)
    ax_val.set_title("validation loss", fontsize=10)
    for ax in (ax_train, ax_val):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
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
