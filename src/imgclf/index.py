"""The file index of a data set: the files of one split that the hydration check found usable.

Written once by the check (results/hydration/{cluster}.{split}.tsv), read by every later stage
to build its data set, so no stage walks the tree again: on Lustre a walk of ImageNet's 1.33 M
files costs minutes of metadata calls, in every LR-finder run, every DDP rank and evaluation.
A file the check excluded is not in the index, so no later stage ever opens it.

Format: a JSON header line (format, root, split, classes, files per class), then one line per
file, `class/name<TAB>size`, grouped by class in class order. Reading it is one read and one
split: the line of a sample becomes a path only when the sample is loaded."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from imgclf.errors import UserError
from imgclf.provenance import atomic_path

FORMAT = "imgclf-index-1"
SPLITS = ("train", "val")
# Images found broken during training (changed after the check), one path a line, in the
# training's folder: left out of every later attempt and of evaluation, so the next run resumes
# instead of failing on the same file again.
BAD_FILES = "bad_files.txt"


def index_path(cluster: str, split: str) -> str:
    return f"results/hydration/{cluster}.{split}.tsv"


def write(path, root: str, split: str, classes: list[str], files: dict[str, list]) -> None:
    """`files`: class -> [(name, size), ...]; written sorted by class, then name."""
    counts = [len(files.get(c, ())) for c in classes]
    header = {"format": FORMAT, "root": str(root), "split": split, "classes": classes,
              "counts": counts}
    with atomic_path(path) as tmp, open(tmp, "w") as f:
        f.write(json.dumps(header) + "\n")
        for c in classes:
            f.writelines(f"{c}/{name}\t{size}\n" for name, size in sorted(files.get(c, ())))


@dataclass
class Index:
    """One split's usable files: `classes`, per-class `counts`, and the file lines as one
    buffer with the offset where each line starts (1.28 M Python strings would take longer to
    make than the whole read; a line becomes a path only when its sample is loaded)."""

    path: str
    root: str
    split: str
    classes: list[str]
    counts: list[int]
    body: bytes
    starts: "np.ndarray"  # offset of each line in `body`, and one past the last line's end

    @classmethod
    def from_lines(cls, path, root, split, classes, counts, lines: list[str]) -> "Index":
        import numpy as np

        body = "".join(f"{line}\n" for line in lines).encode()
        return cls(path=str(path), root=str(root), split=split, classes=classes, counts=counts,
                   body=body, starts=_line_starts(body, np))

    def __len__(self) -> int:
        return len(self.starts) - 1

    def line(self, i: int) -> str:
        return self.body[self.starts[i]:self.starts[i + 1] - 1].decode()

    def file(self, i: int) -> str:
        return os.path.join(self.root, self.split, self.line(i).rsplit("\t", 1)[0])

    def targets(self):
        """The class of every file, in order (a NumPy array: 1.28 M Python ints cost more)."""
        import numpy as np

        return np.repeat(np.arange(len(self.counts)), self.counts)


def _line_starts(body: bytes, np):
    ends = np.flatnonzero(np.frombuffer(body, dtype=np.uint8) == ord("\n"))
    return np.concatenate(([0], ends + 1))


def read(path) -> Index:
    """An index written by the hydration check; a missing or foreign file is a user error."""
    import numpy as np

    try:
        with open(path, "rb") as f:
            head, body = f.readline(), f.read()
    except FileNotFoundError:
        raise UserError(f"File index {path} does not exist: run the hydration check first "
                        f"(`snakemake {str(path).rsplit('.', 2)[0]}.json`).") from None
    try:
        header = json.loads(head)
    except ValueError:
        header = {}
    if header.get("format") != FORMAT:
        raise UserError(f"{path} is not a file index of this version: rerun the hydration check "
                        f"(`snakemake --forcerun check_hydration`).")
    starts = _line_starts(body, np)
    if len(starts) - 1 != sum(header["counts"]) or (body and not body.endswith(b"\n")):
        raise UserError(f"File index {path} is incomplete ({len(starts) - 1} of "
                        f"{sum(header['counts'])} files): rerun the hydration check.")
    return Index(path=str(path), root=header["root"], split=header["split"],
                 classes=header["classes"], counts=header["counts"], body=body, starts=starts)


def read_bad_files(path) -> set[str]:
    try:
        with open(path) as f:
            return {line for line in f.read().splitlines() if line}
    except FileNotFoundError:
        return set()


def without(index: Index, bad: set[str]) -> Index:
    """The index less the files in `bad` (paths as the index makes them), e.g. files found
    broken in training."""
    if not bad:
        return index
    kept, counts, i = [], [], 0
    for n in index.counts:
        lines = [index.line(j) for j in range(i, i + n) if index.file(j) not in bad]
        kept += lines
        counts.append(len(lines))
        i += n
    return Index.from_lines(index.path, index.root, index.split, index.classes, counts, kept)
