"""Model registry: files located without network, pinned by SHA-256, typed errors."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import pytest

from tasks import registry
from tasks.errors import ModelUnavailable
from tasks.models import ModelCache


def test_every_model_is_data_with_a_pin_and_licence() -> None:
    assert set(registry.REGISTRY) == set(registry.MODEL_NAMES)
    for name, spec in registry.REGISTRY.items():
        assert spec.name == name
        if spec.sha256 is None:  # only an operator's own file may go unpinned here
            assert spec.origin == "model_dir", name
        else:
            assert len(spec.sha256) == 64 and int(spec.sha256, 16) >= 0
        assert spec.licence and spec.source and spec.filename


def test_mtcnn_weights_resolve_from_the_wheel_without_importing_it() -> None:
    for name in ("mtcnn-pnet", "mtcnn-rnet", "mtcnn-onet"):
        path = registry.resolve(name)  # type: ignore[arg-type]
        assert path.is_file()
        assert "facenet_pytorch" in path.parts
    assert "facenet_pytorch" not in sys.modules


def test_missing_operator_model_names_file_and_hash(tmp_path: Path) -> None:
    with pytest.raises(ModelUnavailable) as info:
        registry.resolve("inswapper-128", directory=tmp_path)
    message = str(info.value)
    assert "inswapper_128.onnx" in message
    pinned = registry.REGISTRY["inswapper-128"].sha256
    assert pinned is not None and pinned in message
    assert info.value.code == "model_unavailable" and info.value.permanent


def test_hash_mismatch_is_refused_and_pin_override_accepted(tmp_path: Path) -> None:
    target = tmp_path / "buffalo_l" / "det_10g.onnx"
    target.parent.mkdir()
    target.write_bytes(b"not the real detector")
    with pytest.raises(ModelUnavailable) as info:
        registry.resolve("scrfd-10g", directory=tmp_path)
    assert "det_10g.onnx" in str(info.value)
    pinned = registry.REGISTRY["scrfd-10g"].sha256
    assert pinned is not None and pinned in str(info.value)
    digest = hashlib.sha256(target.read_bytes()).hexdigest()
    assert registry.resolve("scrfd-10g", directory=tmp_path, pins={"scrfd-10g": digest}) == target
    # A file changed after verification is verified again (cache keyed by size and mtime).
    target.write_bytes(b"tampered detector bytes!")
    with pytest.raises(ModelUnavailable):
        registry.resolve("scrfd-10g", directory=tmp_path, pins={"scrfd-10g": digest})


def test_model_dir_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(registry.MODEL_DIR_ENV, str(tmp_path))
    assert registry.model_dir() == tmp_path
    status = registry.model_status("arcface-w600k-r50")
    assert not status.present and not status.verified
    assert status.path == tmp_path / "buffalo_l" / "w600k_r50.onnx"


def test_model_cache_loads_once_per_key_and_clears() -> None:
    cache = ModelCache()
    calls: list[str] = []

    def loader() -> object:
        calls.append("load")
        return object()

    first = cache.get(("m", "cpu", None), loader)
    assert cache.get(("m", "cpu", None), loader) is first
    cache.get(("m", "cuda", None), loader)
    assert len(calls) == 2 and cache.total_loads("m") == 2
    cache.clear()
    assert ("m", "cpu", None) not in cache
    assert cache.get(("m", "cpu", None), loader) is not first
    assert cache.total_loads() == 3


def test_bundled_libraries_carry_their_licence() -> None:
    from importlib.metadata import version

    pyav = registry.LIBRARIES["pyav"]
    assert "GPL" in pyav.licence and "x264" in pyav.licence
    assert version(pyav.distribution).startswith("18.")  # the build the licence describes
    for library in registry.LIBRARIES.values():
        assert library.licence and library.source and library.description
