"""``Closing``: a resource whose ``with`` block ends by closing it (HTTP clients, spools)."""

from __future__ import annotations

from typing import Self


class Closing:
    """Base of a resource with ``close()``: ``with`` gives the resource itself and closes it
    on the way out, whether the block ended or raised."""

    def close(self) -> None:
        """Release what the resource holds (subclasses say what)."""
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
