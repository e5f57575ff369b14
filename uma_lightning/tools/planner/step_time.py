"""A run's step time, split as ``StepTimeBreakdown`` logged it (data wait, forward, backward,
optimizer, overhead), drawn as one stacked bar per logged step."""

from __future__ import annotations

from uma_lightning.tools.planner.calibrate import metric_histories

# The parts of a step the callback logs, in the order they happen.
PARTS = ("data_wait", "forward", "backward", "optimizer", "overhead")


def step_time_parts(run_dir: str) -> dict[str, dict[int, float]]:
    """Per part, the milliseconds it took at each step the run logged."""
    histories = metric_histories(run_dir, [f"time/{part}_ms" for part in PARTS])
    return {part: dict(histories[f"time/{part}_ms"]) for part in PARTS}


def plot_step_time(path: str, parts: dict[str, dict[int, float]], title: str = "step time") -> None:
    """One stacked bar per step (a part a step did not log counts 0; a part no step logged is left
    out), to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = sorted({step for values in parts.values() for step in values})
    fig, ax = plt.subplots(figsize=(8, 4.5))
    below = [0.0] * len(steps)
    for colour, (part, values) in enumerate(parts.items()):
        if not values:
            continue
        heights = [values.get(step, 0.0) for step in steps]
        ax.bar(range(len(steps)), heights, bottom=below, label=part.replace("_", " "), color=f"C{colour}")
        below = [b + h for b, h in zip(below, heights)]
    # One bar per logged step, evenly spaced, labelled with its step (strings would warn as categories).
    ax.set_xticks(range(len(steps)), [str(step) for step in steps])
    ax.set_xlabel("step")
    ax.set_ylabel("milliseconds")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
