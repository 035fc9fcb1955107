"""``tasks.recent.Recent``, the one TTL cache (block documents, service-time estimates)."""

from __future__ import annotations

import pytest

from tasks.recent import Recent


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_value_is_kept_for_the_ttl_per_key() -> None:
    clock, looked_up = Clock(), []
    cache: Recent[str, int] = Recent(lambda: 5.0, clock=clock)

    def look_up(key: str) -> int:
        looked_up.append(key)
        return len(looked_up)

    assert cache.get("a", lambda: look_up("a")) == 1
    assert cache.get("b", lambda: look_up("b")) == 2
    clock.now += 4.9
    assert cache.get("a", lambda: look_up("a")) == 1  # fresh: kept
    clock.now += 0.1
    assert cache.get("a", lambda: look_up("a")) == 3  # a TTL old: looked up again
    cache.clear()
    assert cache.get("a", lambda: look_up("a")) == 4
    assert looked_up == ["a", "b", "a", "a"]


def test_a_ttl_of_zero_keeps_nothing_and_a_failed_lookup_is_not_kept() -> None:
    ttl = [0.0]
    cache: Recent[str, str] = Recent(lambda: ttl[0], clock=Clock())
    assert cache.get("k", lambda: "first") == "first"
    assert cache.get("k", lambda: "second") == "second"
    ttl[0] = 30.0  # read on every get: a changed setting counts at once

    def fail() -> str:
        raise ConnectionError("down")

    with pytest.raises(ConnectionError):
        cache.get("k", fail)
    assert cache.get("k", lambda: "third") == "third"
    assert cache.get("k", fail) == "third"
