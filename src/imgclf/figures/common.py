"""What the figures share: reading a stage's JSON and saving a figure atomically.

Every figure is drawn on matplotlib's object API (`Figure`, rendered by the Agg canvas), never on
pyplot: no global backend is switched, no window can open on a login node, and a figure drawn
beside other work in one process cannot disturb it."""

from __future__ import annotations

import math

from matplotlib.figure import Figure

from imgclf.provenance import atomic_path, read_json

GB = 1e9


def read(path) -> dict:
    """A stage's JSON (NaN and infinities as the stage wrote them)."""
    return read_json(path)


def save(fig: Figure, path, dpi: int = 100) -> None:
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=dpi, format="png")


def is_number(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)
