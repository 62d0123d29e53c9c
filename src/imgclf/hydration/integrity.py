"""Every image decoded in full, in parallel over the node's CPUs, so that a truncated or corrupt
file is found here, named, and kept out of training, not met in the first epoch days into a
queue. The decoder is the `pil` decode path's, to RGB as it trains (imgclf.decoding): the
`tensor` path decodes every format but JPEG the same way, and a JPEG with libjpeg-turbo as PIL
does, so a file accepted here decodes with whichever path the loader benchmark chooses. PIL
identifies a file by its content, so a PNG named .JPEG or a CMYK JPEG passes, as it trains.
An image over the pixel limit (imgclf.images) is not decoded, and unusable with that reason."""

from __future__ import annotations

from concurrent.futures import ProcessPoolExecutor
from functools import partial

from imgclf.decoding import UnsupportedMode, to_rgb
from imgclf.hardware import usable_cpus
from imgclf.images import NOT_AN_IMAGE, TooLarge, open_image
from imgclf.progress import progress

CHUNK = 256  # files per task: few enough round trips, small enough for a smooth progress display


def check_image(path: str, max_pixels: int | None) -> str | None:
    """Why the image at `path` cannot be trained on, or None when it decodes whole."""
    from PIL import UnidentifiedImageError

    try:
        with open_image(path, max_pixels) as img:
            to_rgb(img)  # what either decoder does with it, so neither fails on it in training
    except (TooLarge, UnsupportedMode) as e:
        return str(e)
    except UnidentifiedImageError:  # the reason `imgclf predict` and training give too
        return NOT_AN_IMAGE
    except OSError as e:  # truncated data, broken stream, permission, I/O error
        text = e.strerror or str(e)
        if e.errno:
            return f"unreadable: {text}"
        return f"{'truncated' if 'truncated' in text.lower() else 'corrupt'}: {text}"
    except Exception as e:  # noqa: BLE001 - whatever a decoder raises on a file, it cannot train
        return f"corrupt: {type(e).__name__}: {e}"
    return None


def _check_chunk(paths: list[str], max_pixels: int | None) -> list[tuple[str, str]]:
    return [(p, why) for p in paths if (why := check_image(p, max_pixels)) is not None]


def verify(paths: list[str], workers: int | str, max_pixels: int | None) -> dict[str, str]:
    """{path: reason} for every image in `paths` that does not decode, or whose header states
    more than `max_pixels` pixels."""
    n = usable_cpus() if workers == "auto" else int(workers)
    chunks = [paths[i:i + CHUNK] for i in range(0, len(paths), CHUNK)]
    check = partial(_check_chunk, max_pixels=max_pixels)
    bad: dict[str, str] = {}
    pool = ProcessPoolExecutor(n) if n > 1 and len(chunks) > 1 else None
    try:
        results = pool.map(check, chunks) if pool else map(check, chunks)
        with progress(total=len(paths), desc="decode every image", unit="img") as bar:
            for chunk, found in zip(chunks, results):
                bad.update(found)
                bar.update(len(chunk))
    finally:
        if pool:
            pool.shutdown(cancel_futures=True)
    return bad
