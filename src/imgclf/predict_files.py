"""The files `imgclf predict` and the rule `predict` read: found under the paths given, and the
state of those files, which decides when a set's CSV is out of date.

Light on purpose (no torch): the Snakefile imports it, through slices, to compute the rule's
params, which Snakemake compares with those the CSV was written with."""

from __future__ import annotations

import hashlib
import os

from imgclf.errors import UserError


def walk_folder(folder: str) -> tuple[list[str], list[tuple[str, str]]]:
    """(files, skipped) of `folder`, searched recursively: its regular files, and its broken
    links (which get a row with their error, not silence), sorted, hidden files and folders
    (a name starting with a dot) skipped. Links to folders are followed, each real folder once:
    `skipped` holds (link, real folder) for each link to a folder already searched, such as a
    link back up the tree, which would otherwise be walked for ever. Folders are walked in
    sorted order, so which of two ways to one folder is kept does not vary between runs."""
    files, skipped, seen = [], [], set()
    for root, dirs, names in os.walk(folder, followlinks=True):
        real = os.path.realpath(root)
        if real in seen:
            skipped.append((root, real))
            dirs[:] = []
            continue
        seen.add(real)
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in names:
            path = os.path.join(root, name)
            if not name.startswith(".") and (os.path.isfile(path) or not os.path.exists(path)):
                files.append(path)
    return sorted(files), skipped


def find_files(paths, warn=None) -> list[str]:
    """Every file of `paths`, each a file or a folder (walk_folder): the paths in the order
    given, a folder's files sorted, each file once. `warn(message)` is told of each link to a
    folder that was already searched. A path that does not exist, or a folder with no file in
    it, is a UserError."""
    found = {}
    for given in map(str, paths):
        if os.path.isdir(given):
            files, skipped = walk_folder(given)
            for link, real in skipped:
                if warn is not None:
                    warn(f"{link} leads to {real}, a folder already searched: its files are "
                         f"predicted once, under the first path found to it")
            if not files:
                raise UserError(f"The folder {given} holds no files to predict (hidden ones "
                                f"are skipped): pass a folder with images in it.")
        elif os.path.isfile(given):
            files = [given]
        else:
            raise UserError(f"{given} does not exist or is no regular file: pass image files "
                            f"or folders of them.")
        found.update(dict.fromkeys(files))
    return list(found)


def state(path: str) -> str:
    """The state of the files a set's path holds: a digest of each file's path, size and
    modification time, which changes when a file is added, removed, renamed or replaced. As a
    param of the rule `predict` it reruns the set's CSV on such a change (the folder's own time
    changes only when its direct entries do, not when a file is replaced or a subfolder's
    contents change). A path that cannot be listed gives the sentence the job then stops with."""
    try:
        files = find_files([path])
    except UserError as e:
        return str(e)
    digest = hashlib.sha256()
    for f in files:
        try:
            st = os.stat(f)
            size, mtime = st.st_size, st.st_mtime_ns
        except OSError:  # a broken link: its row says so
            size = mtime = -1
        digest.update(f"{f}\0{size}\0{mtime}\n".encode("utf-8", "surrogateescape"))
    return f"{len(files)} files, sha256 {digest.hexdigest()}"
