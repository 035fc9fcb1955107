"""Job inputs at submit: decode ``data:`` URIs, validate images, store them by content hash.

Validation is ``tasks.images.probe_image`` (the header: magic bytes, byte count, pixel
count, smallest side; torch-free, imported on first use; decompression bombs are refused
there, before any pixel is decoded) and then ``check_image_data``: every byte of pixel
data is decoded with small memory (a PNG's compressed stream is inflated and dropped, a
JPEG is decoded at 1/8 scale), so a truncated or corrupt file is a 422 at submit instead
of a failed job later. Callers run this in a worker thread (zlib and Pillow's decoders
release the GIL). An https URL input is only SSRF-checked here; the relay fetches it
later (with the same checks, size limits and timeouts) and stores it the same way: a
target URL that serves a video is spooled to a temporary file, hashed as it arrives,
probed and stored as an uploaded one (``store_spooled_video``).

A video target (``store_video``) never passes through memory whole: a multipart file is
copied from the request's spooled part to a temporary file in 1 MiB pieces and hashed as
it is copied, probed there (``tasks.video_io.probe_video``: container, codec, size,
duration, frame rate against ``VideoLimits``, every packet demuxed and the first frame
decoded, so a corrupt or over-limit video is refused before it queues) and streamed to
storage (``ObjectStore.put_file``). A small video may come as a ``data:video/...`` URI.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import struct
import tempfile
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any, Literal
from urllib.parse import urlsplit

from flows.params import input_key
from tasks.errors import InvalidInput, VideoTooLarge
from tasks.options import CONTENT_TYPES, ImageLimits, VideoLimits
from webapi.errors import BlockedUrl, InvalidRequest, PayloadTooLarge, UnsupportedMediaType
from webapi.storage import ObjectStore
from webapi.urls import UrlPolicy

ACCEPTED_MEDIA_TYPES: frozenset[str] = frozenset(
    {"image/jpeg", "image/jpg", "image/pjpeg", "image/png", "image/webp"}
)
VIDEO_MEDIA_TYPES: frozenset[str] = frozenset(
    {"video/mp4", "video/quicktime", "video/x-matroska", "video/webm"}
)
#: The content type each probed container is stored with.
VIDEO_CONTENT_TYPES: dict[str, str] = {
    "mp4": "video/mp4",
    "mov": "video/quicktime",
    "mkv": "video/x-matroska",
    "webm": "video/webm",
}
_ISO_BOXES = (b"ftyp", b"moov", b"mdat", b"free", b"wide", b"skip")
_EBML = b"\x1a\x45\xdf\xa3"
_PIECE = 1 << 20
#: What a job keeps of a video's probe (``models.VideoInputPublic``; ``audio`` as a flag).
VIDEO_FIELDS = (
    "container",
    "video_codec",
    "width",
    "height",
    "rotation",
    "frame_count",
    "duration_s",
    "fps",
    "variable_frame_rate",
    "size_bytes",
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
    media: Literal["photo", "video"] = "photo"
    video: dict[str, Any] | None = None  # a video's probe (models.VideoInputPublic fields)

    @property
    def pixels(self) -> int | None:
        """What the image decodes to (width x height); None until its header was read."""
        return self.width * self.height if self.width and self.height else None


def job_pixels(refs: Iterable[InputRef], limits: ImageLimits) -> int:
    """The pixels a job's inputs decode to together: each image's width x height, and the
    per-image limit for one whose size is not known yet (a URL the relay fetches later),
    so the sum bounds what a worker decodes for the job."""
    return sum(limits.max_pixels if ref.pixels is None else ref.pixels for ref in refs)


def pixels_once_fetched(recorded: int, fetched: Sequence[InputRef], limits: ImageLimits) -> int:
    """A job's decoded pixels once its URL inputs are ``fetched`` (stored, their headers
    read): ``recorded``, the ``job_pixels`` of its inputs at submit, with each of those
    counted at its own size instead of the per-image limit."""
    unread = [replace(ref, width=None, height=None) for ref in fetched]
    return recorded - job_pixels(unread, limits) + job_pixels(fetched, limits)


def decode_data_uri(uri: str, *, name: str, max_bytes: int) -> bytes:
    """The bytes of a ``data:image/...;base64,`` (or ``data:video/...``) URI (413 before
    decoding if too large)."""
    header, comma, encoded = uri.partition(",")
    if not comma:
        raise InvalidRequest(f"{name}: a data: URI needs a ',' before the data.")
    media_type, *params = header.removeprefix("data:").split(";")
    if "base64" not in (p.strip().lower() for p in params):
        raise InvalidRequest(f"{name}: only base64 data: URIs are accepted.")
    media_type = media_type.strip().lower()
    if media_type and media_type not in ACCEPTED_MEDIA_TYPES | VIDEO_MEDIA_TYPES:
        raise UnsupportedMediaType(
            f"{name}: {media_type} is not accepted: use JPEG, PNG or WebP (or for a target "
            "video MP4, MOV, MKV or WebM)."
        )
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


def is_video(head: bytes) -> bool:
    """Whether a file starting with ``head`` (its first 12 bytes or more) is a video
    container this service reads: ISO base media (MP4, MOV) or Matroska (MKV, WebM)."""
    return head[4:8] in _ISO_BOXES or head.startswith(_EBML)


def store_video(
    upload: IO[bytes], *, name: str, limits: VideoLimits, store: ObjectStore
) -> InputRef:
    """Copy a video from ``upload`` (read from where it stands) to a temporary file,
    hashing it on the way; probe it against ``limits``; store it under
    ``input_key(sha256, container)`` (once per content), streamed. Raises the typed
    ``tasks.errors`` video errors (413 too large, 415 container/codec, 422 corrupt/over a
    limit)."""
    with tempfile.NamedTemporaryFile(prefix="faceflow-upload-", suffix=".video") as spool:
        digest, size = _copy_hashed(upload, spool, limit=limits.max_bytes)
        if size == 0:
            raise InvalidRequest(f"{name}: the video is empty.")
        spool.flush()
        return store_spooled_video(Path(spool.name), digest, name=name, limits=limits, store=store)


def store_spooled_video(
    path: Path, digest: str, *, name: str, limits: VideoLimits, store: ObjectStore
) -> InputRef:
    """Probe the video at ``path`` (whose sha256 hex is ``digest``) against ``limits`` and
    store it under ``input_key(digest, container)`` (once per content), streamed: an
    upload's (``store_video``) or a fetched URL's (``webapi.relay.fetch.Spool``)."""
    from tasks.video_io import probe_video  # PyAV: imported on the first video

    info = probe_video(path, limits)
    key = input_key(digest, info.container)
    if not store.exists(key):
        store.put_file(key, path, content_type=VIDEO_CONTENT_TYPES[info.container])
    video = info.model_dump(mode="json", include=set(VIDEO_FIELDS))
    video["audio"] = info.audio is not None
    return InputRef(
        name=name,
        digest=digest,
        key=key,
        width=info.width,
        height=info.height,
        media="video",
        video=video,
    )


def looks_like_video(url: str) -> bool:
    """Whether a URL's path ends in a video file's extension (``.mp4``, ``.mov``, ``.mkv``,
    ``.webm``): a target URL's job then takes a video job's deadline; what the URL serves
    decides the rest once the relay has fetched it."""
    suffix = Path(urlsplit(url).path).suffix.lower().lstrip(".")
    return suffix in VIDEO_CONTENT_TYPES


def _copy_hashed(source: IO[bytes], sink: IO[bytes], *, limit: int) -> tuple[str, int]:
    """Copy ``source`` to ``sink`` in 1 MiB pieces: (sha256 hex, bytes);
    ``VideoTooLarge`` past ``limit`` bytes."""
    digest, size = hashlib.sha256(), 0
    for piece in iter(lambda: source.read(_PIECE), b""):
        size += len(piece)
        if size > limit:
            raise VideoTooLarge(detail=f"more than {limit} bytes")
        digest.update(piece)
        sink.write(piece)
    return digest.hexdigest(), size


def accept_input(
    value: str | bytes | IO[bytes],
    *,
    name: str,
    limits: ImageLimits,
    store: ObjectStore,
    urls: UrlPolicy,
    video_limits: VideoLimits | None = None,
) -> InputRef:
    """One input as given in a request: bytes or a file (multipart), a ``data:`` URI or a
    URL that ``urls`` allows. With ``video_limits`` (the target) a video is accepted too:
    a file or ``data:`` URI whose first bytes are a video container's."""
    if not isinstance(value, str | bytes):  # a multipart file, still spooled
        head = value.read(12)
        value.seek(0)
        if video_limits is not None and is_video(head):
            return store_video(value, name=name, limits=video_limits, store=store)
        data = value.read(limits.max_bytes + 1)
        if len(data) > limits.max_bytes:
            raise PayloadTooLarge(f"{name}: the image exceeds the size limit.")
        value = data
    if isinstance(value, bytes):
        return store_image(value, name=name, limits=limits, store=store)
    text = value.strip()
    if text[:5].lower() == "data:":
        max_bytes = max(limits.max_bytes, video_limits.max_bytes if video_limits else 0)
        data = decode_data_uri(text, name=name, max_bytes=max_bytes)
        if video_limits is not None and is_video(data[:12]):
            return store_video(io.BytesIO(data), name=name, limits=video_limits, store=store)
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
