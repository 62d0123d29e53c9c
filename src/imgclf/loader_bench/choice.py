"""Choosing a loader configuration from measured rows, and comparing it with the baseline.

Works on rows as the benchmark writes them (`decoder`, `num_workers`, `prefetch_factor`,
`role`, `measured`, `images_per_s`, `ram_bytes`, `fits_budget`, ...); it times nothing."""

from __future__ import annotations

from imgclf.errors import UserError
from imgclf.loader_bench.timing import GB, buffer_bytes


def cost(row: dict) -> tuple:
    """Cheaper = fewer worker processes, then less prefetched RAM, then faster."""
    return (row["num_workers"], row["prefetch_factor"], -row["images_per_s"])


def describe_config(row: dict) -> str:
    """A configuration in words, e.g. `tensor decode, 4 workers, prefetch 2`."""
    if row["num_workers"] == 0:
        return f"{row['decoder']} decode in the training process (0 workers)"
    plural = "s" if row["num_workers"] > 1 else ""
    return (f"{row['decoder']} decode, {row['num_workers']} worker{plural}, "
            f"prefetch {row['prefetch_factor']}")


def _best_by_decoder(rows: list[dict]) -> dict:
    best = {}
    for r in rows:
        if r["decoder"] not in best or r["images_per_s"] > best[r["decoder"]]["images_per_s"]:
            best[r["decoder"]] = r
    return best


def choose(rows: list[dict], tolerance: float, budget: float) -> dict:
    """The faster decode path; within it, the cheapest configuration whose throughput is within
    `tolerance` of the best and whose RAM fits `budget`. Returns the chosen row, the best row,
    the best fitting row per decode path and a one-sentence reason (`why`)."""
    fitting = [r for r in rows if r["measured"] and r["role"] == "grid" and r["fits_budget"]]
    if not fitting:
        raise UserError(f"No loader configuration fits the RAM budget of {budget / GB:.2f} GB "
                        f"per device (host RAM x `loader.ram_margin` / devices per node): lower "
                        f"`loader.batch_size` or `loader.prefetch_factors`.")
    best_by_decoder = _best_by_decoder(fitting)
    best = max(best_by_decoder.values(), key=lambda r: r["images_per_s"])
    near = [r for r in fitting if r["decoder"] == best["decoder"]
            and r["images_per_s"] >= (1 - tolerance) * best["images_per_s"]]
    chosen = min(near, key=cost)
    others = [f"{d}'s best was {r['images_per_s']:.0f} img/s ({describe_config(r)})"
              for d, r in sorted(best_by_decoder.items()) if d != best["decoder"]]
    why = (f"{describe_config(chosen)}: {chosen['images_per_s']:.0f} img/s, the cheapest "
           f"configuration within {tolerance:.0%} of the best ({best['images_per_s']:.0f} img/s, "
           f"{describe_config(best)}); it needs {chosen['ram_bytes'] / GB:.2f} GB of the "
           f"{budget / GB:.2f} GB RAM budget per device")
    why += ("; " + "; ".join(others) if others else "") + "."
    return {"row": chosen, "best": best, "why": why, "best_by_decoder": best_by_decoder}


def choice_block(pick: dict) -> dict:
    """The report's `choice`: the chosen configuration, its images/s and why."""
    row = pick["row"]
    return {"decoder": row["decoder"], "num_workers": row["num_workers"],
            "prefetch_factor": row["prefetch_factor"], "images_per_s": row["images_per_s"],
            "why": pick["why"]}


def decoder_bests(rows: list[dict], decoders: list[str], pick: dict) -> dict:
    """The report's `decoders`: per decode path its best configuration that fits the budget,
    else its fastest measured one, else None."""
    out = {}
    for d in decoders:
        mine = [r for r in rows if r["decoder"] == d and r["role"] == "grid" and r["measured"]]
        best = pick["best_by_decoder"].get(d) or \
            (max(mine, key=lambda r: r["images_per_s"]) if mine else None)
        out[d] = None if best is None else {
            "images_per_s": best["images_per_s"], "num_workers": best["num_workers"],
            "prefetch_factor": best["prefetch_factor"], "fits_budget": best["fits_budget"],
            "ram_bytes": best["ram_bytes"]}
    return out


def baseline_block(key: tuple[str, int, int], rows: list[dict], choice: dict, batch_bytes: int,
                   cpus_here: int) -> dict:
    """The report's `baseline`: the baseline configuration (`key`: decoder, workers, prefetch),
    its measured images/s and RAM, and `choice_over_baseline`, the chosen configuration's
    images/s over the baseline's; or why it was not measured."""
    decoder, workers, prefetch = key
    out = {"decoder": decoder, "num_workers": workers, "prefetch_factor": prefetch,
           "predicted_buffer_bytes": buffer_bytes(workers, prefetch, batch_bytes)}
    row = next((r for r in rows if r["is_baseline"]), None)
    if row is None:
        return out | {"measured": False, "images_per_s": None,
                      "reason": "not measured: `loader.measure_baseline` is false"}
    if not row["measured"]:
        return out | {"measured": False, "images_per_s": None, "reason": row["note"]}
    out.update(measured=True, images_per_s=row["images_per_s"], ram_bytes=row["ram_bytes"],
               fits_budget=row["fits_budget"],
               choice_over_baseline=round(choice["images_per_s"] / row["images_per_s"], 3),
               reason=None)
    if workers > cpus_here:
        out["note"] = f"{workers} workers on this machine's {cpus_here} CPUs: oversubscribed here"
    return out
