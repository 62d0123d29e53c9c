"""Progress of long work: a live bar on a terminal, a plain line now and then in a log file.

A tqdm bar redraws itself with carriage returns; in a Snakemake or Slurm log file every redraw
stays as noise. So the bar is drawn only when stderr is a terminal; otherwise the same figures
(count, percentage, rate, time left) are logged as one ordinary line every `PLAIN_EVERY_S`
seconds, and once at the end; a run that may stop early ends with a line that says how
(`ended`)."""

from __future__ import annotations

import io
import logging
import sys

from tqdm import tqdm

PLAIN_EVERY_S = 30.0
PLAIN_FORMAT = "{desc}: {n_fmt}/{total_fmt} {unit} ({percentage:.0f} %), {rate_fmt}, " \
               "{elapsed} elapsed, {remaining} left"
log = logging.getLogger("imgclf.progress")


class _LogLines(tqdm):
    """tqdm's bookkeeping and formatting, written as log lines instead of a redrawn bar."""

    def display(self, msg=None, pos=None):
        if msg != "":  # tqdm passes "" when it clears a bar that does not stay
            log.info("%s", str(self))  # the line as it is now, not when a handler reads it
        return True

    # The plain line has no postfix, so a postfix changed without a redraw: redrawing for it
    # would log the last line again, its count not yet advanced.
    def set_postfix(self, ordered_dict=None, refresh=True, **kwargs):
        super().set_postfix(ordered_dict, refresh=False, **kwargs)

    def set_postfix_str(self, s="", refresh=True):
        super().set_postfix_str(s, refresh=False)


def hms(seconds: float) -> str:
    """Seconds as H:MM:SS, as the forecast and the progress lines say them."""
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def ended(desc: str, done: int, total: int, unit: str, why: str | None = None) -> None:
    """The last progress line of a run that may stop early: how it ended. Without it, a run
    stopped at its 18th of 20 steps leaves "17/20 (85 %)" as its last line (tqdm counts a step
    when the next begins), which reads as a run cut off, not one that finished."""
    if done >= total:
        log.info("%s: completed %d/%d %s%s", desc, done, total, unit, f", {why}" if why else "")
    else:
        log.info("%s: stopped at %s %d of %d: %s", desc, unit.removesuffix("s"), done, total,
                 why or "ended early")


def progress(iterable=None, *, every_s: float = PLAIN_EVERY_S, **kwargs) -> tqdm:
    """`tqdm(iterable, **kwargs)` on a terminal, else a tqdm that logs a line every `every_s`."""
    if sys.stderr.isatty():
        return tqdm(iterable, **kwargs)
    kwargs.pop("leave", None)
    return _LogLines(iterable, file=io.StringIO(), mininterval=every_s, leave=True,
                     bar_format=PLAIN_FORMAT, **kwargs)
