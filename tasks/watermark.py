"""The invisible watermark in a result's pixels: who made it (this service) and which job.

The payload is 48 bits: a 16-bit service mark (``SERVICE_MARK``) then the job's 32-bit tag
(``job_tag``: the first 32 bits of the job's UUID, a random uuid4, so the verify endpoint
finds the job by a primary-key range). It is embedded with invisible-watermark's DWT-DCT
block coding (each block of the Haar LL band of the luma channel carries one bit in its
largest coefficient, the payload repeated over the whole image), chosen over RivaGAN by
the figures of ``bench/watermark.py`` (docs/provenance.md): the payload survives JPEG q75
and a PNG round trip whole, a halving when read back at twice the size (``detect`` tries
that), costs ~30 ms to embed and ~20 ms to read on a CPU and needs no model; it does not
survive a crop (RivaGAN does, at ~150 times the cost and with torch in the decoder).

A file carries the mark when the decoded 16 service bits equal ``SERVICE_MARK``: an
unmarked photo passes by chance with probability about 2^-15 per ``detect`` (two reads);
none of the sample photos, their crops and re-encodings do (``tests/test_provenance.py``).
Torch-free: the webapi decodes with it. invisible-watermark's package ``__init__`` imports
torch (for RivaGAN), so its DWT-DCT module is loaded from its file (``_max_dct``).
"""

from __future__ import annotations

import importlib.util
import uuid
from dataclasses import dataclass
from functools import cache
from hashlib import sha256
from pathlib import Path
from types import ModuleType

import cv2
import numpy as np
import pywt

from tasks.types import RGBImage

SERVICE_MARK = 0xFA2C
"""The 16 bits that say "made by FaceFlow" (mixed bits, so flat images do not decode to it)."""
SERVICE_BITS = 16
TAG_BITS = 32
PAYLOAD_BITS = SERVICE_BITS + TAG_BITS
MIN_PIXELS = 256 * 256
"""Smallest image the mark goes into (and is looked for in): fewer blocks, too few repeats."""
STEP = 24.0
"""Quantisation step of each block's marked coefficient in the luma band (invisible-
watermark's default marks U instead, which JPEG's chroma subsampling erases:
``bench/watermark.py``)."""


@dataclass(frozen=True, slots=True)
class Payload:
    """What a mark carries: the service mark and a job's tag."""

    service: int
    tag: int

    @property
    def ours(self) -> bool:
        """Whether the service bits are this service's."""
        return self.service == SERVICE_MARK

    def bits(self) -> list[int]:
        """The payload as ``PAYLOAD_BITS`` bits, most significant first."""
        value = (self.service << TAG_BITS) | self.tag
        return [(value >> (PAYLOAD_BITS - 1 - i)) & 1 for i in range(PAYLOAD_BITS)]

    @classmethod
    def from_bits(cls, bits: list[int]) -> Payload:
        """The payload ``bits`` spell (``PAYLOAD_BITS`` of them)."""
        value = 0
        for bit in bits:
            value = (value << 1) | (1 if bit else 0)
        return cls(service=value >> TAG_BITS, tag=value & ((1 << TAG_BITS) - 1))


def job_tag(job_id: str) -> int:
    """A job's 32-bit tag: the first 32 bits of its UUID (a job id that is not a UUID: of
    its SHA-256)."""
    try:
        return uuid.UUID(job_id).int >> 96
    except ValueError:
        return int.from_bytes(sha256(job_id.encode()).digest()[:4], "big")


def tag_range(tag: int) -> tuple[uuid.UUID, uuid.UUID]:
    """The lowest and highest UUID whose tag is ``tag`` (a primary-key range)."""
    low = tag << 96
    return uuid.UUID(int=low), uuid.UUID(int=low | ((1 << 96) - 1))


def payload_for(job_id: str) -> Payload:
    """The payload of a job's result."""
    return Payload(SERVICE_MARK, job_tag(job_id))


def markable(image: RGBImage) -> bool:
    """Whether ``image`` is large enough to carry the mark."""
    return int(image.shape[0]) * int(image.shape[1]) >= MIN_PIXELS


def embed(image: RGBImage, payload: Payload, *, step: float | None = None) -> RGBImage:
    """``image`` (RGB uint8) with ``payload`` in its pixels; an image below ``MIN_PIXELS``
    is returned unchanged (``markable``). invisible-watermark's block coding on the luma
    band, done here in floating point and rounded and clipped once (its own ``encode``
    stores the band back into uint8 unclipped: values past 0 or 255 wrap around)."""
    if not markable(image):
        return image
    step = STEP if step is None else step
    embedder = _max_dct().EmbedMaxDct(payload.bits(), wmLen=PAYLOAD_BITS, scales=[step, 0, 0])
    bgr = cv2.cvtColor(np.ascontiguousarray(image), cv2.COLOR_RGB2BGR)
    yuv = cv2.cvtColor(bgr, cv2.COLOR_BGR2YUV)
    rows, cols = (int(image.shape[0]) // 4) * 4, (int(image.shape[1]) // 4) * 4
    luma = yuv[:rows, :cols, 0].astype(np.float64)
    band, details = pywt.dwt2(luma, "haar")
    embedder.encode_frame(band, step)
    marked = pywt.idwt2((band, details), "haar")
    yuv[:rows, :cols, 0] = np.clip(np.rint(marked), 0, 255).astype(np.uint8)
    rgb = cv2.cvtColor(cv2.cvtColor(yuv, cv2.COLOR_YUV2BGR), cv2.COLOR_BGR2RGB)
    return np.asarray(rgb, dtype=np.uint8)


def read_bits(image: RGBImage) -> list[int] | None:
    """The ``PAYLOAD_BITS`` bits decoded from ``image`` (None below ``MIN_PIXELS``)."""
    if not markable(image):
        return None
    decoder = _max_dct().EmbedMaxDct([], wmLen=PAYLOAD_BITS, scales=[STEP, 0, 0])
    bgr = cv2.cvtColor(np.ascontiguousarray(image), cv2.COLOR_RGB2BGR)
    return [int(b) for b in decoder.decode(bgr)]


def detect(image: RGBImage) -> Payload | None:
    """This service's payload in ``image``, or None when it carries no mark of ours. Read
    as it is, then scaled up 2x (a result shrunk to half, as a thumbnail or a messenger
    preview does, reads back at its marked size)."""
    for scale in (1, 2):
        if scale == 1:
            candidate = image
        else:
            size = (int(image.shape[1]) * scale, int(image.shape[0]) * scale)
            candidate = np.asarray(
                cv2.resize(image, size, interpolation=cv2.INTER_CUBIC), dtype=np.uint8
            )
        bits = read_bits(candidate)
        if bits is not None and (payload := Payload.from_bits(bits)).ours:
            return payload
    return None


@cache
def _max_dct() -> ModuleType:
    """invisible-watermark's DWT-DCT module, loaded from its file: the package's
    ``__init__`` imports RivaGAN's module, which imports torch."""
    spec = importlib.util.find_spec("imwatermark")  # finds, does not import, the package
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("invisible-watermark is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / "maxDct.py"
    module_spec = importlib.util.spec_from_file_location("faceflow_imwatermark_maxdct", path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module
