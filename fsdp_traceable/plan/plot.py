"""``plan --plot``: the traced step's memory on one rank, allocation by allocation, its
phases shaded and its peak marked (matplotlib, the ``[plot]`` extra)."""

from __future__ import annotations

import importlib.util

from .extrapolate import Plan

__all__ = ["require_matplotlib", "write_plot"]

_COLOURS = {"forward": "#d8e8f8", "backward": "#f8e0d0", "optimizer": "#dcf0dc"}


def require_matplotlib() -> None:
    """Raises ``RuntimeError`` naming the install if matplotlib is missing."""
    if importlib.util.find_spec("matplotlib") is None:
        raise RuntimeError("--plot needs matplotlib, which is not installed: pip install "
                           "matplotlib (or the [plot] extra), or leave out --plot")


def _spans(phases: list[str]) -> list[tuple[int, int, str]]:
    """``(start, end, phase)`` of each run of one phase among the timeline's points."""
    spans: list[tuple[int, int, str]] = []
    for index, phase in enumerate(phases):
        if spans and spans[-1][2] == phase:
            spans[-1] = (spans[-1][0], index + 1, phase)
        else:
            spans.append((index, index + 1, phase))
    return spans


def write_plot(plan: Plan, path: str, title: str) -> None:
    """Writes the deepest traced step's memory over its allocations and frees to
    ``path`` (PNG, SVG or PDF by its suffix).

    Args:
        plan: the plan (its deepest trace's timeline).
        path: the picture's file.
        title: what the picture is of (the model).
    """
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    # From the step's first op to its optimizer's last: before, the state alive at the
    # start is counted in; after, the traced model is taken apart.
    phases = plan.timeline_phases
    stepping = [i for i, phase in enumerate(phases) if phase in _COLOURS]
    first, last = (stepping[0], stepping[-1] + 1) if stepping else (0, len(phases))
    points, phases = plan.timeline[first:last], phases[first:last]
    scale, unit = (2**30, "GiB") if max(points, default=0) >= 2**30 else (2**20, "MiB")
    figure, axes = plt.subplots(figsize=(10, 4.5))
    for start, end, phase in _spans(phases):
        if phase in _COLOURS:
            axes.axvspan(start, end, color=_COLOURS[phase], linewidth=0)
    axes.plot([b / scale for b in points], color="#1f4e79", linewidth=1.2)
    if points:
        peak = max(range(len(points)), key=points.__getitem__)
        axes.plot(peak, points[peak] / scale, "o", color="#c00000")
        axes.annotate(f"peak {points[peak] / scale:.2f} {unit}", (peak, points[peak] / scale),
                      textcoords="offset points", xytext=(6, 6), color="#c00000")
        axes.set_ylim(0, points[peak] / scale * 1.15)
    axes.set_xlim(0, max(len(points) - 1, 1))
    axes.set_xlabel("allocations and frees of the traced step, in order (from the step's "
                    "start: parameters, optimizer state and batch alive)")
    axes.set_ylabel(f"{unit} alive on the rank" + (" (device)" if plan.offload else ""))
    stage = "" if plan.stage_index is None else f", pipeline stage {plan.stage_index}"
    axes.set_title(f"{title}{stage}: one step traced at {plan.traced_depths[-1]} blocks",
                   fontsize=11)
    axes.legend(handles=[Patch(color=c, label=p) for p, c in _COLOURS.items()],
                loc="upper left", fontsize=9, framealpha=0.9)
    axes.grid(axis="y", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
