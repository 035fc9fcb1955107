"""``blocks.storage.write_to`` on the local storage block replaces an object whole: a reader
never sees part of it (progress records and chunk lists are rewritten while others read)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from blocks.storage import read_from, write_to
from tests.stores import local_store


def test_a_reader_never_sees_half_an_object(tmp_path: Path) -> None:
    store = local_store(tmp_path)
    key = "results/job/attempt-1.progress.json"
    write_to(store, key, json.dumps({"n": 0, "pad": "x" * 200_000}).encode())
    stop = threading.Event()
    torn: list[int] = []

    def read() -> None:
        while not stop.is_set():
            try:
                json.loads(read_from(store, key))
            except json.JSONDecodeError:
                torn.append(1)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for n in range(1, 300):
            write_to(store, key, json.dumps({"n": n, "pad": "x" * (200_000 + n)}).encode())
    finally:
        stop.set()
        reader.join()
    assert torn == []
    assert json.loads(read_from(store, key))["n"] == 299
    assert [p.name for p in (tmp_path / "results" / "job").iterdir()] == [
        "attempt-1.progress.json"
    ]  # no temporary file left
