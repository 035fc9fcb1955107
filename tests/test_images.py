"""Input decoding and output encoding: formats, limits, bombs, orientation, modes, metadata."""

from __future__ import annotations

import io
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageCms, PngImagePlugin

from tasks.errors import (
    FaceFlowError,
    ImageTooLarge,
    ImageTooSmall,
    InvalidInput,
    UnsupportedFormat,
)
from tasks.images import ImageInfo, decode_image, encode_image, probe_image, sniff_format
from tasks.options import ImageLimits
from tests.samples import astronaut_jpeg_bytes, astronaut_rgb, encode, grace_hopper_jpeg_bytes

REPO = Path(__file__).resolve().parents[1]


def _gradient(width: int = 64, height: int = 48) -> np.ndarray:
    """An asymmetric test picture (a rotation or flip changes it)."""
    y, x = np.mgrid[0:height, 0:width]
    return np.stack([x * 255 // width, y * 255 // height, (x + y) % 256], -1).astype(np.uint8)


def _png_chunk(kind: bytes, payload: bytes) -> bytes:
    return (
        struct.pack(">I", len(payload))
        + kind
        + payload
        + struct.pack(">I", zlib.crc32(kind + payload) & 0xFFFFFFFF)
    )


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG with a valid IHDR claiming ``width`` x ``height`` RGB pixels, and no pixel data."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IEND", b"")


def _exact_type(excinfo: pytest.ExceptionInfo[BaseException], cls: type) -> None:
    assert type(excinfo.value) is cls, f"{type(excinfo.value).__name__}: {excinfo.value}"


# --- formats -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fmt", "kwargs", "name"),
    [("PNG", {}, "png"), ("JPEG", {"quality": 95}, "jpeg"), ("WEBP", {"quality": 90}, "webp")],
)
def test_accepted_formats_decode_to_rgb(fmt: str, kwargs: dict[str, object], name: str) -> None:
    image = astronaut_rgb()
    data = encode(image, fmt, **kwargs)
    assert probe_image(data) == ImageInfo(name, 512, 512)  # type: ignore[arg-type]
    decoded = decode_image(data)
    assert decoded.shape == (512, 512, 3) and decoded.dtype == np.uint8
    assert decoded.flags.c_contiguous
    error = np.abs(decoded.astype(int) - image.astype(int)).mean()
    assert error == 0 if fmt == "PNG" else error < 4


def test_real_jpeg_file_decodes() -> None:
    assert decode_image(grace_hopper_jpeg_bytes()).shape == (600, 512, 3)


@pytest.mark.parametrize("fmt", ["GIF", "BMP", "TIFF", "ICO", "PPM"])
def test_other_formats_are_unsupported(fmt: str) -> None:
    data = encode(_gradient(), fmt)
    with pytest.raises(UnsupportedFormat):
        probe_image(data)
    with pytest.raises(UnsupportedFormat):
        decode_image(data)


@pytest.mark.parametrize("data", [b"", b"hello, this is not an image", b"RIFF\0\0\0\0WAVEfmt "])
def test_not_an_image_is_unsupported(data: bytes) -> None:
    with pytest.raises(UnsupportedFormat) as excinfo:
        decode_image(data)
    assert excinfo.value.code == "unsupported_format" and excinfo.value.permanent


def test_magic_bytes_decide_the_format() -> None:
    assert sniff_format(encode(_gradient(), "PNG")) == "png"
    assert sniff_format(encode(_gradient(), "JPEG")) == "jpeg"
    assert sniff_format(encode(_gradient(), "WEBP")) == "webp"
    # A PNG body behind a JPEG signature is parsed as JPEG only, and is corrupt as one.
    with pytest.raises(InvalidInput):
        decode_image(b"\xff\xd8\xff" + encode(_gradient(), "PNG")[3:])


# --- corrupt and truncated ------------------------------------------------------------------


def test_truncated_jpeg_is_invalid() -> None:
    data = astronaut_jpeg_bytes()
    probe_image(data[: len(data) // 2])  # the header alone is intact
    with pytest.raises(InvalidInput) as excinfo:
        decode_image(data[: len(data) // 2])
    _exact_type(excinfo, InvalidInput)


def test_truncated_png_is_invalid() -> None:
    data = encode(astronaut_rgb(), "PNG")
    with pytest.raises(InvalidInput) as excinfo:
        decode_image(data[: len(data) // 3])
    _exact_type(excinfo, InvalidInput)


def test_corrupt_png_chunk_is_invalid() -> None:
    data = bytearray(encode(astronaut_rgb(), "PNG"))
    start = data.index(b"IDAT") + 100
    data[start : start + 64] = bytes(64)
    with pytest.raises(InvalidInput) as excinfo:
        decode_image(bytes(data))
    _exact_type(excinfo, InvalidInput)


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP"])
def test_damaged_bytes_raise_only_typed_errors(fmt: str) -> None:
    """Random byte flips and cuts: a decoded image or a FaceFlowError, never anything else."""
    rng = np.random.default_rng(1)
    base = encode(_gradient(64, 64), fmt)
    for _ in range(80):
        data = bytearray(base)
        for _ in range(int(rng.integers(1, 6))):
            data[int(rng.integers(0, len(data)))] = int(rng.integers(0, 256))
        if rng.random() < 0.3:
            data = data[: int(rng.integers(1, len(data)))]
        try:
            decoded = decode_image(bytes(data))
        except FaceFlowError as exc:
            assert exc.permanent
        else:
            assert decoded.dtype == np.uint8 and decoded.shape[2] == 3


def test_png_signature_alone_is_invalid() -> None:
    with pytest.raises(InvalidInput) as excinfo:
        probe_image(b"\x89PNG\r\n\x1a\n")
    _exact_type(excinfo, InvalidInput)


# --- limits ----------------------------------------------------------------------------------


def test_one_pixel_image_is_too_small() -> None:
    data = encode(np.zeros((1, 1, 3), np.uint8), "PNG")
    with pytest.raises(ImageTooSmall):
        probe_image(data)
    with pytest.raises(ImageTooSmall):
        decode_image(data)


def test_min_side_bounds_the_short_side() -> None:
    data = encode(_gradient(200, 15), "PNG")
    with pytest.raises(ImageTooSmall):
        decode_image(data)
    assert decode_image(data, ImageLimits(min_side=15)).shape == (15, 200, 3)


def test_decompression_bomb_header_is_refused_before_decoding() -> None:
    bomb = _png_header_only(100_000, 100_000)
    assert len(bomb) < 100
    start = time.perf_counter()
    for check in (probe_image, decode_image):
        with pytest.raises(ImageTooLarge) as excinfo:
            check(bomb)
        assert excinfo.value.code == "image_too_large"
    assert time.perf_counter() - start < 1.0


def test_pixel_limit_applies_below_pillows_own_ceiling() -> None:
    # 8000 x 8000 = 64 MP: under Pillow's bomb warning (89 MP), over our 40 MP default.
    header = _png_header_only(8000, 8000)
    with pytest.raises(ImageTooLarge):
        probe_image(header)
    # Pixel data absent: once the limit admits it, the image is merely corrupt.
    with pytest.raises(InvalidInput) as excinfo:
        decode_image(header, ImageLimits(max_pixels=64_000_000))
    _exact_type(excinfo, InvalidInput)


def test_pillows_bomb_guard_still_applies_above_our_limit() -> None:
    with pytest.raises(ImageTooLarge):
        probe_image(_png_header_only(100_000, 100_000), ImageLimits(max_pixels=10**11))


def test_pixel_limit_is_exact() -> None:
    data = encode(_gradient(64, 48), "PNG")
    assert probe_image(data, ImageLimits(max_pixels=64 * 48)).width == 64
    with pytest.raises(ImageTooLarge):
        probe_image(data, ImageLimits(max_pixels=64 * 48 - 1))


def test_byte_limit_is_checked_before_anything_else() -> None:
    data = astronaut_jpeg_bytes()
    with pytest.raises(ImageTooLarge):
        decode_image(data, ImageLimits(max_bytes=len(data) - 1))
    assert decode_image(data, ImageLimits(max_bytes=len(data))).shape == (512, 512, 3)
    # Even bytes that are no image at all: the size is refused first.
    with pytest.raises(ImageTooLarge):
        probe_image(b"x" * 2000, ImageLimits(max_bytes=1000))


# --- orientation and modes ---------------------------------------------------------------


def _with_orientation(image: np.ndarray, orientation: int, fmt: str) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format=fmt, exif=exif.tobytes(), quality=95)
    return buffer.getvalue()


def test_exif_orientation_6_rotates_clockwise() -> None:
    image = _gradient(64, 48)
    decoded = decode_image(_with_orientation(image, 6, "PNG"))
    np.testing.assert_array_equal(decoded, np.rot90(image, k=-1))
    assert decode_image(_with_orientation(image, 6, "JPEG")).shape == (64, 48, 3)
    assert decode_image(_with_orientation(image, 6, "WEBP")).shape == (64, 48, 3)


@pytest.mark.parametrize(
    ("orientation", "expected"),
    [(1, lambda a: a), (3, lambda a: a[::-1, ::-1]), (8, lambda a: np.rot90(a)), (2, np.fliplr)],
)
def test_exif_orientations(orientation: int, expected) -> None:  # type: ignore[no-untyped-def]
    image = _gradient(64, 48)
    decoded = decode_image(_with_orientation(image, orientation, "PNG"))
    np.testing.assert_array_equal(decoded, expected(image))


def test_rgba_is_composited_onto_white() -> None:
    rgba = np.zeros((32, 32, 4), np.uint8)
    rgba[..., :3] = (200, 40, 10)
    rgba[:, :16, 3] = 255  # left half opaque
    rgba[:, 16:, 3] = 0  # right half transparent
    rgba[:8, :, 3] = 128  # top band half transparent
    decoded = decode_image(encode(rgba, "PNG"))
    assert tuple(decoded[20, 4]) == (200, 40, 10)
    assert tuple(decoded[20, 28]) == (255, 255, 255)
    assert np.abs(decoded[2, 4].astype(int) - [227, 147, 132]).max() <= 1
    assert decode_image(encode(rgba, "WEBP", lossless=True))[20, 28].tolist() == [255] * 3


def test_la_and_palette_transparency() -> None:
    la = Image.fromarray(np.zeros((20, 20), np.uint8)).convert("LA")
    la.putalpha(0)
    buffer = io.BytesIO()
    la.save(buffer, format="PNG")
    assert decode_image(buffer.getvalue()).min() == 255
    palette = Image.fromarray(_gradient(32, 32)).convert("P")
    buffer = io.BytesIO()
    palette.save(buffer, format="PNG", transparency=int(np.asarray(palette)[0, 0]))
    decoded = decode_image(buffer.getvalue())
    assert decoded.shape == (32, 32, 3) and tuple(decoded[0, 0]) == (255, 255, 255)


def test_grayscale_becomes_three_equal_channels() -> None:
    gray = _gradient()[..., 0]
    decoded = decode_image(encode(gray, "PNG"))
    assert decoded.shape == (*gray.shape, 3)
    for channel in range(3):
        np.testing.assert_array_equal(decoded[..., channel], gray)
    assert decode_image(encode(gray, "JPEG")).shape == (*gray.shape, 3)


def test_sixteen_bit_grayscale_is_scaled_not_clipped() -> None:
    values = np.array([[0, 257, 32768, 65535] * 8] * 32, dtype=np.uint16)
    buffer = io.BytesIO()
    Image.fromarray(values).save(buffer, format="PNG")
    with Image.open(io.BytesIO(buffer.getvalue())) as check:
        assert check.mode.startswith("I")
    decoded = decode_image(buffer.getvalue())
    assert decoded[0, :4, 0].tolist() == [0, 1, 128, 255]


def test_cmyk_jpeg_becomes_rgb() -> None:
    cmyk = Image.fromarray(astronaut_rgb()).convert("CMYK")
    buffer = io.BytesIO()
    cmyk.save(buffer, format="JPEG", quality=95)
    decoded = decode_image(buffer.getvalue())
    assert decoded.shape == (512, 512, 3)
    assert np.abs(decoded.astype(int) - astronaut_rgb().astype(int)).mean() < 6


def test_icc_profile_is_applied_and_a_broken_one_ignored() -> None:
    image = _gradient()
    srgb_profile = ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB")).tobytes()
    decoded = decode_image(encode(image, "PNG", icc_profile=srgb_profile))
    assert np.abs(decoded.astype(int) - image.astype(int)).max() <= 2
    broken = decode_image(encode(image, "PNG", icc_profile=b"not a profile"))
    np.testing.assert_array_equal(broken, image)


# --- encoding ----------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["png", "jpeg", "webp"])
def test_encode_round_trips_without_metadata(fmt: str) -> None:
    # Start from an input that carries EXIF, ICC and text: none of it may come out.
    exif = Image.Exif()
    exif[0x0112] = 1
    exif[0x010F] = "FaceFlowTestCamera"
    info = PngImagePlugin.PngInfo()
    info.add_text("Comment", "secret location")
    srgb = ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB")).tobytes()
    source = encode(astronaut_rgb(), "PNG", exif=exif.tobytes(), pnginfo=info, icc_profile=srgb)
    data = encode_image(decode_image(source), fmt, 92)  # type: ignore[arg-type]
    assert b"FaceFlowTestCamera" not in data and b"secret location" not in data
    with Image.open(io.BytesIO(data)) as reopened:
        assert reopened.format == {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}[fmt]
        for key in ("exif", "icc_profile", "xmp", "Comment", "dpi"):
            assert key not in reopened.info, (key, reopened.info.keys())
        assert len(reopened.getexif()) == 0
        if fmt == "png":
            assert not reopened.text  # type: ignore[attr-defined]
    decoded = decode_image(data)
    error = np.abs(decoded.astype(int) - astronaut_rgb().astype(int)).mean()
    assert error == 0 if fmt == "png" else error < 4


def test_encode_quality_changes_size_and_bounds_are_checked() -> None:
    image = astronaut_rgb()
    assert len(encode_image(image, "jpeg", 60)) < len(encode_image(image, "jpeg", 95))
    assert len(encode_image(image, "webp", 50)) < len(encode_image(image, "webp", 95))
    with pytest.raises(InvalidInput):
        encode_image(image, "jpeg", 0)
    with pytest.raises(InvalidInput):
        encode_image(image, "gif", 90)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput):
        encode_image(image[..., 0], "png", 90)


def test_images_module_imports_neither_torch_nor_cv2() -> None:
    script = (
        "import sys, tasks.images; "
        "bad = [m for m in ('torch', 'cv2') if m in sys.modules]; "
        "assert not bad, bad"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
