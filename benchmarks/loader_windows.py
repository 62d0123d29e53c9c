"""How short may the loader benchmark's windows be? Its rate's spread against the window.

On the demo digits (`results/demo/digits`, from any demo run), two configurations, 0 workers
with tensor decoding and 1 PIL worker with prefetch 2, each timed as the benchmark times a
configuration (`time_config`: 2 warm-up batches, the median of 3 windows, one main-process
thread) 8 times (sampler seeds 0-7) at each window length; printed per length: the batches a
configuration timed, the median rate, the coefficient of variation and max/min of the 8.

    .venv/bin/python benchmarks/loader_windows.py
"""

import statistics
from pathlib import Path

from imgclf import recipes
from imgclf.data import datasets
from imgclf.loader_bench.timing import time_config, torch_threads, rss_kind

DEMO = Path(__file__).resolve().parents[1] / "results" / "demo" / "digits"
CONFIGS = [("tensor", 0, 0), ("pil", 1, 2)]  # (decoder, workers, prefetch)
SECONDS = [0.05, 0.15, 0.3, 1.5]  # per configuration: 3 windows of a third each
REPEATS = 8


def main() -> None:
    recipe, kind = recipes.get("demo"), rss_kind()
    for decoder, workers, prefetch in CONFIGS:
        dataset = datasets.train_dataset(str(DEMO), decoder, 32, recipe)
        for seconds in SECONDS:
            rates, batches = [], []
            with torch_threads(1):
                for seed in range(REPEATS):
                    r = time_config(dataset, 64, workers, prefetch, seconds=seconds, windows=3,
                                    warmup_batches=2, pin_memory=False, seed=seed, kind=kind)
                    rates.append(r["images_per_s"])
                    batches.append(r["batches_timed"])
            print(f"{decoder} w={workers} p={prefetch}, windows of {seconds / 3:.3f} s "
                  f"({min(batches)}-{max(batches)} batches in the 3): median "
                  f"{statistics.median(rates):.0f} img/s, cv "
                  f"{statistics.stdev(rates) / statistics.mean(rates):.1%}, max/min "
                  f"{max(rates) / min(rates):.2f}", flush=True)


if __name__ == "__main__":
    main()
