"""The training's samplers, and its loader that takes up an epoch part way, on every rank (a
training resumed mid-epoch: after Slurm's requeue, a stop, or a file found broken).

A resume after a broken file was left out (datasets.train_dataset's `exclude`, from the run's
bad_files.txt) keeps the epoch's order: the data set has one file fewer, so a sampler drawn
afresh would deal another permutation, and the rest of the epoch would train some files twice
and others never. The loader's state records where, in the split's file index, the files left
out at the epoch's start were; the resumed sampler deals the order the epoch began with, less
the files left out since."""

from __future__ import annotations

import itertools

import numpy as np
from torch.utils.data import DataLoader, DistributedSampler


def left_out(dataset) -> list[int]:
    """Where, in its split's file index, the files `dataset` leaves out are (imgclf.index:
    Index.left_out); none for a data set not built from a file index."""
    return [int(i) for i in getattr(getattr(dataset, "index", None), "left_out", ())]


class ResumableLoader(DataLoader):
    """A training loader that takes up an epoch where a checkpoint left it, on every rank.

    Lightning stores the state_dict() of a training loader that has one in the checkpoint
    (loops/fit_loop.py, on_save_checkpoint) and, resuming an unfinished epoch, gives it to
    load_state_dict() before it makes the epoch's iterator (setup_data); it restores its own
    batch count, so batch_idx goes on from there (loops/training_epoch_loop.py, reset). The
    state is the epoch, the batches handed out in it and the files left out at its start; the
    resumed iterator has the sampler (a ResumableSampler) begin that many batches into the
    order the epoch began with, so the rest of the epoch is what an uninterrupted one would
    draw, none again and none left out but the files left out since (a save counts the batches
    Lightning took: with a length known it fetches no batch ahead, loops/fetchers.py). A state
    of another epoch than the one resumed is not applied; one without the files left out (an
    earlier version's) is taken as leaving out what the data set leaves out now.

    The iterator starts at the first batch asked for, not at iter(): Lightning makes a run's
    first iterator before it sets the sampler's epoch (fit_loop.py, setup_data, then
    on_advance_start), and with workers the sampler is drawn at once, so a resumed run's first
    epoch would be drawn in epoch 0's order."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._epoch, self._handed, self._resume = 0, 0, None
        self._left_out = left_out(self.dataset)

    def __iter__(self):
        return self._batches()

    def _batches(self):
        resume, self._resume = self._resume, None
        self._epoch = self.sampler.epoch
        now = left_out(self.dataset)
        same = bool(resume) and resume["epoch"] == self._epoch
        self._handed = resume["batches"] if same else 0
        self._left_out = list(resume.get("left_out", now)) if same else now
        self.sampler.skip(self._handed * self.batch_size, self._left_out)
        for batch in super().__iter__():
            self._handed += 1
            yield batch

    def state_dict(self) -> dict:
        return {"epoch": self._epoch, "batches": self._handed, "left_out": self._left_out}

    def load_state_dict(self, state_dict: dict) -> None:
        self._resume = dict(state_dict)


class ResumableSampler(DistributedSampler):
    """A DistributedSampler whose next pass can begin part way into its epoch's order (a
    training resumed mid-epoch: ResumableLoader). The training gives it with the arguments
    Lightning would give the one it adds (train.module.ImageData), so the order is the same;
    Lightning uses a DistributedSampler as it is."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._skip, self._began_without = 0, None

    def skip(self, samples: int, began_without: list[int] | None = None) -> None:
        """Begin the next pass `samples` indices into this epoch's order (that pass only): the
        order it began with when the data set then left out the files at `began_without`
        (positions in its file index) and now leaves out more."""
        self._skip, self._began_without = samples, began_without

    def __iter__(self):
        skip, self._skip = self._skip, 0
        began_without, self._began_without = self._began_without, None
        now = left_out(self.dataset)
        order = self.order() if began_without is None or sorted(began_without) == now \
            else self._order_begun(began_without, now)
        return itertools.islice(order, skip, None)

    def order(self):
        """This rank's indices of the epoch, from its start."""
        return super().__iter__()

    def like(self, size: int, rank: int) -> "ResumableSampler":
        """This sampler of rank `rank` over a data set of `size` samples (all its order
        depends on)."""
        return ResumableSampler(range(size), num_replicas=self.num_replicas, rank=rank,
                                shuffle=self.shuffle, seed=self.seed, drop_last=self.drop_last)

    def _order_begun(self, began_without: list[int], now: list[int]):
        """This rank's indices of the epoch, in the order it began with, when the data set left
        out the files at `began_without` and not yet those at `now`: every rank's order of that
        data set, dealt back into one (each rank takes every num_replicas-th), as positions in
        the file index, less the files left out since, as indices of the data set now; filled
        up to this epoch's length by repeating from its start, as DistributedSampler pads,
        and dealt again. Every rank so has as many batches as it has now, and the first ones,
        which the epoch had trained on before the files were left out, are what they were."""
        files = len(self.dataset) + len(now)
        began = np.delete(np.arange(files), began_without)
        index_now = np.full(files, -1)
        index_now[np.delete(np.arange(files), now)] = np.arange(len(self.dataset))
        ranks = []
        for rank in range(self.num_replicas):
            sampler = self.like(len(began), rank)
            sampler.set_epoch(self.epoch)
            ranks.append(list(sampler.order()))
        dealt = index_now[began[np.array(ranks, dtype=np.int64).T.reshape(-1)]]
        dealt = np.resize(dealt[dealt >= 0], len(self) * self.num_replicas)
        return iter(dealt[self.rank::self.num_replicas].tolist())


class RepeatedAugSampler(ResumableSampler):
    """Repeated augmentation (Hoffer et al. 2020; DeiT's RASampler, torchvision's
    references/classification/sampler.py): each epoch draws a shuffled prefix of the data set
    with every image repeated `reps` times in a row, dealt round-robin to the ranks, so the
    copies of an image land on different ranks (when reps <= world) and are augmented
    differently; an epoch stays ceil(len(dataset) / num_replicas) images per rank, i.e. about
    len(dataset) / reps distinct images per epoch.

    The sampling is timm's maintained `timm.data.distributed_sampler.RepeatAugSampler`, with
    `selected_round=0` (timm and torchvision round the data set down to a multiple of 256
    first, which drops 232 of a 1,000-image set) and its epoch seed offset by `seed`. It is
    a DistributedSampler so that Lightning uses it as it is instead of wrapping it in a
    DistributedSamplerWrapper; Lightning calls `set_epoch` every epoch. A ResumableSampler,
    for a training resumed mid-epoch."""

    def __init__(self, dataset, num_replicas: int, rank: int, shuffle: bool = True,
                 seed: int = 0, reps: int = 3):
        from timm.data.distributed_sampler import RepeatAugSampler

        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle,
                         seed=seed, drop_last=False)
        if int(reps) < 1:
            raise ValueError(f"reps is {reps}: at least 1 copy of each image")
        self.reps = int(reps)
        self._sampler = RepeatAugSampler(dataset, num_replicas=num_replicas, rank=rank,
                                         shuffle=shuffle, num_repeats=self.reps,
                                         selected_round=0)
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self._sampler.set_epoch(self.seed + epoch)

    def order(self):
        return iter(self._sampler)

    def like(self, size: int, rank: int) -> "RepeatedAugSampler":
        return RepeatedAugSampler(range(size), self.num_replicas, rank, shuffle=self.shuffle,
                                  seed=self.seed, reps=self.reps)

    def __len__(self) -> int:
        return len(self._sampler)
