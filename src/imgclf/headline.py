"""What a run's results come to, in a few facts: top-1, the training's LR (with the LR finder's
figure), its time against the forecast, where the model is. The terminal prints them when a run
ends (imgclf.run_end) and the report opens on them (results/report/{cluster}/landing.rst), from
the same artifacts, so that the two never disagree.

Each fact is given only for an artifact in `made` (paths as the rules name them): a run of one
target tells of that target's artifacts alone."""

from __future__ import annotations

import base64
import json
from pathlib import Path

from imgclf import layout
from imgclf.progress import hms

SOURCES = {"lr_finder": "the LR finder", "recipe": "the recipe",
           "validation": "the LR validation"}


# what reading a fact from its artifact raises when the file is of an older version, edited by
# hand or gone: that fact is left out, the others stand
UNREADABLE = (OSError, ValueError, KeyError, TypeError, ZeroDivisionError)


def _read(path: str) -> dict:
    return json.loads(Path(path).read_text())


def paths(c: str) -> dict[str, str]:
    return {"eval": layout.evaluation(c), "train": layout.train_summary(c),
            "lr": layout.lr_summary(c), "figure": layout.lr_figure(c),
            "forecast": layout.forecast(c), "export": layout.export_dir(c)}


def facts(c: str, made: set[str]) -> list[tuple[str, str]]:
    """(what, sentence) pairs of hardware entry `c`'s artifacts in `made`. A fact its artifact
    cannot give (an older or hand-edited summary lacks a key) is left out, never a traceback:
    a successful run ends on these lines."""
    p = paths(c)
    figure = f" (figure: {p['figure']})" if p["figure"] in made else ""
    found = []
    for fact in (top1, lr, time_against_forecast, forecast, model):
        try:
            found += fact(p, made, figure)
        except UNREADABLE:
            continue
    return found


def top1(p: dict, made: set[str], figure: str) -> list[tuple[str, str]]:
    if p["eval"] not in made:
        return []
    d = _read(p["eval"])
    return [("top-1", f"{100 * d['top1']:.1f} % on {d['num_images']} validation images "
                      f"({p['eval']})")]


def lr(p: dict, made: set[str], figure: str) -> list[tuple[str, str]]:
    """The training's LR (`figure`: where the LR finder's is, when it chose it), or before
    training the LR summary's."""
    if p["train"] in made:
        t = _read(p["train"])
        chosen = t["lr"]
        return [("LR", f"{chosen['value']:.3g} for global batch {t['global_batch']}, from "
                       f"{SOURCES.get(chosen['source'], chosen['source'])}"
                       f"{figure if chosen['source'] == 'lr_finder' else ''}")]
    if p["lr"] in made:
        d = _read(p["lr"])
        return [("LR", f"{d['training_lr']:.3g} for global batch {d['global_batch']}, "
                       f"from the LR finder{figure}")]
    return []


def time_against_forecast(p: dict, made: set[str], figure: str) -> list[tuple[str, str]]:
    """The training's time against the forecast it was given, where it had one."""
    if p["train"] not in made:
        return []
    vs = _read(p["train"]).get("against_forecast") or {}
    if not (vs.get("forecast") and vs.get("actual")):
        return []
    expected, actual = vs["forecast"]["seconds"], vs["actual"]["seconds"]
    return [("time", f"training took {hms(actual)} against the forecast's {hms(expected)} "
                     f"({100 * (actual / expected - 1):+.0f} %)")]


def forecast(p: dict, made: set[str], figure: str) -> list[tuple[str, str]]:
    """The forecast's sentence, until a training stands beside it."""
    if p["forecast"] not in made or p["train"] in made:
        return []
    said = _read(p["forecast"]).get("sentence")
    return [("forecast", f"{said.rstrip('.')} ({p['forecast']})")] if said else []


def model(p: dict, made: set[str], figure: str) -> list[tuple[str, str]]:
    if p["export"] not in made:
        return []
    return [("model", f"{p['export']} (`imgclf predict {p['export']} <images>`)")]


def landing(c: str, made: set[str]) -> str:
    """The report's landing page (reStructuredText): the facts, then the LR finder's figure as
    a data URI, as the report holds every figure (Snakemake's own `embeddedimage` directive
    leaves the file's path in the page, which the one-file report cannot reach)."""
    title = f"Results of cluster {c}"
    lines = [title, "=" * len(title), ""]
    for what, said in facts(c, made):
        lines.append(f":{what}: {said.replace('`', '``')}")
    figure = paths(c)["figure"]
    if figure in made:
        data = base64.b64encode(Path(figure).read_bytes()).decode()
        # the URI over lines of 76 (docutils refuses a line over 10,000 characters and joins
        # an image's URI lines)
        lines += ["", "The LR finder's runs and the chosen LR:", "",
                  ".. image:: data:image/png;base64,",
                  *(f"   {data[i:i + 76]}" for i in range(0, len(data), 76)),
                  "   :alt: the LR range tests and the chosen LR", "   :width: 720px"]
    lines += ["", "Every stage's figures and tables are under the categories on the left.", ""]
    return "\n".join(lines)


def run(c: str, made: list[str], out) -> None:
    Path(out).write_text(landing(c, set(made)))
