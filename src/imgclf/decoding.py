"""Image files to RGB pixels: one contract for both decode paths and every format.

Every stage that reads pixels (the hydration check, the loader benchmark, the LR finder,
training, evaluation, the export's ONNX check, `imgclf predict`) decodes through this module, so
that a file gives the same pixels whichever decoder the loader benchmark chose, and a file the
hydration check accepted decodes in training with either.

The contract, for every format PIL reads (JPEG, PNG, APNG, GIF, WebP, BMP, TIFF, PPM, PGM, ...):

- the first frame of an animation or a multi-page file (what PIL shows once it has opened one);
- 8 bits per channel: a 16-bit sample keeps its top 8 bits (>> 8; what torchvision's
  `to_dtype(..., scale=True)` does to uint16, and what PIL does itself reading a 16-bit RGB PNG
  or PPM). PIL opens 16-bit grey as mode I;16 and a PGM of more than 8 bits as I (scaled to
  16 bits), and its own conversion of those to RGB clips every value above 255 to white;
- grey, palette and bilevel images as RGB; an alpha channel dropped, not composited;
- no EXIF rotation (neither torchvision's ImageFolder nor evaluation applies one).

`pil` decoder: a PIL RGB image. `tensor` decoder: a uint8 CHW tensor; a JPEG in RGB or grey
through torchvision.io.decode_image (libjpeg-turbo, as PIL's: they gave the same pixels on the
tests' JPEGs, and accepted and rejected the same of 1,500 randomly damaged ones), every other
file through the PIL path. torchvision
has its own PNG, GIF and WebP decoders, but they break the contract: decode_image returns 16-bit
PNG as uint16, every frame of an animated GIF, refuses an animated WebP, and its libpng error
handling ends the process with a segmentation fault on a PNG whose IDAT checksum is wrong,
which PIL reads. BMP, TIFF, PPM and PGM it does not read at all. A CMYK JPEG goes through PIL,
whose conversion of Adobe's inverted CMYK is the one the hydration check applied."""

from __future__ import annotations

import io

from imgclf import images
from imgclf.errors import UserError

SIXTEEN_BIT = ("I", "I;16", "I;16B", "I;16L", "I;16N")  # PIL's modes of > 8-bit grey
TORCHVISION = {"JPEG": ("RGB", "L")}  # formats (and PIL modes) the tensor decoder hands torchvision


class UnsupportedMode(ValueError):
    """An image whose pixels PIL decodes but cannot convert to RGB (a grey TIFF with
    premultiplied alpha, PIL's mode La); the message is the reason."""


def to_rgb(image):
    """The PIL image `image` (opened, its first frame shown) decoded as an RGB PIL image by the
    contract above. An RGB image is returned itself, loaded."""
    from PIL import Image

    if image.mode in SIXTEEN_BIT:
        import numpy as np

        pixels = np.asarray(image).astype(np.int64).clip(0, 65535) >> 8
        image = Image.fromarray(pixels.astype(np.uint8), "L")
    if image.mode == "RGB":
        image.load()
        return image
    try:
        return image.convert("RGB")
    except ValueError:
        raise UnsupportedMode(f"unsupported: PIL decodes its pixels (mode {image.mode}) but "
                              f"does not convert them to RGB") from None


def read_pil(path: str, max_pixels: int | None):
    """The `pil` decoder: the image at `path` as an RGB PIL image, under the pixel limit."""
    with open(path, "rb") as f:
        return to_rgb(images.open_image(f, max_pixels))


def read_tensor(path: str, max_pixels: int | None):
    """The `tensor` decoder: the image at `path` as a uint8 CHW RGB tensor, under the pixel limit
    (the header read by PIL from the same bytes: libjpeg-turbo has no limit). Read in Python,
    which opens any name the file system holds (torchvision's `read_file` takes the path as
    UTF-8, which a name that is not cannot be)."""
    import torch
    from torchvision.io import ImageReadMode, decode_image
    from torchvision.transforms.v2.functional import pil_to_tensor

    with open(path, "rb") as f:
        raw = bytearray(f.read())
    image = images.open_image(io.BytesIO(raw), max_pixels)
    if image.mode in TORCHVISION.get(image.format, ()):
        image.close()
        return decode_image(torch.frombuffer(raw, dtype=torch.uint8), mode=ImageReadMode.RGB)
    return pil_to_tensor(to_rgb(image))


READERS = {"pil": read_pil, "tensor": read_tensor}  # artifacts.DECODERS, each with its function


def reader(decoder: str):
    """The decode function of the decode path `decoder`: f(path, max_pixels)."""
    if decoder not in READERS:
        raise UserError(f"Unknown decode path {decoder!r}: choose one of {', '.join(READERS)}.")
    return READERS[decoder]
