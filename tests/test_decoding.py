"""One decoding contract (imgclf.decoding) for every format a user may hand to the pipeline, with
either decoder: the first frame, 16-bit samples scaled to 8 bits, grey and palette as RGB,
alpha dropped; and every file the hydration check accepts decodes in training with each decoder
the loader benchmark may choose."""

from __future__ import annotations

import io
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from imgclf import artifacts, decoding, index, recipes, settings
from imgclf.data import datasets
from imgclf.hydration import integrity
from test_data_flaws import run_check

RNG = np.random.default_rng(7)
COLOURS = RNG.integers(0, 256, (16, 3), dtype=np.uint8)
RGB = COLOURS[RNG.integers(0, 16, (20, 24))]  # 16 colours: a palette holds them exactly
SECOND = 255 - RGB  # a second frame, for the formats that animate or hold pages
GREY = RGB[..., 0]
DEEP = GREY.astype(np.uint16) * 257  # 16-bit grey whose top 8 bits are GREY


def saved(image: Image.Image, fmt: str, **options) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **options)
    return buf.getvalue()


def frames(fmt: str, **options) -> bytes:
    return saved(Image.fromarray(RGB), fmt, save_all=True, append_images=[Image.fromarray(SECOND)],
                 **options)


def png_rgb16(pixels: np.ndarray) -> bytes:
    """A 16-bit RGB PNG (PIL writes none)."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return (struct.pack(">I", len(body)) + kind + body
                + struct.pack(">I", zlib.crc32(kind + body)))

    h, w, _ = pixels.shape
    rows = b"".join(b"\0" + pixels[y].astype(">u2").tobytes() for y in range(h))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 16, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))


def pgm16(pixels: np.ndarray) -> bytes:
    h, w = pixels.shape
    return f"P5\n{w} {h}\n65535\n".encode() + pixels.astype(">u2").tobytes()


def as_rgb(grey: np.ndarray) -> np.ndarray:
    return np.repeat(grey[..., None], 3, axis=2)


BITS = GREY > 127
# name (its suffix the format's) -> (bytes, the RGB pixels the contract gives; None: lossy)
FORMATS = {
    "rgb.jpg": (saved(Image.fromarray(RGB), "JPEG", quality=95), None),
    "grey.jpg": (saved(Image.fromarray(GREY), "JPEG", quality=95), None),
    "cmyk.jpg": (saved(Image.fromarray(RGB).convert("CMYK"), "JPEG", quality=95), None),
    "rgb.png": (saved(Image.fromarray(RGB), "PNG"), RGB),
    "rgba.png": (saved(Image.fromarray(np.dstack([RGB, GREY])), "PNG"), RGB),
    "grey_alpha.png": (saved(Image.fromarray(np.dstack([GREY, GREY[::-1]])).convert("LA"), "PNG"),
                       as_rgb(GREY)),
    "palette.png": (saved(Image.fromarray(RGB).quantize(16), "PNG", transparency=3), RGB),
    "bilevel.png": (saved(Image.fromarray(BITS), "PNG"), as_rgb(BITS.astype(np.uint8) * 255)),
    "grey16.png": (saved(Image.fromarray(DEEP), "PNG"), as_rgb(GREY)),
    "rgb16.png": (png_rgb16(RGB.astype(np.uint16) * 257), RGB),
    "animated.png": (frames("PNG"), RGB),
    "animated.gif": (frames("GIF"), RGB),
    "animated.webp": (frames("WEBP", lossless=True), RGB),
    "lossy.webp": (saved(Image.fromarray(RGB), "WEBP", quality=80), None),
    "rgb.bmp": (saved(Image.fromarray(RGB), "BMP"), RGB),
    "pages.tiff": (frames("TIFF"), RGB),
    "grey16.tif": (saved(Image.fromarray(DEEP), "TIFF"), as_rgb(GREY)),
    "rgb.ppm": (saved(Image.fromarray(RGB), "PPM"), RGB),
    "grey.pgm": (saved(Image.fromarray(GREY), "PPM"), as_rgb(GREY)),
    "grey16.pgm": (pgm16(DEEP), as_rgb(GREY)),
}


def grey_premultiplied_tiff() -> bytes:
    """A grey TIFF with associated (premultiplied) alpha: PIL decodes its pixels, as mode La,
    but converts them to nothing."""
    plain = saved(Image.new("LA", (8, 8), (100, 50)), "TIFF")
    extra_samples = struct.pack("<HHIH", 338, 3, 1, 2)  # ExtraSamples: unassociated alpha
    assert plain.count(extra_samples) == 1
    return plain.replace(extra_samples, struct.pack("<HHIH", 338, 3, 1, 1))


def decoded(path: Path, decoder: str) -> torch.Tensor:
    """The uint8 CHW RGB tensor `decoder` gives for the file (the `pil` path's PIL image
    becomes one as its transform makes it)."""
    from torchvision.transforms.v2.functional import pil_to_tensor

    out = decoding.reader(decoder)(str(path), None)
    return out if decoder == "tensor" else pil_to_tensor(out)


@pytest.mark.parametrize("name", FORMATS)
def test_every_format_decodes_to_one_rgb_image_with_either_decoder(name, tmp_path):
    """Each decoder gives the same uint8 RGB tensor: the first frame, 16 bits scaled to 8 (not
    clipped to white), grey and palette as RGB, alpha dropped; a lossy format within a grey
    level of each other."""
    content, expected = FORMATS[name]
    path = tmp_path / name
    path.write_bytes(content)
    ours = {d: decoded(path, d) for d in artifacts.DECODERS}
    for d, x in ours.items():
        assert x.dtype == torch.uint8 and x.shape == (3, 20, 24), (d, x.dtype, x.shape)
    if expected is None:
        assert (ours["pil"].int() - ours["tensor"].int()).abs().max() <= 1
    else:
        want = torch.from_numpy(np.ascontiguousarray(expected)).permute(2, 0, 1)
        for d, x in ours.items():
            assert torch.equal(x, want), (d, x[:, 0, :4].tolist(), want[:, 0, :4].tolist())


def test_every_file_the_check_accepts_decodes_with_each_loader_decoder(tmp_path):
    """A data set in every format the check takes by suffix: the check accepts each file, and
    each decoder of `loader.decoders` (those the loader benchmark may choose) decodes every
    indexed file to the same pixels and the training's tensors. The check decodes to RGB as
    training does, so a file whose pixels PIL decodes but cannot make RGB of is excluded with
    its reason, not met in training."""
    root = tmp_path / "data"
    for split in ("train", "val"):
        for cls in ("a", "b"):
            (root / split / cls).mkdir(parents=True)
            for name, (content, _) in FORMATS.items():
                if not name.endswith(".gif"):  # by its suffix no image to the check
                    (root / split / cls / name).write_bytes(content)
    odd = root / "train" / "a" / "premultiplied.tif"
    odd.write_bytes(grey_premultiplied_tiff())
    report = run_check(root, tmp_path / "out", max_bad_fraction=0.5)

    assert report["verdict"] == "pass"
    assert integrity.check_image(str(odd), None).startswith("unsupported: PIL decodes")
    idx = index.read(tmp_path / "out" / "c.train.tsv")
    files = [idx.file(i) for i in range(len(idx))]
    assert len(files) == 2 * (len(FORMATS) - 1) and str(odd) not in files
    decoders = settings.validate({}, "loader")["decoders"]
    assert sorted(decoders) == sorted(artifacts.DECODERS)
    for decoder in decoders:
        ds = datasets.train_dataset(str(tmp_path / "out" / "c.train.tsv"), decoder, 8,
                                    recipes.get("demo"))
        assert all(ds[i][0].shape == (3, 8, 8) for i in range(len(ds)))
        for f in files:
            difference = decoded(Path(f), decoder).int() - decoded(Path(f), "pil").int()
            assert difference.abs().max() <= (1 if f.endswith(".jpg") else 0), (decoder, f)


@pytest.mark.parametrize("decoder", artifacts.DECODERS)
def test_a_file_that_is_no_image_is_said_to_be_none(decoder, tmp_path):
    """Either decoder says that a text file is not an image (what a row of `imgclf predict` and
    a training's error show), not which Python object held its bytes."""
    from PIL import UnidentifiedImageError

    path = tmp_path / "notes.jpg"
    path.write_text("labelled by the intern\n")
    with pytest.raises(UnidentifiedImageError) as err:
        decoding.reader(decoder)(str(path), None)
    assert str(err.value) == "not an image: no image format recognised in its bytes"


def test_the_hydration_check_gives_a_non_image_the_decoders_reason(tmp_path):
    """A text file named .jpg in the data set: the hydration check's excluded list gives it the
    reason that training and `imgclf predict` give (it said "corrupt: ..." in other words)."""
    from PIL import UnidentifiedImageError

    path = tmp_path / "notes.jpg"
    path.write_text("labelled by the intern\n")
    with pytest.raises(UnidentifiedImageError) as err:
        decoding.reader("pil")(str(path), None)
    assert integrity.check_image(str(path), None) == str(err.value)
