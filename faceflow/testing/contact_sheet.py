"""The layout of the contact sheet ``docs/look.jpg``, which ``bench/contact_sheet.py``
draws and ``tests/test_look.py`` checks: the pairs, the columns, the tile and header sizes,
and the byte budget its JPEG must fit."""

from __future__ import annotations

import cv2

from tasks.types import RGBImage

PAIRS = (
    ("astronaut", "grace_hopper"),  # glasses and a cap's brim on the target
    ("astronaut", "t1-1@crop"),  # a source lit from the front onto a face lit from the side
    ("t1-5@crop", "t1-4@crop"),  # the source's long hair
    ("t1-4@crop", "t1-1@crop"),  # a rolled target the second detector used to lose
    ("t1-1@crop", "t1-3@crop"),  # the target's shadows, no longer kept as occluders
)
COLUMNS = ("target", "result", "without look options", "source")
TILE = 200
HEADER = 28
MAX_BYTES = 300_000


def encode_small(sheet: RGBImage, max_bytes: int = MAX_BYTES) -> bytes:
    """``sheet`` as a JPEG at the highest quality (85 down, by 5) under ``max_bytes``."""
    bgr = cv2.cvtColor(sheet, cv2.COLOR_RGB2BGR)
    for quality in range(85, 20, -5):
        ok, data = cv2.imencode(".jpg", bgr, [cv2.IMWRITE_JPEG_QUALITY, quality])
        if ok and len(data) < max_bytes:
            return bytes(data)
    raise ValueError(f"the contact sheet does not fit {max_bytes} bytes")
