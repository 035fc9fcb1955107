"""The torch port of dlib's face-recognition ResNet against dlib itself, and bad files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tasks import registry
from tasks.detect import detect_faces
from tasks.dlib_resnet import load_dlib_resnet
from tasks.errors import ModelUnavailable
from tasks.identity import forward_dlib, load_dlib_embedder, load_dlib_shaper, prepare_dlib
from tests import samples


@pytest.fixture(scope="module")
def t1_chips() -> list[np.ndarray]:
    """dlib's 150 x 150 chips of the six faces in t1."""
    image = samples.t1_rgb()
    shaper = load_dlib_shaper()
    faces = detect_faces(image, detector="mtcnn", device="cpu")
    assert len(faces) == 6
    return [prepare_dlib(shaper, image, face) for face in faces]


def dlib_descriptors(chips: list[np.ndarray]) -> np.ndarray:
    """dlib's own network on ``chips`` (no jitter: dlib's default num_jitters)."""
    import dlib

    net = dlib.face_recognition_model_v1(str(registry.resolve("dlib-resnet-v1")))
    return np.array([np.asarray(v) for v in net.compute_face_descriptor(chips)], np.float32)


def test_torch_port_matches_dlib_on_real_chips(t1_chips: list[np.ndarray]) -> None:
    expected = dlib_descriptors(t1_chips)
    got = forward_dlib(load_dlib_embedder("cpu"), t1_chips)
    assert got.shape == expected.shape == (6, 128) and got.dtype == np.float32
    assert np.abs(got - expected).max() < 1e-3
    one = forward_dlib(load_dlib_embedder("cpu"), t1_chips[:1])  # a batch of one
    assert np.abs(one[0] - expected[0]).max() < 1e-3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_torch_port_matches_dlib_on_cuda(t1_chips: list[np.ndarray]) -> None:
    net = load_dlib_resnet(registry.resolve("dlib-resnet-v1")).to("cuda")
    assert np.abs(forward_dlib(net, t1_chips) - dlib_descriptors(t1_chips)).max() < 1e-3


def test_unreadable_files_are_model_unavailable(tmp_path: Path) -> None:
    data = registry.resolve("dlib-resnet-v1").read_bytes()
    truncated = tmp_path / "truncated.dat"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelUnavailable, match="truncated") as info:
        load_dlib_resnet(truncated)
    assert info.value.permanent
    corrupted = tmp_path / "corrupted.dat"
    corrupted.write_bytes(data.replace(b"affine_", b"affinX_", 1))
    with pytest.raises(ModelUnavailable, match="unsupported layer 'affinX_'"):
        load_dlib_resnet(corrupted)
    with pytest.raises(ModelUnavailable, match="not a readable dlib ResNet"):
        load_dlib_resnet(registry.resolve("dlib-shape-5"))  # a dlib file, not this network
    with pytest.raises(ModelUnavailable):
        load_dlib_resnet(tmp_path / "missing.dat")
