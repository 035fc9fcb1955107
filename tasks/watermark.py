"""The invisible watermark in a result's pixels: who made it (this service) and which job.

The payload is 48 bits: a 16-bit service mark (``SERVICE_MARK``) then the job's 32-bit tag
(``job_tag``: the first 32 bits of the job's UUID, a random uuid4, so the verify endpoint
finds the job by a primary-key range). It is embedded with invisible-watermark's DWT-DCT
block coding (each block of the Haar LL band of the luma channel carries one bit in its
largest coefficient, the payload repeated over the whole image), chosen over RivaGAN by
the figures of ``bench/watermark.py`` (docs/provenance.md): the payload survives JPEG q75
and a PNG round trip whole, a halving when read back at twice the size (``detect`` tries
that), costs a few ms to embed and to read on a CPU (its block coding done here with numpy
over all blocks at once) and needs no model; it does not survive a crop (RivaGAN does, at
~150 times the cost and with torch in the decoder).

Video frames carry the same payload in a code of their own (``VIDEO``, ``VideoCode``):
coarser blocks, a mean-relative feature and soft votes, read over several frames
(``read_video``), made to survive H.264 at CRF 18 and re-encoding (``bench/video_mark.py``).

A file carries the mark when the decoded 16 service bits equal ``SERVICE_MARK``: an
unmarked photo passes by chance with probability about 2^-15 per ``detect`` (two reads);
none of the sample photos, their crops and re-encodings do (``tests/test_provenance.py``).
Torch-free and model-free: the webapi decodes with it (numpy and OpenCV only).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from hashlib import sha256
from typing import Any

import cv2
import numpy as np
import numpy.typing as npt

from tasks.types import RGBImage

F64 = npt.NDArray[np.float64]
I16 = npt.NDArray[np.int16]

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


BLOCK = 4
"""Side of the photo code's blocks in the Haar LL band (invisible-watermark's)."""


def embed(image: RGBImage, payload: Payload, *, step: float | None = None) -> RGBImage:
    """``image`` (RGB uint8) with ``payload`` in its pixels; an image below ``MIN_PIXELS``
    is returned unchanged (``markable``). invisible-watermark's block coding on the luma
    band (each 4x4 block's largest non-first coefficient quantised to carry its bit), done
    here with numpy over all blocks at once, in floating point, rounded and clipped once
    (its own ``encode`` loops per block and stores the band back into uint8 unclipped:
    values past 0 or 255 wrap around)."""
    if not markable(image):
        return image
    step = STEP if step is None else step
    yuv = cv2.cvtColor(np.ascontiguousarray(image), cv2.COLOR_RGB2YUV)
    luma = yuv[..., 0]
    band = _haar_band(luma)
    blocks, flat, pos = _largest(band)
    rows = np.arange(len(flat))
    bits = np.asarray(payload.bits(), dtype=np.float64)[_bit_index(len(flat))]
    value = flat[rows, pos]
    quantised = (np.abs(value) // step + 0.25 + 0.5 * bits) * step
    change = np.zeros_like(flat)
    change[rows, pos] = np.where(value >= 0, quantised, -quantised) - value
    # A change of the band alone: each 2x2 cell of pixels moves by half of its coefficient's.
    cells = _unblock(change, blocks) / 2.0
    h, w = cells.shape[0] * 2, cells.shape[1] * 2
    marked = luma[:h, :w] + np.repeat(np.repeat(cells, 2, axis=0), 2, axis=1)
    luma[:h, :w] = np.clip(np.rint(marked), 0, 255).astype(np.uint8)
    return np.asarray(cv2.cvtColor(yuv, cv2.COLOR_YUV2RGB), dtype=np.uint8)


def read_bits(image: RGBImage) -> list[int] | None:
    """The ``PAYLOAD_BITS`` bits decoded from ``image`` (None below ``MIN_PIXELS``): each
    bit the majority of its blocks (invisible-watermark's decoding, vectorised)."""
    if not markable(image):
        return None
    band = _haar_band(cv2.cvtColor(np.ascontiguousarray(image), cv2.COLOR_RGB2YUV)[..., 0])
    _, flat, pos = _largest(band)
    value = np.abs(flat[np.arange(len(flat)), pos])
    votes = (value % STEP > 0.5 * STEP).astype(np.float64)
    index = _bit_index(len(flat))
    means = np.bincount(index, votes, PAYLOAD_BITS) / np.bincount(index, None, PAYLOAD_BITS)
    return [int(m * 255 > 127) for m in means]


def _haar_band(luma: npt.NDArray[Any]) -> F64:
    """The Haar LL band of ``luma`` cropped to a multiple of 4 (``pywt.dwt2``'s, done as
    the sum of each 2x2 cell over 2)."""
    rows, cols = (luma.shape[0] // 4) * 4, (luma.shape[1] // 4) * 4
    cells = luma[:rows, :cols].astype(np.float64).reshape(rows // 2, 2, cols // 2, 2)
    return np.asarray(cells.sum(axis=(1, 3)) / 2.0, dtype=np.float64)


def _largest(band: F64) -> tuple[tuple[int, int], F64, npt.NDArray[np.intp]]:
    """The band's whole 4x4 blocks, row by row, as rows of 16 values, and in each the
    position of the largest magnitude after the first."""
    blocks = (band.shape[0] // BLOCK, band.shape[1] // BLOCK)
    flat = (
        band[: blocks[0] * BLOCK, : blocks[1] * BLOCK]
        .reshape(blocks[0], BLOCK, blocks[1], BLOCK)
        .swapaxes(1, 2)
        .reshape(-1, BLOCK * BLOCK)
        .astype(np.float64)
    )
    return blocks, flat, np.argmax(np.abs(flat[:, 1:]), axis=1) + 1


def _unblock(flat: F64, blocks: tuple[int, int]) -> F64:
    return (
        flat.reshape(blocks[0], blocks[1], BLOCK, BLOCK)
        .swapaxes(1, 2)
        .reshape(blocks[0] * BLOCK, blocks[1] * BLOCK)
    )


def _bit_index(count: int) -> npt.NDArray[np.intp]:
    """Which payload bit each of ``count`` blocks carries (the payload repeated)."""
    return np.arange(count) % PAYLOAD_BITS


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


@dataclass(frozen=True, slots=True)
class VideoCode:
    """The watermark of video frames: a coarser, mean-relative code with soft votes, made
    to survive H.264 (our CRF 18 encode, and re-encoding at a fraction of its bitrate).

    Each 16x16-pixel block (a 4x4 block of the level-2 Haar LL band) carries one bit in
    its diagonal contrast ``f = tl + br - tr - bl`` of its four 8x8 quadrant means: relative
    to the block's mean (a brightness change leaves it), and low-frequency enough for the
    codec's quantiser to keep. ``f`` is quantised (QIM) onto ``(k + 1/4) step`` for a 0
    and ``(k + 3/4) step`` for a 1 by moving each quadrant by a whole number of levels
    (``Δf`` rounded, split evenly: a constant per 8x8 quadrant, which the codec's 8x8 and
    4x4 transforms keep as DC terms, cheaply; where a pixel would clip, the other
    quadrants take the move; luma only: the same change on R, G and B). A reader's vote
    per block is soft, in [-1/2, 1/2] by the distance of ``f`` to the two lattices, summed
    per bit over the frame's blocks (and over frames: ``read_video``).

    The step shrinks with the frame's size (``step_for``): a larger frame has more blocks
    per bit, so each may carry less; the mark then costs the encoder fewer bytes (720p:
    step 8, 480x360: 12; ``bench/video_mark.py``). Reader and writer see the same size."""

    step: float = 12.0
    """The step of a frame with ``reference_blocks`` blocks or fewer."""
    min_step: float = 8.0
    reference_blocks: int = 660
    """Blocks of a 480x360 frame."""
    quadrant: int = 8

    def step_for(self, rows: int, cols: int) -> float:
        """The step of a frame of ``rows`` x ``cols`` blocks: ``step`` scaled by the
        square root of ``reference_blocks`` over its blocks, at least ``min_step``."""
        scale = (self.reference_blocks / max(rows * cols, 1)) ** 0.5
        return max(self.min_step, min(self.step, self.step * scale))

    @property
    def block(self) -> int:
        """Side of a block in pixels."""
        return 2 * self.quadrant

    def embed(self, frame: RGBImage, payload: Payload) -> RGBImage:
        """``frame`` (RGB uint8) with ``payload`` in its pixels (below ``MIN_PIXELS``:
        unchanged)."""
        if not markable(frame):
            return frame
        rows, cols = self._blocks(frame)
        f = self._contrast(frame, rows, cols)
        bits = np.asarray(payload.bits(), dtype=np.float64)[_bit_index(f.size)].reshape(f.shape)
        offset = 0.25 + 0.5 * bits
        step = self.step_for(rows, cols)
        target = (np.round(f / step - offset) + offset) * step
        # The change in whole levels, split over the quadrants as evenly as whole levels
        # split: each 8x8 quadrant moves by one constant (a change of its DC alone).
        change = np.rint(target - f).astype(np.int16)
        moves = _split(change, *self._room(frame, rows, cols))
        cells = np.empty((rows, 2, cols, 2), dtype=np.int16)
        cells[:, 0, :, 0], cells[:, 1, :, 1] = moves[..., 0], moves[..., 1]
        cells[:, 0, :, 1], cells[:, 1, :, 0] = moves[..., 2], moves[..., 3]
        h, w = rows * self.block, cols * self.block
        grid = cells.reshape(rows * 2, cols * 2)
        out = np.array(frame, dtype=np.uint8, copy=True)
        region: npt.NDArray[Any] = np.ascontiguousarray(out[:h, :w])
        for sign in (1, -1):  # saturating uint8 adds: the room computed keeps them exact
            part = np.clip(sign * grid, 0, 255).astype(np.uint8)
            full = cv2.resize(part, (w, h), interpolation=cv2.INTER_NEAREST)
            planes = cv2.merge([full, full, full])
            region = cv2.add(region, planes) if sign > 0 else cv2.subtract(region, planes)
        out[:h, :w] = region
        return out

    def scores(self, frame: RGBImage) -> F64 | None:
        """Per payload bit, the sum of its blocks' soft votes in ``frame`` (> 0: a 1);
        None below ``MIN_PIXELS``."""
        if not markable(frame):
            return None
        rows, cols = self._blocks(frame)
        f = self._contrast(frame, rows, cols).ravel()
        phase = (
            np.mod(f / self.step_for(rows, cols) - 0.75 + 0.5, 1.0) - 0.5
        )  # distance to the 1s' lattice
        votes = 0.5 - 2.0 * np.abs(phase)
        return np.asarray(np.bincount(_bit_index(f.size), votes, PAYLOAD_BITS), dtype=np.float64)

    def _room(self, frame: RGBImage, rows: int, cols: int) -> tuple[I16, I16]:
        """Per block and quadrant (tl, br, tr, bl), how far the quadrant's contribution to
        ``f`` may go down and up before a pixel clips at 0 or 255."""
        h, w, q = rows * self.block, cols * self.block, self.quadrant
        channels = cv2.split(np.ascontiguousarray(frame[:h, :w]))
        brightest = cv2.max(cv2.max(channels[0], channels[1]), channels[2])
        darkest = cv2.min(cv2.min(channels[0], channels[1]), channels[2])
        kernel = np.ones((q, q), np.uint8)
        anchor = (0, 0)  # each output pixel: the q x q window from it down and right
        high = cv2.dilate(brightest, kernel, anchor=anchor)[::q, ::q].astype(np.int16)
        low = cv2.erode(darkest, kernel, anchor=anchor)[::q, ::q].astype(np.int16)
        high, low = high.reshape(rows, 2, cols, 2), low.reshape(rows, 2, cols, 2)
        up = 255 - high
        order = ((0, 0), (1, 1), (0, 1), (1, 0))
        ups = np.stack([up[:, i, :, j] for i, j in order], axis=-1)
        downs = np.stack([low[:, i, :, j] for i, j in order], axis=-1)
        sign = np.array([1, 1, -1, -1], dtype=np.int16)
        # A quadrant of sign +1 adds its move to f; one of sign -1 subtracts it.
        lowest = np.where(sign > 0, -downs, -ups)
        highest = np.where(sign > 0, ups, downs)
        return lowest.astype(np.int16), highest.astype(np.int16)

    def _blocks(self, frame: RGBImage) -> tuple[int, int]:
        return int(frame.shape[0]) // self.block, int(frame.shape[1]) // self.block

    def _contrast(self, frame: RGBImage, rows: int, cols: int) -> F64:
        """Each block's diagonal contrast of its quadrant means (luma, in levels)."""
        h, w = rows * self.block, cols * self.block
        luma = cv2.cvtColor(np.ascontiguousarray(frame[:h, :w]), cv2.COLOR_RGB2GRAY)
        means = cv2.resize(
            luma.astype(np.float32), (cols * 2, rows * 2), interpolation=cv2.INTER_AREA
        )
        q = means.astype(np.float64).reshape(rows, 2, cols, 2)
        return np.asarray(q[:, 0, :, 0] + q[:, 1, :, 1] - q[:, 0, :, 1] - q[:, 1, :, 0])


VIDEO = VideoCode()
"""The video frames' code (``VideoCode``); photos keep the block code of ``embed``."""


def _split(change: I16, lowest: I16, highest: I16) -> I16:
    """``change`` (per block) split over the four quadrants' contributions as evenly as
    whole levels split, each within its ``[lowest, highest]`` (no pixel clips): what one
    quadrant cannot take the others take. Returns the quadrants' moves (a contribution
    times the quadrant's sign: tl, br up; tr, bl down for a positive contribution)."""
    given = np.zeros((*change.shape, 4), dtype=np.int16)
    left = change.copy()
    for _ in range(4):
        want = left[..., None]
        room = np.where(want > 0, highest - given, given - lowest)
        able = (room > 0) & (want != 0)
        count = able.sum(axis=-1, keepdims=True)
        share = np.where(able, -(-np.abs(want) // np.maximum(count, 1)), 0)
        step = np.sign(want) * np.minimum(share, np.maximum(room, 0))
        step = np.where(np.cumsum(np.abs(step), axis=-1) > np.abs(want), 0, step)
        given = given + step.astype(np.int16)
        left = change - given.sum(axis=-1).astype(np.int16)
    return given * np.array([1, 1, -1, -1], dtype=np.int16)


def read_video(runs: Iterable[Iterable[RGBImage]], code: VideoCode | None = None) -> Payload | None:
    """This service's payload in a video's frames, or None: each run (a few consecutive
    frames) sums its frames' soft votes into bits, and each bit is the majority of the
    runs'. A run with no markable frame does not vote."""
    decided: list[F64] = []
    for frames in runs:
        total: F64 | None = None
        for frame in frames:
            scores = (code or VIDEO).scores(frame)
            if scores is not None:
                total = scores if total is None else total + scores
        if total is not None:
            decided.append((total > 0).astype(np.float64))
    if not decided:
        return None
    bits = [int(v) for v in (np.mean(decided, axis=0) > 0.5)]
    payload = Payload.from_bits(bits)
    return payload if payload.ours else None
