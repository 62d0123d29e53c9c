"""Running one stage from a Snakemake script or the CLI: logging to the job's log file and
the terminal, and a user error reported as one sentence instead of a traceback."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from imgclf.errors import UserError


def setup_logging(log_file: str | None = None, level=logging.INFO) -> None:
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_file:
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        # a message quoting a file name that is not UTF-8 is written, not lost to an error
        handlers.append(logging.FileHandler(log_file, mode="w", encoding="utf-8",
                                            errors="backslashreplace"))
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        handlers=handlers, force=True)
    for noisy in ("matplotlib", "PIL"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def run(fn, log_file: str | None = None):
    """Call fn(); a UserError becomes one logged sentence and exit status 1."""
    setup_logging(log_file)
    try:
        return fn()
    except UserError as e:
        logging.getLogger("imgclf").error("%s", e)
        sys.exit(1)
