"""A training resumed mid-epoch (after Slurm's requeue, or any resume from a mid-epoch
last.ckpt) trains on exactly the samples an uninterrupted epoch would have, rank by rank; the
requeue saves only between accumulation groups; a checkpoint saved mid-epoch by an earlier
version, without the loader's position, still resumes and says what it does."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning.pytorch as L
import pytest
import torch
from torch.utils.data import DistributedSampler, TensorDataset

from imgclf import sampling
from imgclf.forecast import cpu_ranks
from imgclf.data import datasets, loaders
from imgclf.slurm import requeue
from imgclf.train import resume
from imgclf.train.callbacks import RequeueAtTimeLimit
from imgclf.train.module import ImageData

# Two ranks as srun starts them (test_slurm.py), each loading through the training's own
# ImageData with a fork-server worker, a data set of its indices, accumulation 2 and the requeue
# check every 3 batches (every 4: whole groups). For each sampler: 2 epochs uninterrupted
# (`whole`); again with Slurm's signal to rank 0 at epoch 1's second batch (`requeued`), when
# at the check both ranks save last.ckpt and rank 0 asks `scontrol` on PATH for the requeue,
# then the run ends, as at Slurm's SIGTERM (here by an exception on both ranks, so that one
# start of the ranks serves both samplers); then resumed from last.ckpt (`resumed`).
RANK = """
import json, logging, os, signal, sys
from pathlib import Path
from imgclf.slurm import requeue
requeue.catch_requeue_signal()
import lightning as L, torch
from torch.utils.data import TensorDataset
from imgclf.train.callbacks import RequeueAtTimeLimit
from imgclf.train.module import ImageData

logging.basicConfig(level=logging.INFO, format="%(message)s")
out = Path(sys.argv[1])

class Recorder(L.LightningModule):
    def __init__(self, run, signal_at):
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.run, self.signal_at = run, signal_at
    def training_step(self, batch, batch_idx):
        indices = batch[0]
        with open(out / f"{self.run}{self.global_rank}.jsonl", "a") as f:
            f.write(json.dumps([self.current_epoch, batch_idx, indices.tolist()]) + "\\n")
        if self.global_rank == 0 and (self.current_epoch, batch_idx) == self.signal_at:
            os.kill(os.getpid(), signal.SIGUSR1)
        return self.layer(indices[:, None].float()).sum()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

class Requeued(Exception):
    pass

class EndAfterTheRequeue(L.Callback):
    def __init__(self, check):
        self.check = check
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.check.gave_up:
            raise Requeued

def fit(run, recipe, callbacks=(), signal_at=None, ckpt=None):
    images = ImageData(TensorDataset(torch.arange(40)), None, recipe, batch_size=2,
                       num_workers=1, prefetch_factor=2, pin_memory=False, seed=5)
    trainer = L.Trainer(accelerator="cpu", devices=1, num_nodes=2, strategy="ddp",
                        max_epochs=2, accumulate_grad_batches=2, callbacks=list(callbacks),
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    try:
        trainer.fit(Recorder(run, signal_at), datamodule=images, ckpt_path=ckpt)
    finally:
        print(run, "drew from", type(trainer.train_dataloader.sampler).__name__, flush=True)

for recipe in sys.argv[2:]:
    fit(f"{recipe}-whole", recipe)
    check = RequeueAtTimeLimit(out, every=3)
    try:
        fit(f"{recipe}-requeued", recipe, [check, EndAfterTheRequeue(check)], signal_at=(1, 1))
    except Requeued:
        requeue._requeue_asked = False  # the next start's signal is its own
    fit(f"{recipe}-resumed", recipe, ckpt=out / "last.ckpt")
"""
SCONTROL = """#!/bin/sh
echo "scontrol: error: Requeue of job not allowed" >&2
exit 1
"""
SAMPLERS = {"demo": "ResumableSampler", "torchvision_v2": "RepeatedAugSampler"}


def start_ranks(tmp_path: Path, *recipes: str) -> tuple[list[int], list[str]]:
    """Both ranks, to their end: their exit codes and outputs."""
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "SLURM_JOB_ID": "7",
           "SLURM_JOB_NAME": "train", "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "1",
           "SLURM_NNODES": "2", "SLURM_NODELIST": "localhost", "SLURM_LOCALID": "0",
           "MASTER_PORT": str(cpu_ranks.free_port())}
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, str(tmp_path), *recipes],
                              env={**env, "SLURM_PROCID": str(r), "SLURM_NODEID": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in (0, 1)]
    try:
        deadline = time.monotonic() + 300  # a bound on a hang: under CI's load starts are slow
        outputs = [rank.communicate(timeout=max(1.0, deadline - time.monotonic()))[0]
                   for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    return [rank.returncode for rank in ranks], outputs


def trained(tmp_path: Path, run: str, rank: int) -> list[list]:
    """[epoch, batch_idx, data set indices] of each batch `rank` trained on in `run`."""
    path = tmp_path / f"{run}{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow
def test_a_requeued_epoch_trains_on_what_an_uninterrupted_one_would(tmp_path):
    """2 gloo ranks with a fork-server loader worker each, through the DistributedSampler the
    training gives and through repeated augmentation's: what each rank trains on before Slurm's
    requeue and after the resume is, batch for batch, what it trains on uninterrupted. Before,
    the resumed epoch started its order over (and in epoch 0's order: Lightning makes the first
    iterator before it sets the sampler's epoch), training its first batches twice."""
    (tmp_path / "scontrol").write_text(SCONTROL)
    (tmp_path / "scontrol").chmod(0o755)
    codes, out = start_ranks(tmp_path, *SAMPLERS)
    assert codes == [0, 0], out
    assert out[0].count("Slurm's time limit is near: saved") == 2, out[0]
    for recipe, sampler in SAMPLERS.items():
        for rank in (0, 1):
            whole = trained(tmp_path, f"{recipe}-whole", rank)
            requeued = trained(tmp_path, f"{recipe}-requeued", rank)
            resumed = trained(tmp_path, f"{recipe}-resumed", rank)
            assert len(whole) == 20  # 2 epochs of 40 images / 2 ranks / batch 2
            assert requeued + resumed == whole, (recipe, rank, requeued, resumed, whole)
            assert requeued[-1][:2] == [1, 3]  # saved at the check after 2 groups of epoch 1
        # the sampler as the training gave it: Lightning put none of its own in its place
        assert out[1].count(f"{recipe}-") == out[1].count(f"drew from {sampler}") == 3, out[1]


class Counter(L.LightningModule):
    """A model of one weight on a data set of its indices, which records the batches it trains
    on and marks its checkpoints as a training of digest "d" (as ImageClassifier does)."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.seen: list[tuple[int, int, list[int]]] = []

    def training_step(self, batch, batch_idx):
        self.seen.append((self.current_epoch, batch_idx, batch[0].tolist()))
        return self.layer(batch[0][:, None].float()).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def on_save_checkpoint(self, checkpoint):
        checkpoint["imgclf"] = {"train_digest": "d"}


def fit_one_device(ckpt_dir: Path, ckpt_path=None, callbacks=(), **trainer) -> Counter:
    """2 epochs of 24 indices in batches of 2 on one CPU device, through ImageData."""
    images = ImageData(TensorDataset(torch.arange(24)), None, "demo", batch_size=2,
                       num_workers=0, prefetch_factor=None, pin_memory=False, seed=3)
    model = Counter()
    L.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_progress_bar=False,
              enable_checkpointing=False, enable_model_summary=False, default_root_dir=ckpt_dir,
              callbacks=list(callbacks), **trainer).fit(model, datamodule=images,
                                                        ckpt_path=ckpt_path)
    return model


def test_the_requeue_saves_between_accumulation_groups(tmp_path, monkeypatch, caplog):
    """Accumulating 3 batches per step, checked every 4 batches: the signal is acted on after
    batch 6, a whole group (2 steps), never after batch 4 with a third of a step's gradients
    accumulated, which no checkpoint holds."""
    (tmp_path / "scontrol").write_text("#!/bin/sh\necho 'Requeue of job not allowed' >&2\n"
                                       "exit 1\n")  # refused: the training goes on
    (tmp_path / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setattr(requeue, "_requeue_asked", True)  # Slurm's signal, before batch 1
    with caplog.at_level(logging.INFO, logger="imgclf.train"):
        fit_one_device(tmp_path, callbacks=[RequeueAtTimeLimit(tmp_path, every=4)],
                       accumulate_grad_batches=3)
    assert "could not requeue the job" in caplog.text
    ckpt = torch.load(tmp_path / "last.ckpt", map_location="cpu", weights_only=True)
    batches = ckpt["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]["processed"]
    assert (batches, ckpt["global_step"]) == (6, 2)


def test_a_checkpoint_without_the_loaders_position_resumes_from_the_epochs_start(tmp_path):
    """A checkpoint saved mid-epoch by an earlier version holds no loader position: it resumes
    as it did then (the rest of the epoch drawn from its start), and the resume decision says
    so; a current one resumes where it left off."""
    class Killed(Exception):
        pass

    class KilledAfter(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if (trainer.current_epoch, batch_idx) == (1, 4):
                trainer.save_checkpoint(tmp_path / "last.ckpt")
                raise Killed

    whole = fit_one_device(tmp_path / "whole").seen
    with pytest.raises(Killed):
        fit_one_device(tmp_path, callbacks=[KilledAfter()])
    assert "drawn from its start" not in resume.find_resume(tmp_path, "d")["note"]
    assert fit_one_device(tmp_path, ckpt_path=tmp_path / "last.ckpt").seen == whole[17:]

    ckpt = torch.load(tmp_path / "last.ckpt", map_location="cpu", weights_only=True)
    del ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"]  # as an earlier version's
    torch.save(ckpt, tmp_path / "last.ckpt")
    note = resume.find_resume(tmp_path, "d")["note"]
    assert note.startswith(f"resuming from {tmp_path / 'last.ckpt'} (epoch 2, step 17)"), note
    assert note.endswith("the rest of epoch 2 is drawn from its start again"), note
    again = fit_one_device(tmp_path, ckpt_path=tmp_path / "last.ckpt").seen
    assert again == [(1, 5 + i, batch) for i, (_, _, batch) in enumerate(whole[12:19])]


def test_the_training_sampler_deals_what_lightnings_would_and_skips_on_one_pass():
    """The sampler the training gives its loader deals each rank what the DistributedSampler
    Lightning added before would (its arguments: seed_everything's seed, shuffled), and a skip
    applies to the next pass only."""
    for rank in (0, 1):
        ours = sampling.ResumableSampler(range(50), num_replicas=2, rank=rank, shuffle=True, seed=7)
        theirs = DistributedSampler(range(50), num_replicas=2, rank=rank, shuffle=True, seed=7)
        for epoch in (0, 3):
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs)
        ours.skip(10)
        assert list(ours) == list(theirs)[10:] and list(ours) == list(theirs)


class IndexedNames(torch.utils.data.Dataset):
    """A split's files by name, indexed as datasets.IndexedImages indexes them (its file index,
    less the files left out), without decoding any."""

    def __init__(self, idx):
        self.index = idx

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> str:
        return self.index.line(i).split("\t")[0]


@pytest.mark.parametrize("repeated", [False, True], ids=["shuffled", "repeated augmentation"])
def test_a_resume_after_a_broken_file_was_left_out_keeps_the_epochs_order(repeated):
    """Two ranks in epoch 1 of 32 files, stopped after 3 batches of 2 each; a file of the rest
    of the epoch turned out broken, and the run resumes with it left out (datasets.train_dataset's
    `exclude`, from bad_files.txt): the resumed epoch trains on the rest of the order it began
    with, less that file (filled up from the epoch's first files, as DistributedSampler pads),
    each rank as many batches as before; not on a permutation of the 31 files drawn afresh,
    which would train some files twice and others never."""
    from imgclf import index

    names = [f"c/{i:02d}.jpg" for i in range(32)]
    split = index.Index.from_lines("train.tsv", "/data", "train", ["c"], [32],
                                   [index.file_line("c", n[2:], 1) for n in names], None)

    def rank_loaders(idx, states=(None, None)):
        made = []
        for rank, state in enumerate(states):
            files = IndexedNames(idx)
            sampler = (sampling.RepeatedAugSampler(files, 2, rank, seed=5, reps=2) if repeated else
                       sampling.ResumableSampler(files, num_replicas=2, rank=rank, shuffle=True,
                                                 seed=5))
            sampler.set_epoch(1)
            loader = loaders.loader(files, 2, 0, None, shuffle=True, sampler=sampler,
                                    resumable=True, drop_last=True)
            if state:
                loader.load_state_dict(state)
            made.append(loader)
        return made

    def dealt(per_rank):  # the ranks' files as one order, as the sampler deals it
        return [f for both in zip(*per_rank) for f in both]

    first = rank_loaders(split)
    epochs = [iter(loader) for loader in first]
    trained = [[f for _ in range(3) for f in next(epoch)] for epoch in epochs]
    states = [loader.state_dict() for loader in first]
    rest = [[f for batch in epoch for f in batch] for epoch in epochs]  # had it gone on
    broken = rest[1][2]
    resumed = rank_loaders(index.without(split, {f"/data/train/{broken}"}), states)
    after = [[f for batch in loader for f in batch] for loader in resumed]

    epoch = dealt(trained) + [f for f in dealt(rest) if f != broken]
    epoch += epoch[:len(dealt(trained) + dealt(rest)) - len(epoch)]
    assert dealt(after) == epoch[len(dealt(trained)):]
    assert [len(a) for a in after] == [len(r) for r in rest] == [10, 10]
    assert broken not in dealt(after)
    if not repeated:
        assert set(dealt(trained) + dealt(after)) == set(names) - {broken}
