"""The memory timeline of one replayed step as a PNG (matplotlib, Agg backend)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

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

    fig, (ax, ax_stall, ax_links) = plt.subplots(
        3, 1, figsize=(10, 7.5), sharex=True, gridspec_kw={"height_ratios": [3, 1, 1]}
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
    ax_stall.grid(alpha=0.3)
    edges, d2h = link_busy_fractions(samples, "d2h")
    _, h2d = link_busy_fractions(samples, "h2d")
    ax_links.stairs(d2h, edges, color="tab:red", label="device to host")
    ax_links.stairs(h2d, edges, color="tab:green", label="host to device")
    ax_links.set_ylim(0, 1.05)
    ax_links.set_ylabel("link busy")
    ax_links.set_xlabel("modelled time in step (ms, the GPU's clock)")
    ax_links.legend(loc="upper left", fontsize=8)
    ax_links.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def link_busy_fractions(
    samples: Sequence[Sample], direction: str, bins: int = 100
) -> tuple[list[float], list[float]]:
    """Bin edges (ms) over the step and the share of each bin one host link was busy.

    From the samples' cumulative busy seconds, linearly between samples: a copy under way
    between two ops counts as spread over that interval.
    """
    if not samples:
        raise ValueError("no samples: replay with record=True")
    times = np.array([0.0] + [s.t for s in samples])
    busy = np.array([0.0] + [getattr(s, f"{direction}_busy") for s in samples])
    end = float(times[-1])
    n = max(1, min(bins, len(samples)))
    edges = np.linspace(0.0, end, n + 1)
    at = np.interp(edges, times, busy)
    width = end / n if end > 0 else 1.0
    shares = np.clip(np.diff(at) / width, 0.0, 1.0)
    return (edges * 1e3).tolist(), shares.tolist()
