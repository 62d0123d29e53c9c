"""The training and validation data sets: one split's file index through a decode path.

The loader benchmark, the memory solve, the LR finder and training all build their data
through imgclf.data, so what is measured is what trains."""

from __future__ import annotations

import os

import torch

from imgclf import decoding, index
from imgclf.census import walk
from imgclf.data.transforms import train_transform, val_transform
from imgclf.errors import UserError
from imgclf.settings import validate


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
