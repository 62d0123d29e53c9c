"""Running one stage from a Snakemake script or the CLI: logging to the job's log file and
the terminal, and a user error reported as one sentence instead of a traceback."""

from __future__ import annotations

import logging
import shlex
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
    # libraries that log their own steps at INFO: the ONNX exporter's passes, a dozen lines
    for noisy in ("matplotlib", "PIL", "onnx_ir", "onnxscript"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def run(fn, log_file: str | None = None):
    """Call fn(); a UserError becomes one logged sentence and exit status 1."""
    setup_logging(log_file)
    try:
        return fn()
    except UserError as e:
        logging.getLogger("imgclf").error("%s", e)
        sys.exit(1)


def check_interpreter(executable: str = sys.executable) -> None:
    """Refuse, in one sentence, an interpreter whose path a shell would split: Snakemake runs
    every `script:` rule as `<interpreter> <script>` without quoting the interpreter
    (snakemake#2645), so such a checkout would fail at its first rule with "No such file or
    directory" (the interpreter of run.sh's .venv lies inside the checkout)."""
    if shlex.quote(executable) != executable:
        raise UserError(f"This workflow's Python interpreter {executable!r} has a space or a "
                        f"shell character in its path, which Snakemake cannot run scripts from "
                        f"(it does not quote it, snakemake#2645): clone or move the checkout "
                        f"(and so its .venv) to a path without them, or run Snakemake from a "
                        f"Python environment that has none.")
