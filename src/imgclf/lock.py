"""The lock files run.sh installs from: one per platform in requirements/, each with every
package's exact version and hashes, made by `./run.sh lock` (uv pip compile) from
pyproject.toml's dependencies, its `test` extra and requirements/ceiling.txt.

Each lock starts with a digest of what it was made from, so that a test (and so CI) fails when
pyproject.toml changed and the locks were not made again. Standard library only: run.sh reads
it before anything is installed (`python -m imgclf.lock path`)."""

from __future__ import annotations

import hashlib
import json
import platform
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LOCK_DIR = ROOT / "requirements"
CEILING = LOCK_DIR / "ceiling.txt"
# (uname -s, uname -m) -> uv's --python-platform, and the lock's file name
PLATFORMS = {
    ("Linux", "x86_64"): ("x86_64-manylinux_2_28", "linux-x86_64.txt"),
    ("Linux", "aarch64"): ("aarch64-manylinux_2_28", "linux-aarch64.txt"),
    ("Darwin", "arm64"): ("aarch64-apple-darwin", "macos-arm64.txt"),
}
PYTHON = "3.11"  # the interpreter the locks are resolved for (requires-python's floor)
HEADER = "# made from pyproject.toml and requirements/ceiling.txt with digest "


def made_from(pyproject: Path = ROOT / "pyproject.toml", ceiling: Path = CEILING) -> str:
    """Digest of what the locks are resolved from: the dependencies, the test extra, the
    Python they are resolved for and the ceiling's requirements (comments left out)."""
    project = tomllib.loads(pyproject.read_text())["project"]
    spec = {"dependencies": project["dependencies"],
            "test": project["optional-dependencies"]["test"], "python": PYTHON,
            "ceiling": [line.split("#")[0].strip() for line in ceiling.read_text().splitlines()
                        if line.split("#")[0].strip()]}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def path_for(system: str | None = None, machine: str | None = None) -> Path | None:
    """This platform's lock (None where there is none)."""
    key = (system or platform.system(), machine or platform.machine())
    return LOCK_DIR / PLATFORMS[key][1] if key in PLATFORMS else None


def recorded(lock: Path) -> str | None:
    """The digest a lock says it was made from."""
    first = lock.read_text().splitlines()[:1]
    return first[0][len(HEADER):].strip() if first and first[0].startswith(HEADER) else None


def main(argv: list[str]) -> int:
    """`path`: this platform's lock, relative to the checkout (nothing where there is none);
    `targets`: uv's platform, the Python and the lock's path, a line per lock; `header`: the
    line a lock made now starts with."""
    what = argv[0] if argv else ""
    if what == "path":
        lock = path_for()
        print(lock.relative_to(ROOT) if lock else "")
    elif what == "targets":
        for uv_platform, name in PLATFORMS.values():
            print(uv_platform, PYTHON, (LOCK_DIR / name).relative_to(ROOT))
    elif what == "header":
        print(HEADER + made_from())
    else:
        print("usage: python -m imgclf.lock path|targets|header", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
