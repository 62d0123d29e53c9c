"""Opening an image under the pipeline's pixel limit: one rule for the hydration check and for
every decoder after it (the loader benchmark, the LR finder, training, evaluation).

An image whose header states more pixels (width x height) than `hydration.max_image_pixels` is
not decoded: its pixels would take that many bytes per channel, however small the file (a PNG
of 16000 x 16000 zeros is a few hundred kB). PIL has a limit of its own, `Image.MAX_IMAGE_PIXELS`,
but it only warns between one and two times the limit and raises above; here the limit is one
threshold, checked right after the header is read, and PIL's own check is switched off in
favour of it. The hydration check excludes such an image, with the key in its reason, and
writes the limit into the file index; the data sets built from the index take it from there,
and check it in whichever process decodes (a DataLoader worker included), so every stage uses
the limit the check used."""

from __future__ import annotations


class TooLarge(ValueError):
    """An image over the pixel limit; the message is the reason, naming the key."""


# why a file in which PIL recognises no image format is none, for the row or line naming it
NOT_AN_IMAGE = "not an image: no image format recognised in its bytes"


def open_image(fp, max_pixels: int | None):
    """PIL image of the file at `fp` (a path or a binary file object), header read, pixels not
    yet decoded; TooLarge when the header states more than `max_pixels` (None: no limit)."""
    from PIL import Image, UnidentifiedImageError

    Image.MAX_IMAGE_PIXELS = None  # set per call: a spawned worker imports PIL afresh
    try:
        image = Image.open(fp)
    except UnidentifiedImageError:  # PIL's message names the Python object, not the file
        raise UnidentifiedImageError(NOT_AN_IMAGE) from None
    width, height = image.size
    if max_pixels is not None and width * height > max_pixels:
        image.close()
        raise TooLarge(f"too large: {width} x {height} = {width * height:,} pixels, more than "
                       f"`hydration.max_image_pixels` = {max_pixels:,}")
    return image

