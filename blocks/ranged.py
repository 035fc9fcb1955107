"""An object read in place by byte ranges: a seekable read-only file over ranged reads.

FFmpeg (PyAV's ``av.open(fileobj)``) reads a container in small pieces (32 KiB) and
seeks: to the index (an MP4's ``moov`` may sit at the end), then to the keyframe before
the frames a part decodes. :class:`RangedSource` serves those reads from a small LRU cache
of fixed-size blocks, each fetched whole by one ranged read (an S3 ``GET`` with a
``Range`` header: ``blocks.storage.read_in_place``), so a part that decodes ten seconds
of a long video fetches those seconds and the index, not the object.

Every :meth:`RangedSource.open` gives a new file (its own position) over the one cache:
the index read by the first open is not fetched again by the next.
"""

from __future__ import annotations

import io
import threading
from collections import OrderedDict
from collections.abc import Callable

BLOCK_SIZE = 2 << 20
"""Bytes per fetched block: a few requests for a ten-second chunk of a 1080p video."""
MAX_BLOCKS = 16
"""Blocks kept (least recently used dropped): memory stays under 32 MiB per source."""

Fetch = Callable[[int, int], bytes]
"""``fetch(start, stop)``: the object's bytes ``[start, stop)`` (raises typed errors)."""


class RangedSource:
    """An object of ``size`` bytes read through ``fetch`` in blocks of ``block_size``,
    the last ``max_blocks`` kept; ``name`` (and ``str()``) names it in messages.
    ``requests`` and ``fetched_bytes`` count what was fetched."""

    def __init__(
        self,
        name: str,
        size: int,
        fetch: Fetch,
        *,
        block_size: int = BLOCK_SIZE,
        max_blocks: int = MAX_BLOCKS,
    ) -> None:
        if block_size < 1 or max_blocks < 1:
            raise ValueError("block_size and max_blocks must be positive")
        self.name, self.size, self.block_size, self.max_blocks = name, size, block_size, max_blocks
        self.requests = self.fetched_bytes = 0
        self._fetch = fetch
        self._blocks: OrderedDict[int, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def __str__(self) -> str:
        return self.name

    def open(self) -> RangedFile:
        """A new seekable read-only binary file at offset 0."""
        return RangedFile(self)

    def read(self, offset: int, n: int) -> bytes:
        """Up to ``n`` bytes from ``offset`` (fewer at the end of the object)."""
        stop = min(offset + max(n, 0), self.size)
        pieces = []
        while offset < stop:
            index, skip = divmod(offset, self.block_size)
            block = self._block(index)
            piece = block[skip : skip + stop - offset]
            if not piece:
                break  # the object is shorter than it said
            pieces.append(piece)
            offset += len(piece)
        return b"".join(pieces)

    def _block(self, index: int) -> bytes:
        with self._lock:
            block = self._blocks.get(index)
            if block is not None:
                self._blocks.move_to_end(index)
                return block
            start = index * self.block_size
            block = self._fetch(start, min(start + self.block_size, self.size))
            self.requests += 1
            self.fetched_bytes += len(block)
            self._blocks[index] = block
            while len(self._blocks) > self.max_blocks:
                self._blocks.popitem(last=False)
            return block


class RangedFile(io.RawIOBase):
    """A position in a :class:`RangedSource`: read-only, seekable (``SEEK_END`` too)."""

    def __init__(self, source: RangedSource) -> None:
        super().__init__()
        self.source, self.position = source, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.source.size}
        if whence not in base:
            raise ValueError(f"whence {whence}")
        if base[whence] + offset < 0:
            raise ValueError(f"seek before the start: {base[whence] + offset}")
        self.position = base[whence] + offset
        return self.position

    def read(self, size: int | None = -1) -> bytes:
        """Up to ``size`` bytes (all that is left when ``size`` is negative or None)."""
        left = self.source.size - self.position
        data = self.source.read(self.position, left if size is None or size < 0 else size)
        self.position += len(data)
        return data

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)
