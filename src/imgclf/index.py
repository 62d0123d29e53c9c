r"""The file index of a data set: the files of one split that the hydration check found usable.

Written once by the check (results/hydration/{cluster}.{split}.tsv), read by every later stage
to build its data set, so no stage walks the tree again: on Lustre a walk of ImageNet's 1.33 M
files costs minutes of metadata calls, in every LR-finder run, every DDP rank and evaluation.
A file the check excluded is not in the index, so no later stage ever opens it.

Format (`imgclf-index-2`): a JSON header line (format, root, split, classes, files per class,
and `max_image_pixels`, the pixel limit the check applied, which every decoder of a later stage
applies too), then one line per file, `class/name<TAB>size`, grouped by class in class order.
Reading it is one read and one split: the line of a sample becomes a path only when the sample
is loaded.

Names: a file name may hold any byte but `/` and NUL, and need not be UTF-8. A name is written
as its bytes read as UTF-8, with two escapes (`escape`): a backslash is written `\\`, and
`\xHH` stands for the byte HH where the byte is not part of valid UTF-8 or is part of a
character that ends or breaks a line for some reader (the ASCII controls 0x00-0x1F and 0x7F,
tab, newline and carriage return among them, and U+0085, U+2028, U+2029). Every other character
stands for itself, so ordinary names read as they are, and a line is always one file. The same
escaped form names a file everywhere the pipeline writes one (the excluded list, the check's
report and findings, `bad_files.txt`, sentences and log lines). In Python, a name is the str
that `os.scandir` gives on Linux: the bytes decoded as UTF-8 with surrogate escapes."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, replace

from imgclf import layout
from imgclf.errors import UserError
from imgclf.provenance import atomic_path

FORMAT = "imgclf-index-2"
SPLITS = ("train", "val")
# Images found broken during training (changed after the check), one escaped path a line, in the
# training's folder: left out of every later attempt and of evaluation, so the next run resumes
# instead of failing on the same file again.
BAD_FILES = "bad_files.txt"


# what `escape` writes as \xHH: surrogate escapes (bytes that are not valid UTF-8), the ASCII
# controls, and the characters that some readers take for a line break
_UNSAFE = re.compile("[\\\\\x00-\x1f\x7f\x85\u2028\u2029\udc80-\udcff]")
_ESCAPED = re.compile(rb"\\(\\|x[0-9a-f]{2})")


def _escape_one(match) -> str:
    char = match.group()
    if char == "\\":
        return "\\\\"
    return "".join(f"\\x{b:02x}" for b in char.encode("utf-8", "surrogateescape"))


def escape(name: str) -> str:
    """A file name (or path) as one line of UTF-8 text; `unescape` gives it back."""
    return _UNSAFE.sub(_escape_one, name)


def _unescape_one(match) -> bytes:
    code = match.group(1)
    return b"\\" if code == b"\\" else bytes([int(code[1:], 16)])


def unescape(text: str) -> str:
    """The name `escape` wrote as `text`."""
    if "\\" not in text:
        return text
    raw = _ESCAPED.sub(_unescape_one, text.encode("utf-8", "surrogateescape"))
    return raw.decode("utf-8", "surrogateescape")


def index_path(cluster: str, split: str) -> str:
    return layout.split_index(cluster, split)


def file_line(cls: str, name: str, size: int) -> str:
    """The line of one file, without its newline."""
    return f"{escape(f'{cls}/{name}')}\t{size}"


def write(path, root: str, split: str, classes: list[str], files: dict[str, list], *,
          max_image_pixels: int | None) -> None:
    """`files`: class -> [(name, size), ...]; written sorted by class, then name.
    `max_image_pixels`: the limit the check applied (None: none), for every later decoder."""
    counts = [len(files.get(c, ())) for c in classes]
    header = {"format": FORMAT, "root": str(root), "split": split, "classes": classes,
              "counts": counts, "max_image_pixels": max_image_pixels}
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(header) + "\n")
        for c in classes:
            f.writelines(f"{file_line(c, n, size)}\n" for n, size in sorted(files.get(c, ())))


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
    max_image_pixels: int | None
    body: bytes
    starts: "np.ndarray"  # offset of each line in `body`, and one past the last line's end
    # where the files `without` left out were in the index as written (sorted): what a training
    # resumed mid-epoch keeps its epoch's order by (imgclf.sampling)
    left_out: tuple[int, ...] = ()

    @classmethod
    def from_lines(cls, path, root, split, classes, counts, lines: list[str],
                   max_image_pixels: int | None) -> "Index":
        """From `file_line` lines."""
        import numpy as np

        body = "".join(f"{line}\n" for line in lines).encode()
        return cls(path=str(path), root=str(root), split=split, classes=classes, counts=counts,
                   max_image_pixels=max_image_pixels, body=body, starts=_line_starts(body, np))

    def __len__(self) -> int:
        return len(self.starts) - 1

    def line(self, i: int) -> str:
        return self.body[self.starts[i]:self.starts[i + 1] - 1].decode()

    def file(self, i: int) -> str:
        return os.path.join(self.root, self.split, unescape(self.line(i).rsplit("\t", 1)[0]))

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
                        f"(`snakemake {str(path).rsplit('.', 2)[0]}.json --forcerun "
                        f"check_hydration`).")
    starts = _line_starts(body, np)
    if len(starts) - 1 != sum(header["counts"]) or (body and not body.endswith(b"\n")):
        raise UserError(f"File index {path} is incomplete ({len(starts) - 1} of "
                        f"{sum(header['counts'])} files): rerun the hydration check.")
    return Index(path=str(path), root=header["root"], split=header["split"],
                 classes=header["classes"], counts=header["counts"],
                 max_image_pixels=header["max_image_pixels"], body=body, starts=starts)


def images(path) -> int:
    """How many files an index holds, from its header alone (what a job's time request needs,
    evaluated for each job while Snakemake plans)."""
    with open(path, "rb") as f:
        return sum(json.loads(f.readline())["counts"])


def read_bad_files(path) -> set[str]:
    """The files listed in a `BAD_FILES` list."""
    try:
        with open(path, encoding="utf-8") as f:
            return {unescape(line) for line in f.read().split("\n") if line}
    except FileNotFoundError:
        return set()


def add_bad_file(path, shown: str) -> None:
    """Append a file, as `escape` shows it, to a `BAD_FILES` list (several ranks may append:
    one short line each)."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(shown + "\n")


def without(index: Index, bad: set[str]) -> Index:
    """The index less the files in `bad` (paths as the index makes them), e.g. files found
    broken in training, with where they were in the index as written (`left_out`)."""
    import numpy as np

    if not bad:
        return index
    kept, counts, dropped, i = [], [], [], 0
    for n in index.counts:
        before = len(kept)
        for j in range(i, i + n):
            (dropped if index.file(j) in bad else kept).append(j)
        counts.append(len(kept) - before)
        i += n
    kept = [index.line(j) for j in kept]
    written = np.delete(np.arange(len(index) + len(index.left_out)), index.left_out)
    return replace(Index.from_lines(index.path, index.root, index.split, index.classes, counts,
                                    kept, index.max_image_pixels),
                   left_out=tuple(sorted([*index.left_out, *map(int, written[dropped])])))
