"""`imgclf predict`'s loop against evaluation's, on the same images, model, batch, workers and
device: images per second, medians of `--repeats` rounds timed side by side (the two loops
alternate, after one untimed round of each).

Both loops get a fresh DataLoader of `--workers` decoding processes each round (their start is
timed in both) over the validation images of a data set root (ROOT/val/<class>/...; default the
demo's, results/demo/digits, of a workflow folder that ran it) and an export folder:
- predict: predict.loop over predict.ImageFiles (top-k probabilities read back per batch, a
  bad file's error caught in its worker);
- evaluation: evaluate.predict over datasets.IndexedImages of the same files (its file index built
  from the folder as evaluation's is from the hydration check's), into evaluate.Accumulator
  (top-1, top-5, loss, confusion matrix on the device).
Both decode and transform with the export's preprocessing (tests/test_predict.py checks it is
evaluation's, tensor for tensor) in fp32.

    .venv/bin/python benchmarks/predict.py [--model results/export/local]
        [--data results/demo/digits] [--repeats 5] [--batch-size 64] [--workers N]
        [--device cpu|cuda|auto]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from imgclf import evaluate, hardware, model_folder, predict, settings
from imgclf.data import datasets, loaders


def predict_round(model, dataset, args, device, k: int) -> float:
    loader = loaders.loader(dataset, args.batch_size, args.workers, 2 if args.workers else None,
                            shuffle=False, pin_memory=device.type == "cuda")
    t = time.perf_counter()
    seen = sum(len(errors) for errors, _, _ in predict.loop(model, loader, device, k))
    elapsed = time.perf_counter() - t
    assert seen == len(dataset)
    return elapsed


def evaluation_round(model, dataset, args, device, classes: int) -> float:
    loader = loaders.loader(dataset, args.batch_size, args.workers, 2 if args.workers else None,
                            shuffle=False, pin_memory=device.type == "cuda")
    acc = evaluate.Accumulator(classes, device)
    elapsed = evaluate.predict(model, loader, device, "32", False, acc)
    assert acc.count == len(dataset)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="results/export/local", help="export folder")
    parser.add_argument("--data", default=settings.DEMO_ROOT,
                        help="data set root whose val/<class>/ images are predicted")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=None,
                        help="decoding processes of both loops (default: predict's choice)")
    parser.add_argument("--device", default="auto", help="cpu, cuda, or auto (predict's choice)")
    args = parser.parse_args()

    described = model_folder.read(args.model)
    pre, classes = described["preprocessing"], described["classes"]
    files = predict.find_files([os.path.join(args.data, "val")])
    index = datasets.split_index(args.data, "val")
    evaluation_set = datasets.IndexedImages(index, pre["decoder"], predict.transform(pre))
    assert sorted(map(os.path.normpath, files)) == \
        sorted(os.path.normpath(index.file(i)) for i in range(len(index))), "not the same files"
    predict_set = predict.ImageFiles(files, pre, index.max_image_pixels)
    device = predict.pick_device() if args.device == "auto" else torch.device(args.device)
    if args.workers is None:
        args.workers = predict.default_workers(len(files), args.batch_size)
    model = predict.load_model(args.model, described).to(device)
    k = min(5, len(classes))
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else hardware.cpu_model()
    print(f"{len(files)} images of {args.data}/val, {described['arch']} at "
          f"{pre['center_crop']} px ({pre['decoder']} decoder), batch {args.batch_size}, "
          f"{args.workers} worker(s), {device} ({name}), {hardware.usable_cpus()} CPUs, "
          f"torch threads {torch.get_num_threads()}, {args.repeats} repeats")

    predict_round(model, predict_set, args, device, k)  # untimed: caches, kernels, page cache
    evaluation_round(model, evaluation_set, args, device, len(classes))
    times = {"predict": [], "evaluation": []}
    for _ in range(args.repeats):
        times["predict"].append(predict_round(model, predict_set, args, device, k))
        times["evaluation"].append(evaluation_round(model, evaluation_set, args, device,
                                                    len(classes)))
    rates = {name: [len(files) / t for t in ts] for name, ts in times.items()}
    for loop_name, r in rates.items():
        print(f"{loop_name:>10}: median {statistics.median(r):8.1f} images/s "
              f"(min {min(r):.1f}, max {max(r):.1f})")
    print(f"predict / evaluation: "
          f"{statistics.median(rates['predict']) / statistics.median(rates['evaluation']):.3f}")


if __name__ == "__main__":
    main()
