"""The gradient noise scale: the estimator against a problem whose answer is known, the paper's
model as the report words it, and the norms a DDP hook takes on 2 real gloo ranks against the
same gradients computed in one process. The stage's artifact, report section and the values
logged in training are checked on the complete demo run (tests/test_reproducibility.py)."""

from __future__ import annotations

import multiprocessing
import queue
import time

import numpy as np
import pytest
import torch

from imgclf import gradient_noise, noise_scale


def synthetic_norms(mean: np.ndarray, std: np.ndarray, batch: int, accumulate: int, steps: int,
                    seed: int = 0):
    """Per step, what the measurement records for per-example gradients ~ N(mean, diag(std^2)):
    the mean squared norm of `accumulate` micro-batch gradients and that of their mean."""
    rng = np.random.default_rng(seed)
    small, big = [], []
    for _ in range(steps):
        examples = rng.normal(mean, std, size=(accumulate, batch, len(mean)))
        micro = examples.mean(axis=1)
        small.append(float((micro ** 2).sum(axis=1).mean()))
        big.append(float((micro.mean(axis=0) ** 2).sum()))
    return small, big


def test_the_estimate_finds_a_noise_scale_set_by_hand():
    """tr(Sigma)/|G|^2 = 200 * 4 / 1.0 = 800, measured at batches 32 and 128 (both far below
    it, as on a real data set): within its own 68 % interval's reach and 10 % of the truth."""
    mean = np.zeros(200)
    mean[0] = 1.0
    std = np.full(200, 2.0)
    small, big = synthetic_norms(mean, std, batch=32, accumulate=4, steps=400)
    est = gradient_noise.estimate(small, big, 32, 128)
    assert est["b_simple"] == pytest.approx(800, rel=0.10)
    lo, hi = est["interval_68"]
    assert lo < est["b_simple"] < hi
    assert abs(est["b_simple"] - 800) < 3 * est["stderr"]
    # the separate parts, too: |G|^2 = 1, tr(Sigma) = 800
    assert est["grad_sq"] == pytest.approx(1.0, rel=0.10)
    assert est["trace"] == pytest.approx(800, rel=0.05)


def test_more_steps_narrow_the_interval():
    mean, std = np.r_[1.0, np.zeros(99)], np.full(100, 2.0)
    few = gradient_noise.estimate(*synthetic_norms(mean, std, 16, 4, 25, seed=1), 16, 64)
    many = gradient_noise.estimate(*synthetic_norms(mean, std, 16, 4, 400, seed=1), 16, 64)
    assert many["stderr"] < few["stderr"] / 2


def test_pure_noise_gives_no_noise_scale_or_a_huge_one_and_says_what_to_raise():
    """|G|^2 = 0: its estimate straddles 0, so B_simple is none (a mean that is not positive)
    or far above the batches measured (a small positive mean by chance: here at least 5 times
    the larger); over 20 seeds both happen."""
    estimates = [gradient_noise.estimate(*synthetic_norms(np.zeros(50), np.ones(50), 8, 4, 40,
                                                       seed=seed), 8, 32)["b_simple"]
                 for seed in range(20)]
    finite = [b for b in estimates if b is not None]
    assert 0 < len(finite) < len(estimates) and min(finite) > 5 * 32, estimates
    adv = noise_scale.advice(1024, None, None, "p4")
    assert "noise_scale.steps" in adv["sentence"] and adv["options"] == []
    assert "snakemake results/batch/p4.json" in adv["sentence"]


def test_the_paper_model_gives_the_figures_the_batch_curve_words():
    """Steps at another batch over those at the plan's, by S = S_min (1 + B/B'): what the
    measured curve's options (imgclf.batch.curve) and the noise plot's model line use."""
    assert gradient_noise.time_ratio(1000, 2000, 1000) == pytest.approx(1.5 / 2)
    twice = gradient_noise.option(1024, 8, 16, 3400)
    assert (twice["global_batch"], twice["time"], twice["cost"]) == (2048, 0.616, 1.231)
    assert gradient_noise.nearest_devices(1024, 8, 3400) == 32


def test_auto_steps_are_a_share_of_the_training_with_a_floor():
    """`steps: auto` on a plan of per-device batch 64, 2 ranks, 1,438 training images (11
    batches a rank) and 4 micro-batches a step: a long training gets 2 % of its images per
    device; a short one the floor of 10 steps, and a note that says what they cost; a number
    set by hand is taken as it is, with its share."""
    from types import SimpleNamespace

    from imgclf.artifacts import Plan

    plan = Plan(path="m.json", cluster="local", per_device_batch=64, accumulate_grad_batches=1,
                devices_per_node=2, nodes=1, num_workers=0, prefetch_factor=None,
                decoder="pil")
    from imgclf import recipes

    run = SimpleNamespace(batch=64, loader=SimpleNamespace(dataset=range(1438)),
                          recipe=recipes.get("demo"))  # 12 epochs
    cfg = {"steps": "auto", "accumulate": 4}
    per_epoch = 11 * 64
    long = noise_scale.steps_for(cfg, run, plan, {"epochs": 2000, "limit_train_batches": None},
                                 0.02)
    assert long["units"] == int(0.02 * 2000 * per_epoch / 256) == 110 and long["note"] is None
    assert long["share_of_training"] == pytest.approx(0.02, rel=0.01)
    short = noise_scale.steps_for(cfg, run, plan, {"epochs": None, "limit_train_batches": None},
                                  0.02)  # the recipe's 12 epochs
    assert short["units"] == noise_scale.MIN_STEPS == 10
    assert short["share_of_training"] == pytest.approx(10 * 256 / (12 * per_epoch))
    assert "the fewest its statistics allow, take 30% of the planned training" in short["note"]
    by_hand = noise_scale.steps_for({**cfg, "steps": 3}, run, plan,
                                    {"epochs": None, "limit_train_batches": None}, 0.02)
    assert (by_hand["units"], by_hand["set_by"]) == (3, "noise_scale.steps")


# --- the DDP hook on 2 gloo ranks ---------------------------------------------------------------

def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))


def batch_of(rank: int):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


def gradient(model, x, y) -> torch.Tensor:
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _rank(rank: int, store: str, results) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    model = torch.nn.parallel.DistributedDataParallel(tiny_model(), bucket_cap_mb=0.0001)
    hook = gradient_noise.NormHook(torch.device("cpu"))
    model.register_comm_hook(None, hook.all_reduce)
    x, y = batch_of(rank)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    local, reduced = hook.take()
    after = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    # the locked torch puts a model this small in one bucket whatever bucket_cap_mb says: the
    # same gradient again, as one bucket per parameter, which the hook must sum
    own = gradient(tiny_model(), x, y)
    buckets = [Bucket(part) for part in own.split([p.numel() for p in model.parameters()])]
    torch.futures.wait_all([hook.all_reduce(None, b) for b in buckets])
    split = hook.take()
    del model
    end_rank(results, (rank, float(local), float(reduced), after.tolist(), *map(float, split)))


class Bucket:
    """What the hook reads of DDP's GradBucket: its flat gradient."""

    def __init__(self, flat: torch.Tensor):
        self.flat = flat

    def buffer(self) -> torch.Tensor:
        return self.flat


@pytest.mark.slow
def test_the_hook_takes_each_ranks_norm_and_the_all_reduced_one(tmp_path):
    """Each bucket's norms summed (a bucket per parameter); the gradients DDP leaves are the
    all-reduced ones, unchanged by the hook. The ranks meet through a file, not a port another
    process could take first; a rank that fails ends the other, and the test, at once."""
    got = run_ranks(_rank, tmp_path)
    model = tiny_model()
    local = [gradient(model, *batch_of(r)) for r in range(2)]
    mean = (local[0] + local[1]) / 2
    for r in range(2):
        sq_local, sq_reduced, after, *by_parameter = got[r]
        for whole in (sq_local, by_parameter[0]):
            assert whole == pytest.approx(float(local[r].pow(2).sum()), rel=1e-5)
        for whole in (sq_reduced, by_parameter[1]):
            assert whole == pytest.approx(float(mean.pow(2).sum()), rel=1e-5)
        assert after == pytest.approx(mean.tolist(), rel=1e-5, abs=1e-7)


# NoiseScaleLog as Lightning drives it on each of 2 gloo ranks: micro-batches of 4, accumulation
# 2, an epoch of 5 batches (its last step a partial group of one, whose loss Lightning still
# divides by 2), every loss multiplied by the AMP loss scale of a 16-mixed run.
ACCUMULATE, MICRO, BATCHES, LOSS_SCALE = 2, 4, 5, 64.0


def micro_batch(rank: int, i: int):
    g = torch.Generator().manual_seed(1000 * rank + i)
    return torch.randn(MICRO, 6, generator=g), torch.randint(0, 3, (MICRO,), generator=g)


class FakeScaler:
    """A 16-mixed run's GradScaler at LOSS_SCALE; reading the scale on the host is a failure."""

    def is_enabled(self):
        return True

    def _get_scale_async(self):
        return torch.tensor(LOSS_SCALE)

    def get_scale(self):
        raise AssertionError("the loss scale was read on the host (a synchronisation per step)")


def _logging_rank(rank: int, store: str, results) -> None:
    import contextlib
    from types import SimpleNamespace

    import torch.distributed as dist

    from imgclf.train.callbacks import NoiseScaleLog

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    net = tiny_model()
    model = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.0001)
    trainer = SimpleNamespace(strategy=SimpleNamespace(model=model), world_size=2,
                              accumulate_grad_batches=ACCUMULATE, current_epoch=0,
                              precision_plugin=SimpleNamespace(scaler=FakeScaler()))
    module = SimpleNamespace(device=torch.device("cpu"), log=lambda *args, **kwargs: None)
    log = NoiseScaleLog(MICRO * ACCUMULATE, MICRO * ACCUMULATE * 2)
    log.on_fit_start(trainer, module)
    for i in range(BATCHES):
        x, y = micro_batch(rank, i)
        log.on_train_batch_start(trainer, module, (x, y), i)
        steps = (i + 1) % ACCUMULATE == 0 or i == BATCHES - 1
        with contextlib.nullcontext() if steps else model.no_sync():  # forward and backward
            loss = torch.nn.functional.cross_entropy(model(x), y) / ACCUMULATE * LOSS_SCALE
            loss.backward()
        if steps:
            log.on_before_optimizer_step(trainer, module, None)
            net.zero_grad()
    log.on_train_epoch_end(trainer, module)
    del model, trainer
    end_rank(results, (rank, log.by_epoch))


def end_rank(results, item) -> None:
    """Send `item` to the test, then destroy the process group, the rank's DDP model already
    deleted by the caller. A gloo group that the DDP reducer frees last is destroyed with the
    GIL held, joining a worker thread that may still wait for the GIL to free the hook's Python
    callback (pytorch#56297): the rank then hangs, and so does the queue's thread that would
    send `item`."""
    import gc

    import torch.distributed as dist

    results.put(item)
    results.close()
    results.join_thread()
    gc.collect()  # the reducer freed while the default group still holds the process group
    dist.destroy_process_group()


def run_ranks(target, tmp_path) -> dict:
    """{rank: what `target` put} from 2 spawned gloo ranks that meet through a file; a rank that
    fails ends the test at once."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, str(tmp_path / "store"), results), daemon=True)
             for r in range(2)]
    for p in procs:
        p.start()
    # a bound on a hang, not on speed: under CI's load a rank took minutes to import and start
    got, deadline = {}, time.monotonic() + 600
    try:
        while len(got) < len(procs):
            try:
                r, *rest = results.get(timeout=1)
                got[r] = rest
            except queue.Empty:
                assert all(p.exitcode in (None, 0) for p in procs), [p.exitcode for p in procs]
                assert time.monotonic() < deadline, "no result within 600 s"
        for p in procs:
            p.join(timeout=60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
    return got


@pytest.mark.slow
def test_training_logs_the_noise_scale_of_the_steps_it_took(tmp_path):
    """The epoch's B_simple over both ranks, unscaled from the AMP loss scale without a host
    synchronisation, its partial last step taken at the one micro-batch it had: against the
    same gradients computed by hand in one process."""
    got = run_ranks(_logging_rank, tmp_path)
    [epoch] = got[0][0]
    assert got[1][0] == [epoch]  # every rank logs the same

    model, grad_sq, trace = tiny_model(), [], []
    groups = [range(i, min(i + ACCUMULATE, BATCHES)) for i in range(0, BATCHES, ACCUMULATE)]
    for group in groups:  # per step: each rank's mean gradient, and theirs
        local = [torch.stack([gradient(model, *micro_batch(r, i)) for i in group]).mean(0)
                 for r in range(2)]
        big_sq = float(((local[0] + local[1]) / 2).pow(2).sum())
        small, large = MICRO * len(group), MICRO * len(group) * 2
        for r in range(2):
            small_sq = float(local[r].pow(2).sum())
            grad_sq.append((large * big_sq - small * small_sq) / (large - small))
            trace.append((small_sq - big_sq) / (1 / small - 1 / large))
    assert epoch["steps"] == len(groups) == 3
    assert epoch["grad_sq"] == pytest.approx(np.mean(grad_sq), rel=1e-4)
    assert epoch["trace"] == pytest.approx(np.mean(trace), rel=1e-4)
    assert epoch["b_simple"] == pytest.approx(np.mean(trace) / np.mean(grad_sq), rel=1e-4)
