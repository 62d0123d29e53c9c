"""The evaluation's figure (results/eval/{cluster}_confusion.png), from its report
(results/eval/{cluster}.json): the row-normalised confusion matrix up to
`evaluate.max_confusion_classes` classes (the report holds the matrix then), beyond that the
most confused (true -> predicted) pairs."""

from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure

from imgclf.figures.common import read, save


def draw(eval_json, png) -> None:
    report = read(eval_json)
    if report["confusion_matrix"] is not None:
        _matrix(np.asarray(report["confusion_matrix"], dtype=np.int64), report["classes"], png)
    else:
        _pairs(report["most_confused"], report["num_classes"], png)


def _matrix(cm: np.ndarray, classes: list[str], path) -> None:
    """Row-normalised confusion matrix (rows: true class), counts written in small matrices."""
    n = len(classes)
    size = min(4 + 0.35 * n, 24)
    fig = Figure(figsize=(size + 1.5, size), layout="constrained")
    ax = fig.subplots()
    norm = cm.astype(np.float64) / np.maximum(cm.sum(1, keepdims=True), 1)
    im = ax.imshow(norm, cmap="Blues", vmin=0, vmax=1)
    fig.colorbar(im, ax=ax, label="fraction of the true class")
    if n <= 40:
        ax.set_xticks(range(n), classes, rotation=90)
        ax.set_yticks(range(n), classes)
    if n <= 20:
        for t in range(n):
            for p in range(n):
                if cm[t, p]:
                    ax.text(p, t, int(cm[t, p]), ha="center", va="center", fontsize=8,
                            color="white" if norm[t, p] > 0.5 else "black")
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_title(f"confusion matrix ({int(cm.sum())} images, top-1 "
                 f"{100 * float(np.trace(cm) / max(cm.sum(), 1)):.2f} %)")
    save(fig, path)


def _pairs(pairs: list[dict], num_classes: int, path) -> None:
    """Too many classes for a matrix: the most confused (true -> predicted) pairs as bars."""
    fig = Figure(figsize=(9, 1.5 + 0.3 * max(len(pairs), 1)), layout="constrained")
    ax = fig.subplots()
    labels = [f"{p['true']} -> {p['predicted']}" for p in pairs][::-1]
    ax.barh(range(len(pairs)), [p["count"] for p in pairs][::-1])
    ax.set_yticks(range(len(pairs)), labels)
    ax.set_xlabel("validation images")
    ax.set_title(f"most confused pairs ({num_classes} classes: too many for a matrix)")
    save(fig, path)
