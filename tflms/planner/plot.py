"""The memory timeline of one replayed step as a PNG (matplotlib, Agg backend)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tflms.planner.replay import Sample


def plot_timeline(
    samples: Sequence[Sample],
    path: str | Path,
    *,
    title: str,
    device_memory: int,
) -> Path:
    """Active, inactive and reclaimed bytes after every op, with page-in stalls marked."""
    if not samples:
        raise ValueError("no samples to plot: replay with record=True")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    unit, scale = ("GiB", float(1 << 30)) if device_memory >= 2 << 30 else ("MiB", float(1 << 20))
    t = [s.t * 1e3 for s in samples]
    active = [s.active / scale for s in samples]
    inactive = [s.inactive / scale for s in samples]
    reclaimed = [s.reclaimed / scale for s in samples]
    stall_ms = [s.stall * 1e3 for s in samples]

    fig, (ax, ax_stall) = plt.subplots(
        2, 1, figsize=(10, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]}
    )
    ax.stackplot(t, active, inactive, labels=["active (pinned)", "inactive (resident)"], alpha=0.8)
    ax.plot(t, reclaimed, color="tab:red", linewidth=1.2, label="reclaimed (in host memory)")
    ax.axhline(
        device_memory / scale, color="black", linestyle="--", linewidth=1, label="GPU memory"
    )
    stalled = [i for i in range(1, len(samples)) if samples[i].stall > samples[i - 1].stall]
    if stalled:
        ax.plot(
            [t[i] for i in stalled],
            [0.0] * len(stalled),
            "|",
            color="tab:purple",
            markersize=10,
            label="page-in stall",
        )
    ax.set_ylabel(unit)
    ax.set_title(title)
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    ax_stall.plot(t, stall_ms, color="tab:purple")
    ax_stall.set_ylabel("stall (ms, cumulative)")
    ax_stall.set_xlabel("modelled time in step (ms)")
    ax_stall.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
