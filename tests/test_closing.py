"""``tasks.closing.Closing``: ``with`` gives the resource and closes it however it ends."""

from __future__ import annotations

import pytest

from tasks.closing import Closing


class Resource(Closing):
    def __init__(self) -> None:
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


def test_a_with_block_gets_the_resource_and_closes_it_once_however_it_ends() -> None:
    with Resource() as resource:
        assert isinstance(resource, Resource) and resource.closed == 0
    assert resource.closed == 1
    failing = Resource()
    with pytest.raises(KeyError), failing:
        raise KeyError("boom")
    assert failing.closed == 1
