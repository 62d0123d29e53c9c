"""The census of a data root: every file of train/ and val/ with one `stat` each, sorted into
images per class, hidden and metadata entries, files that are not images, zero-byte and
unreadable files, and folder problems. The hydration check counts it, and a stage given a data
root instead of the check's file index walks it (data.datasets.split_index).

Nothing here reads file contents: on Lustre, reading a released file is what triggers its slow
restore from S3, so the census (and the HSM query after it) must come first."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field

from imgclf.index import escape
from imgclf.progress import progress

SPLITS = ("train", "val")
# the suffixes torchvision's ImageFolder takes as images
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
# What operating systems and tools leave beside the data, by name (lower case), whatever the
# suffix: a data set copied from a Mac has an AppleDouble `._NAME.jpg` beside every image, which
# is no image and must count neither as a bad image nor as a class.
METADATA_NAMES = {
    ".ds_store": "macOS folder settings",
    "__macosx": "macOS metadata folder of a zip archive",
    "thumbs.db": "Windows thumbnail cache",
    "desktop.ini": "Windows folder settings",
}


@dataclass
class Census:
    """What the walk found. `files[split][class]` lists (name, size) of the image files,
    `name` relative to the class folder."""

    root: str
    files: dict = field(default_factory=lambda: {s: {} for s in SPLITS})
    hidden: list = field(default_factory=list)          # (path, reason): listed, not walked
    not_images: list = field(default_factory=list)      # (path, reason): listed, ignored
    bad: dict = field(default_factory=dict)              # path -> reason: zero-byte, unreadable
    folder_problems: list = field(default_factory=list)  # sentences naming a folder

    def classes(self, split: str) -> list[str]:
        return sorted(self.files[split])

    def images(self, split: str | None = None) -> int:
        splits = SPLITS if split is None else (split,)
        return sum(len(v) for s in splits for v in self.files[s].values())

    def paths(self):
        """Every image file as (split, class, name, absolute path)."""
        for split in SPLITS:
            for cls, entries in sorted(self.files[split].items()):
                for name, _ in entries:
                    yield split, cls, name, os.path.join(self.root, split, cls, name)

    def sample(self, k: int, seed: int) -> list[tuple[str, int]]:
        """(path, size) of `k` images drawn at random, in one pass (no list of every file)."""
        n, rng = self.images(), random.Random(seed)
        picked = set(rng.sample(range(n), min(k, n)))
        out, i = [], 0
        for split in SPLITS:
            for cls, entries in sorted(self.files[split].items()):
                for name, size in entries:
                    if i in picked:
                        out.append((os.path.join(self.root, split, cls, name), size))
                    i += 1
        rng.shuffle(out)  # read in random order: a byte budget must not favour early classes
        return out

    def summary(self) -> dict:
        """Files, bytes and classes per split and class (the report's census block)."""
        out = {"splits": {}}
        for split in SPLITS:
            per_class = {c: {"files": len(v), "bytes": sum(s for _, s in v)}
                         for c, v in sorted(self.files[split].items())}
            out["splits"][split] = {
                "files": sum(c["files"] for c in per_class.values()),
                "bytes": sum(c["bytes"] for c in per_class.values()),
                "classes": len(per_class), "per_class": per_class}
        out["not_images"] = len(self.not_images)
        out["hidden"] = len(self.hidden)
        return out


def hidden_reason(name: str, is_dir: bool) -> str | None:
    """Why a file or folder named `name` is hidden or metadata, or None when it is neither."""
    why = METADATA_NAMES.get(name.lower())
    if why is None and name.startswith("._"):
        why = "macOS metadata (AppleDouble) file"
    elif why is None and name.startswith("."):
        why = "hidden (the name starts with '.')"
    if why is None:
        return None
    return f"ignored: {why}{', folder not read' if is_dir else ''}"


def _visible(census: Census, folder: str) -> list:
    """The entries of `folder`, sorted, less hidden and metadata ones (listed in the census)."""
    with os.scandir(folder) as it:
        entries = sorted(it, key=lambda e: e.name)
    shown = []
    for e in entries:
        why = hidden_reason(e.name, e.is_dir())
        if why:
            census.hidden.append((e.path, why))
        else:
            shown.append(e)
    return shown


def _walk(census: Census, folder: str, prefix: str = ""):
    """(name relative to `folder`, DirEntry) of every visible file below it, depth first,
    sorted."""
    for e in _visible(census, folder):
        if e.is_dir():
            yield from _walk(census, e.path, f"{prefix}{e.name}/")
        else:
            yield f"{prefix}{e.name}", e


def take(census: Census, split: str, cls: str, name: str, entry) -> int:
    """File one DirEntry into the census; return its size (0 when it could not be stat'ed)."""
    path = entry.path
    if not name.lower().endswith(IMAGE_SUFFIXES):
        census.not_images.append((path, "not an image file (by its suffix)"))
        return 0
    try:
        size = entry.stat().st_size  # the one stat of this file
    except OSError as e:  # a broken link, a file gone or forbidden meanwhile
        census.bad[path] = f"unreadable: {e.strerror or type(e).__name__}"
        return 0
    if size == 0:
        census.bad[path] = "zero bytes"
    else:
        census.files[split][cls].append((name, size))
    return size


def walk(root: str) -> Census:
    """Census of root/train and root/val, with a progress display per class folder."""
    census = Census(root=str(root))
    for split in SPLITS:
        base = os.path.join(root, split)
        if not os.path.isdir(base):
            census.folder_problems.append(
                f"{base} does not exist: set `dataset.root` to the folder that holds "
                f"train/<class>/ and val/<class>/")
            continue
        top = _visible(census, base)
        for e in top:
            if not e.is_dir():
                census.not_images.append((e.path, "not in a class folder"))
        classes = [e for e in top if e.is_dir()]
        for e in progress(classes, desc=f"census {split}", unit="class"):
            census.files[split][e.name] = []
            for name, entry in _walk(census, e.path):
                take(census, split, e.name, name, entry)
    return census


def folder_problems(census: Census) -> list[str]:
    """Empty class folders and classes present in one split only, as sentences."""
    problems = list(census.folder_problems)
    if problems:
        return problems
    for split in SPLITS:
        for cls, entries in sorted(census.files[split].items()):
            if not entries:
                folder = escape(os.path.join(census.root, split, cls))
                problems.append(f"class folder {folder} holds no usable image: put the "
                                f"class's images in it, or remove it")
    train, val = set(census.files["train"]), set(census.files["val"])
    for cls in sorted(train ^ val):
        have, lack = ("train", "val") if cls in train else ("val", "train")
        problems.append(f"class '{escape(cls)}' is in {have}/ but not in {lack}/ "
                        f"({escape(os.path.join(census.root, lack, cls))} is missing): add that "
                        f"folder with the class's images, or remove "
                        f"{escape(os.path.join(census.root, have, cls))}")
    return problems


def drop(census: Census, bad: dict[str, str]) -> None:
    """Remove the files in `bad` (found unreadable or corrupt) from the census's images."""
    census.bad.update(bad)
    by_class: dict[tuple[str, str], set[str]] = {}
    for path in bad:
        split, cls, name = os.path.relpath(path, census.root).split(os.sep, 2)
        by_class.setdefault((split, cls), set()).add(name)
    for (split, cls), names in by_class.items():
        entries = census.files.get(split, {}).get(cls)
        if entries is not None:
            census.files[split][cls] = [(n, s) for n, s in entries if n not in names]
