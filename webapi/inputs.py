"""Job inputs at submit: decode ``data:`` URIs, validate images, store them by content hash.

Validation is ``tasks.images.probe_image`` (the header: magic bytes, byte count, pixel
count, smallest side; torch-free, imported on first use; decompression bombs are refused
there, before any pixel is decoded) and then ``check_image_data``: every byte of pixel
data is decoded with small memory (a PNG's compressed stream is inflated and dropped, a
JPEG is decoded at 1/8 scale), so a truncated or corrupt file is a 422 at submit instead
of a failed job later. Callers run this in a worker thread (zlib and Pillow's decoders
release the GIL). An https URL input is only SSRF-checked here; the relay fetches it
later (with the same checks, size limits and timeouts) and stores it the same way.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import struct
import zlib
from collections.abc import Iterable
from dataclasses import dataclass

from flows.params import input_key
from tasks.errors import InvalidInput
from tasks.options import CONTENT_TYPES, ImageLimits
from webapi.errors import BlockedUrl, InvalidRequest, PayloadTooLarge, UnsupportedMediaType
from webapi.storage import ObjectStore
from webapi.urls import UrlPolicy

ACCEPTED_MEDIA_TYPES: frozenset[str] = frozenset(
    {"image/jpeg", "image/jpg", "image/pjpeg", "image/png", "image/webp"}
)


@dataclass(frozen=True, slots=True)
class InputRef:
    """Where one input is: a storage ``key`` (validated, stored) or a ``url`` to fetch.
    ``digest`` is the sha256 hex of the bytes, or of the URL for a URL input."""

    name: str
    digest: str
    key: str | None = None
    url: str | None = None
    width: int | None = None
    height: int | None = None

    @property
    def pixels(self) -> int | None:
        """What the image decodes to (width x height); None until its header was read."""
        return self.width * self.height if self.width and self.height else None


def job_pixels(refs: Iterable[InputRef], limits: ImageLimits) -> int:
    """The pixels a job's inputs decode to together: each image's width x height, and the
    per-image limit for one whose size is not known yet (a URL the relay fetches later),
    so the sum bounds what a worker decodes for the job."""
    return sum(limits.max_pixels if ref.pixels is None else ref.pixels for ref in refs)


def decode_data_uri(uri: str, *, name: str, max_bytes: int) -> bytes:
    """The bytes of a ``data:image/...;base64,`` URI (413 before decoding if too large)."""
    header, comma, encoded = uri.partition(",")
    if not comma:
        raise InvalidRequest(f"{name}: a data: URI needs a ',' before the data.")
    media_type, *params = header.removeprefix("data:").split(";")
    if "base64" not in (p.strip().lower() for p in params):
        raise InvalidRequest(f"{name}: only base64 data: URIs are accepted.")
    media_type = media_type.strip().lower()
    if media_type and media_type not in ACCEPTED_MEDIA_TYPES:
        raise UnsupportedMediaType(f"{name}: {media_type} is not accepted: use JPEG, PNG or WebP.")
    encoded = encoded.strip()
    if len(encoded) // 4 * 3 > max_bytes + 3:
        raise PayloadTooLarge(f"{name}: the image exceeds {max_bytes} bytes.")
    try:
        return base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidRequest(f"{name}: the data: URI is not valid base64.") from exc


def store_image(data: bytes, *, name: str, limits: ImageLimits, store: ObjectStore) -> InputRef:
    """Validate ``data`` and store it under ``input_key(sha256, format)`` (once per content).

    Raises the typed ``tasks.errors`` (413 too large, 415 format, 422 corrupt/too small).
    """
    from tasks.images import probe_image

    if not data:
        raise InvalidRequest(f"{name}: the image is empty.")
    if len(data) > limits.max_bytes:
        raise PayloadTooLarge(f"{name}: the image exceeds {limits.max_bytes} bytes.")
    info = probe_image(data, limits)
    check_image_data(data, info.format)
    digest = hashlib.sha256(data).hexdigest()
    key = input_key(digest, info.format)
    if not store.exists(key):
        store.put(key, data, content_type=CONTENT_TYPES[info.format])
    return InputRef(name=name, digest=digest, key=key, width=info.width, height=info.height)


def check_image_data(data: bytes, image_format: str) -> None:
    """``InvalidInput`` unless all of the pixel data of an image ``probe_image`` accepted
    decodes: truncated, corrupt or with bad checksums. Memory stays small whatever the
    image's size, but for WebP (decoded whole: bounded by the pixel limit)."""
    try:
        if image_format == "png":
            _inflate_png(data)
            return
        from PIL import Image

        with Image.open(io.BytesIO(data), formats=[image_format.upper()]) as image:
            if image_format == "jpeg":  # DCT scaling: every coefficient, an eighth of the pixels
                image.draft(image.mode, (max(1, image.width // 8), max(1, image.height // 8)))
            image.load()
    except (OSError, SyntaxError, ValueError, EOFError, zlib.error, struct.error) as exc:
        raise InvalidInput("The image data is corrupt or truncated.") from exc


_PNG_CHUNK = struct.Struct(">I4s")


def _inflate_png(data: bytes, piece: int = 1 << 20) -> None:
    """Walk a PNG's chunks (CRCs checked) to IEND, inflating the IDAT stream to its end
    ``piece`` bytes at a time and dropping the output."""
    inflater = zlib.decompressobj()
    position = 8
    while True:
        length, kind = _PNG_CHUNK.unpack_from(data, position)
        end = position + 8 + length
        if end + 4 > len(data):
            raise EOFError(f"truncated {kind!r} chunk")
        (crc,) = struct.unpack_from(">I", data, end)
        if zlib.crc32(data[position + 4 : end]) != crc:
            raise SyntaxError(f"bad CRC in {kind!r} chunk")
        if kind == b"IDAT":
            inflater.decompress(data[position + 8 : end], piece)
            while inflater.unconsumed_tail:
                inflater.decompress(inflater.unconsumed_tail, piece)
        elif kind == b"IEND":
            break
        position = end + 4
    if not inflater.eof:
        raise EOFError("the image data ends early")


def accept_input(
    value: str | bytes,
    *,
    name: str,
    limits: ImageLimits,
    store: ObjectStore,
    urls: UrlPolicy,
) -> InputRef:
    """One input as given in a request: bytes (multipart), a ``data:`` URI or a URL that
    ``urls`` allows."""
    if isinstance(value, bytes):
        return store_image(value, name=name, limits=limits, store=store)
    text = value.strip()
    if text[:5].lower() == "data:":
        data = decode_data_uri(text, name=name, max_bytes=limits.max_bytes)
        return store_image(data, name=name, limits=limits, store=store)
    if text.partition(":")[0].lower() in urls.schemes:
        try:
            urls.check(text)
        except BlockedUrl as exc:
            raise BlockedUrl(f"{name}: {exc.message}") from exc
        return InputRef(name=name, digest=hashlib.sha256(text.encode()).hexdigest(), url=text)
    raise InvalidRequest(f"{name}: give a data:image/...;base64, URI or an https URL.")


def warm_up(limits: ImageLimits) -> None:
    """Import and initialise what validating an input needs (Pillow and its format
    plugins), so the first submit does not pay for it and long-lived objects exist before
    the app freezes its heap (``webapi.main``)."""
    import io

    from PIL import Image

    from tasks.images import probe_image

    for image_format in ("JPEG", "PNG", "WEBP"):
        buffer = io.BytesIO()
        Image.new("RGB", (limits.min_side, limits.min_side)).save(buffer, format=image_format)
        probe_image(buffer.getvalue(), limits)
