"""One step beyond the LR validation grid's edge (results/lr/{cluster}/validate/edge{step}.json):
from the runs so far, the next multiple to train, or none and why (lr_validation.next_multiple)."""

from __future__ import annotations

import logging

from imgclf import artifacts
from imgclf.lr_validation import describe, next_multiple
from imgclf.provenance import write_artifact

log = logging.getLogger(__name__)


def run(run_paths, out) -> dict:
    """One edge step (results/lr/{cluster}/validate/edge{step}.json): the next multiple for the
    runs so far, or none, and why."""
    runs = [artifacts.validation_run(p) for p in run_paths]
    decision = next_multiple(runs)
    decision["reason"] = describe(decision, runs)
    log.info("%s", decision["reason"])
    return write_artifact(out, decision, inputs=list(run_paths))
