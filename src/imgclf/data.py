"""The training and validation input pipelines, in two real decode paths.

`pil`: PIL decode + torchvision transforms v2 on PIL images (the classic pipeline).
`tensor`: torchvision.io.decode_jpeg (libjpeg-turbo) for JPEG, PIL for other formats, +
transforms.v2 on uint8 tensors. Both decode by one contract (imgclf.decoding).
The loader benchmark, the memory solve, the LR finder and training all build their
data through this module, so what is measured is what trains."""

from __future__ import annotations

import contextlib
import os

import torch
from torch.utils.data import DataLoader

from imgclf import decoding, index, recipes
from imgclf.errors import UserError
from imgclf.census import walk
from imgclf.artifacts import DECODERS
from imgclf.settings import validate
# the training's samplers and its loader that resumes mid-epoch (data.loader makes one)
from imgclf.sampling import RepeatedAugSampler, ResumableLoader, ResumableSampler  # noqa: F401
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
MEAN_FILL = tuple(round(255 * m) for m in MEAN)  # uint8 fill of geometric augmentations


def _pixels(decoder: str) -> list:
    """The decode path's tail: PIL images become uint8 tensors here (the `pil` path augments on
    PIL images, as torchvision's reference does), then both paths scale and normalise."""
    from torchvision.transforms import v2

    if decoder not in DECODERS:
        raise UserError(f"Unknown decode path {decoder!r}: choose one of {', '.join(DECODERS)}.")
    return ([v2.PILToTensor()] if decoder == "pil" else []) + [
        v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)]


def auto_augment(recipe):
    """The recipe's automatic augmentation (torchvision transforms v2), or None. Its rotations
    and shears interpolate bilinearly, whatever the recipe's resize interpolation: uint8
    tensors support only nearest and bilinear there (torchvision's reference passes bilinear)."""
    from torchvision.transforms import v2

    interpolation = v2.InterpolationMode.BILINEAR
    if recipe.auto_augment == "trivialaugment":
        return v2.TrivialAugmentWide(interpolation=interpolation)
    if recipe.auto_augment == "randaugment-m7":
        # timm's rand-m7 is magnitude 7 on a 0..10 scale: torchvision's magnitude indexes
        # linspace(0, max, num_magnitude_bins), so 11 bins put 7 at 0.7 of each op's maximum
        # (the default 31 bins would make it 7/30). timm fills with the mean pixel.
        return v2.RandAugment(num_ops=2, magnitude=7, num_magnitude_bins=11,
                              interpolation=interpolation, fill=MEAN_FILL)
    return None


def train_transform(decoder: str, resolution: int, recipe):
    """RandomResizedCrop at the recipe's train size, flip, its auto augmentation, then tensor,
    normalisation and its RandomErasing: one transforms-v2 pipeline for both decode paths."""
    from torchvision.transforms import v2

    ops = [v2.RandomResizedCrop(recipe.train_size(resolution), scale=(recipe.crop_scale_min, 1.0),
                                interpolation=v2.InterpolationMode(recipe.interpolation),
                                antialias=True),
           v2.RandomHorizontalFlip(recipe.hflip)]
    augment = auto_augment(recipe)
    if augment is not None:
        ops.append(augment)
    ops += _pixels(decoder)
    if recipe.random_erase > 0:
        ops.append(v2.RandomErasing(p=recipe.random_erase))
    return v2.Compose(ops)


def val_transform(decoder: str, resolution: int, recipe=None):
    """Resize the shorter side and center-crop `resolution`: the recipe's val_sizes, or without
    a recipe the classic crop of 87.5 %."""
    from torchvision.transforms import v2

    if recipe is None:
        (resize, crop), interpolation = recipes.val_sizes(resolution), "bilinear"
    else:
        (resize, crop), interpolation = recipe.val_sizes(resolution), recipe.interpolation
    return v2.Compose([v2.Resize(resize, interpolation=v2.InterpolationMode(interpolation),
                                 antialias=True),
                       v2.CenterCrop(crop), *_pixels(decoder)])


class BadImageError(UserError):
    """An indexed image that no longer decodes: changed or broken after the hydration check.
    One line, `Cannot decode image PATH (REASON)`: PATH escaped as in the file index (no line
    break in it) and REASON without parentheses, so the last " (" ends PATH whatever it holds."""

    PREFIX = "Cannot decode image "

    @classmethod
    def of(cls, path: str, err: Exception) -> "BadImageError":
        """The error for the file at `path`, which its decoder failed on with `err`."""
        text = str(err).splitlines()[0] if str(err) else ""
        reason = f"{type(err).__name__}: {text}".translate(str.maketrans("()", "[]"))
        return cls(f"{cls.PREFIX}{index.escape(path)} ({reason})")

    @classmethod
    def own_line(cls, err: Exception) -> str:
        """`Cannot decode image PATH (REASON)`, also out of the message a DataLoader worker's
        error is re-raised with (the worker's traceback, with this line in it)."""
        line = next(ln for ln in str(err).splitlines() if cls.PREFIX in ln)
        return line[line.index(cls.PREFIX):]

    @classmethod
    def file_and_reason(cls, err: Exception) -> tuple[str, str]:
        """(PATH as escaped, REASON) of the error's own line."""
        shown, _, reason = cls.own_line(err)[len(cls.PREFIX):].rpartition(" (")
        return shown, reason.removesuffix(")")


class IndexedImages(torch.utils.data.Dataset):
    """The images of one split's file index (imgclf.index) through a decode path: built from
    the index the hydration check wrote, so it neither walks the tree nor opens an excluded
    file, and decodes under the pixel limit the check applied (in whichever process loads). A
    file that fails to decode raises BadImageError naming it."""

    def __init__(self, idx: index.Index, decoder: str, transform):
        self.index, self.transform = idx, transform
        self.decode = decoding.reader(decoder)
        self.classes = list(idx.classes)
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        self.targets = idx.targets()

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int):
        path = self.index.file(i)
        try:
            image = self.decode(path, self.index.max_image_pixels)
        except (OSError, RuntimeError, ValueError, SyntaxError) as e:  # TooLarge: a ValueError
            raise BadImageError.of(path, e) from None
        return self.transform(image), int(self.targets[i])


def split_index(source, split: str) -> index.Index:
    """A split's file index: `source` is the index file the hydration check wrote (what every
    stage gets) or, for one-off use and tests, a data root, walked here."""
    if not os.path.isdir(source):
        return index.read(source)
    cen = walk(str(source))
    classes = cen.classes(split)
    lines = [index.file_line(c, n, s) for c in classes for n, s in sorted(cen.files[split][c])]
    return index.Index.from_lines(source, source, split, classes,
                                  [len(cen.files[split][c]) for c in classes], lines,
                                  validate({}, "hydration")["max_image_pixels"])  # no check ran


def train_dataset(source, decoder: str, resolution: int, recipe,
                  exclude: set[str] = frozenset()) -> IndexedImages:
    """Training images at the recipe's train size (`recipe.train_size(resolution)`), less the
    files in `exclude` (found broken during an earlier training attempt)."""
    idx = index.without(split_index(source, "train"), set(exclude))
    return IndexedImages(idx, decoder, train_transform(decoder, resolution, recipe))


def val_dataset(source, decoder: str, resolution: int, recipe=None,
                exclude: set[str] = frozenset()) -> IndexedImages:
    """Validation images at `resolution`, resized as the recipe says (None: crop 87.5 %)."""
    idx = index.without(split_index(source, "val"), set(exclude))
    return IndexedImages(idx, decoder, val_transform(decoder, resolution, recipe))


def loader(dataset, batch_size: int, num_workers: int, prefetch_factor: int | None,
           shuffle: bool, seed: int = 0, pin_memory: bool = False, drop_last: bool = False,
           persistent_workers: bool = False, sampler=None, worker_init_fn=None,
           forkserver_preload: tuple[str, ...] | None = None,
           resumable: bool = False) -> DataLoader:
    """A DataLoader whose shuffling order depends only on `seed`. `forkserver_preload`: None,
    its workers are forks of this process; else they start from a fork server
    (forkserver_context) that imported this module and those named, for a process that runs
    threads of its own. `resumable`: a ResumableLoader, whose `sampler` is a ResumableSampler."""
    generator = torch.Generator().manual_seed(seed)
    workers = num_workers > 0
    forkserver = forkserver_preload is not None and workers
    if forkserver:
        worker_init_fn = ExitWithProcess(os.getpid(), then=worker_init_fn)
    return (ResumableLoader if resumable else DataLoader)(
        dataset, batch_size=batch_size, shuffle=shuffle if sampler is None else False,
        sampler=sampler, num_workers=num_workers,
        prefetch_factor=prefetch_factor if workers else None,
        persistent_workers=persistent_workers and workers,
        pin_memory=pin_memory, drop_last=drop_last, generator=generator,
        multiprocessing_context=forkserver_context(forkserver_preload) if forkserver else None,
        worker_init_fn=worker_init_fn,
    )


# what a worker imports to decode and transform (lazily here, for the processes that never load)
DECODE_MODULES = ("PIL.Image", "torchvision.io", "torchvision.transforms.v2")


def forkserver_context(preload=()):
    """Workers for a training rank, which runs threads of its own. Under Python 3.11 a fork
    taken while another thread holds the interpreter's thread-state lock leaves the child
    waiting for it forever in PyOS_AfterFork_Child (CPython gh-112275, fixed in 3.12): a rank's
    loader worker hung that way while its peer waited in an all-reduce. A fork server is a
    single-threaded process that has imported this module and the decoders once; a worker
    forked from it starts in a fraction of a second and shares those pages as a worker forked
    from the rank would, where a spawned worker imports torch again (their memory:
    docs/training.md), though it gets the data set pickled rather than shared."""
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__, *DECODE_MODULES, *preload])
    start_forkserver()
    return ctx


def start_forkserver() -> None:
    """Start the fork server (and the resource tracker it starts first) now, if it is not
    running, with the signals this process only notes (noted_signals) blocked. Python starts
    both with exec, which resets a handled signal to its default action, and the default
    action of these ends a process: Slurm's requeue signal, sent to every process of the job
    step, would end the server and every worker, and the rank's next batch would fail. A
    blocked signal stays blocked across exec and fork, so the server, the tracker and each
    worker forked from the server never act on it; one that reaches this process meanwhile is
    delivered once the mask is restored."""
    import multiprocessing.forkserver

    with noted_signals_blocked():
        multiprocessing.forkserver.ensure_running()


def noted_signals() -> set:
    """The user signals this process handles in Python (Slurm's requeue signal in a training
    rank, slurm.requeue.catch_requeue_signal): the helpers it starts must not die from them."""
    import signal

    return {s for s in (signal.SIGUSR1, signal.SIGUSR2) if callable(signal.getsignal(s))}


@contextlib.contextmanager
def noted_signals_blocked():
    """This thread with the noted signals blocked, to start helper processes in: exec gives a
    helper their default action, which ends it, but keeps the mask, as does every process it
    forks or execs in turn (a thread this one starts meanwhile keeps it too, for good). One
    that reaches this process meanwhile goes to another thread or waits for the restored mask."""
    import signal

    old = signal.pthread_sigmask(signal.SIG_BLOCK, noted_signals())
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class ExitWithProcess:
    """A fork-server worker's worker_init_fn: it ends the worker when the process that made
    the loader has ended, or had already by the time the worker started. torch's workers watch
    their parent, which here is the server, and the server lives while its workers do, so a
    killed rank would leave both running for good. `then`: the worker_init_fn this one wraps."""

    def __init__(self, pid: int, then=None):
        import psutil

        self.pid, self.then = pid, then
        self.started = psutil.Process(pid).create_time()  # with the pid: never a later process

    def __call__(self, worker_id: int) -> None:
        import threading

        if not self._owner_alive():
            os._exit(1)
        threading.Thread(target=self._exit_after_owner, daemon=True).start()
        if self.then is not None:
            self.then(worker_id)

    def _owner_alive(self) -> bool:
        import psutil

        try:
            owner = psutil.Process(self.pid)
            return owner.create_time() == self.started and owner.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def _exit_after_owner(self) -> None:
        import time

        while self._owner_alive():
            time.sleep(1)
        os._exit(1)


def batch_mixer(recipe, num_classes: int):
    """MixUp/CutMix on whole batches (torchvision transforms v2), or None if the recipe has none."""
    from torchvision.transforms import v2

    mixers = []
    if recipe.mixup_alpha > 0:
        mixers.append(v2.MixUp(alpha=recipe.mixup_alpha, num_classes=num_classes))
    if recipe.cutmix_alpha > 0:
        mixers.append(v2.CutMix(alpha=recipe.cutmix_alpha, num_classes=num_classes))
    if not mixers:
        return None
    return mixers[0] if len(mixers) == 1 else v2.RandomChoice(mixers)


def sample_batch_bytes(batch_size: int, resolution: int) -> int:
    """Bytes of one collated float32 batch of images (what a worker holds per prefetched batch)."""
    return batch_size * 3 * resolution * resolution * 4
