"""One LR range test at a global batch of the batch curve (results/batch/{cluster}/x{k}/lr.json):
the LR finder's own test on one device, accumulation making up the batch, read with the LR
summary's rule, so that each batch trains at the LR found at it rather than scaled to it."""

from __future__ import annotations

import logging

from imgclf import artifacts
from imgclf.batch.grid import shape
from imgclf.errors import UserError
from imgclf.provenance import write_artifact

log = logging.getLogger(__name__)


def run(source, model, hw, memory_path, lr_cfg: dict, multiple: float, out,
        cudnn_benchmark: bool, threads=None) -> dict:
    """results/batch/{cluster}/x{k}/lr.json: one range test at `multiple` x the plan's global
    batch on one device (accumulation makes up the batch), read as the LR summary reads its
    runs: the `lr_finder.suggestion` times `lr_finder.multiple`."""
    from imgclf.lr import find as lr_find
    from imgclf.lr.summary import read_curve

    plan = artifacts.Plan.read(memory_path, hw["name"])
    s = shape(plan, multiple)
    test = lr_find.find(source, model, hw, plan, lr_cfg, 0, batch_size=s["per_device_batch"],
                        threads=threads, cudnn_benchmark=cudnn_benchmark,
                        accumulation=s["global_batch"] // s["per_device_batch"])
    curve = read_curve(test, lr_cfg)
    suggested = curve["suggestions"][lr_cfg["suggestion"]]
    if curve["excluded"]:
        raise UserError(f"The LR range test at global batch {s['global_batch']} ({multiple:g}x "
                        f"the plan) gave no usable suggestion ({'; '.join(curve['flags'])}): "
                        f"widen `lr_finder.start_lr`/`end_lr` or drop {multiple:g} from "
                        f"`batch_curve.multiples`.")
    lr = suggested * lr_cfg["multiple"]
    log.info("global batch %d: LR %.4g (%s %.4g x %g)", s["global_batch"], lr,
             lr_cfg["suggestion"], suggested, lr_cfg["multiple"])
    result = {**s, "suggested_lr": suggested, "lr_multiple": lr_cfg["multiple"], "lr": lr,
              "suggestion": lr_cfg["suggestion"], "curve": curve, "range_test": test}
    return write_artifact(out, result, config_slice={"source": source, "model": model, "hw": hw,
                                                      "lr_finder": lr_cfg,
                                                      "multiple": multiple},
                          inputs=[memory_path])
