"""Content Credentials (C2PA) on results: the signed manifest, and reading one back.

A result's manifest says what it is, for platforms that label AI media and for the EU AI
Act's machine-readable marking (Art. 50(2)): one ``c2pa.created`` action with the IPTC
digital source type ``compositeWithTrainedAlgorithmicMedia``, FaceFlow and its version as
the claim generator, and one ingredient per input image that names its role and SHA-256
(``instance_id = "sha256:<hex>"``; never the input's bytes or a thumbnail of it: inputs
are personal photos that retention deletes). The manifest is embedded in the file (JPEG,
PNG, WebP, MP4) and signed with the operator's certificate chain and key (ES256;
``blocks.signing``); no thumbnail is added (≈ 3.4 KB per result).

Torch-free and Prefect-free: the workers sign with it, the webapi reads with it.
"""

from __future__ import annotations

import hashlib
import io
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import IO, Any

import c2pa

from tasks import watermark
from tasks.errors import FaceFlowError, MarkingFailed, UnsupportedFormat
from tasks.images import decode_image, sniff_format
from tasks.options import ImageLimits, VideoLimits
from tasks.types import RGBImage

DIGITAL_SOURCE_TYPE = (
    "http://cv.iptc.org/newscodes/digitalsourcetype/compositeWithTrainedAlgorithmicMedia"
)
CLAIM_GENERATOR = "FaceFlow"
_NO_THUMBNAIL = {"builder": {"thumbnail": {"enabled": False}}}


def dev_root_path(home: Path) -> Path:
    """Where the local stack keeps its development root certificate (PEM; the signing
    chain and key beside it: ``blocks.signing.dev_chain``)."""
    return home / "c2pa" / "root.pem"


@cache
def service_version() -> str:
    """FaceFlow's installed version (the claim generator's)."""
    try:
        return metadata.version("faceflow")
    except metadata.PackageNotFoundError:  # pragma: no cover - run from a bare checkout
        return "0.0.0"


@dataclass(frozen=True, slots=True)
class Credentials:
    """A signing certificate chain (leaf first, PEM) and its private key (PEM)."""

    cert_chain_pem: str
    private_key_pem: str


@dataclass(frozen=True, slots=True)
class Ingredient:
    """An input of a result as its manifest names it: role, media type, SHA-256 (hex)."""

    role: str
    mime: str
    sha256: str

    @classmethod
    def of(cls, role: str, data: bytes, mime: str) -> Ingredient:
        """The ingredient for input bytes ``data``."""
        return cls(role, mime, hashlib.sha256(data).hexdigest())


def input_ingredients(
    sources: Sequence[bytes], target: bytes | Ingredient, references: Sequence[bytes] = ()
) -> list[Ingredient]:
    """A job's inputs as ingredients: ``source``, ``target``, ``source 2``…,
    ``reference 0``…; a target given as an ``Ingredient`` is taken as it is (a video,
    hashed as a file)."""

    def of(role: str, data: bytes) -> Ingredient:
        return Ingredient.of(role, data, sniff_media_type(data) or "application/octet-stream")

    first, *extra = sources
    return [
        of("source", first),
        target if isinstance(target, Ingredient) else of("target", target),
        *(of(f"source {i + 2}", data) for i, data in enumerate(extra)),
        *(of(f"reference {i}", data) for i, data in enumerate(references)),
    ]


def manifest_definition(mime: str, ingredients: list[Ingredient]) -> dict[str, Any]:
    """The manifest a result gets (c2pa's manifest definition JSON)."""
    agent = {"name": CLAIM_GENERATOR, "version": service_version()}
    return {
        "claim_generator_info": [agent],
        "format": mime,
        "ingredients": [
            {
                "title": i.role,
                "format": i.mime,
                "relationship": "componentOf",
                "instance_id": f"sha256:{i.sha256}",
            }
            for i in ingredients
        ],
        "assertions": [
            {
                "label": "c2pa.actions",
                "data": {
                    "actions": [
                        {
                            "action": "c2pa.created",
                            "digitalSourceType": DIGITAL_SOURCE_TYPE,
                            "softwareAgent": agent,
                        }
                    ]
                },
            }
        ],
    }


def sign(data: bytes, mime: str, credentials: Credentials, ingredients: list[Ingredient]) -> bytes:
    """``data`` (an encoded result) with its signed manifest embedded; ``MarkingFailed``
    when c2pa refuses the certificate, the key or the file."""
    out = io.BytesIO()
    _sign_stream(io.BytesIO(data), out, mime, credentials, ingredients)
    return out.getvalue()


def sign_file(
    source: Path, dest: Path, mime: str, credentials: Credentials, ingredients: list[Ingredient]
) -> None:
    """Write ``source`` with its signed manifest to ``dest`` (streamed: a video is never
    held whole in memory); ``MarkingFailed`` as ``sign``."""
    with source.open("rb") as src, dest.open("w+b") as out:
        _sign_stream(src, out, mime, credentials, ingredients)


def _sign_stream(
    src: IO[bytes],
    out: IO[bytes],
    mime: str,
    credentials: Credentials,
    ingredients: list[Ingredient],
) -> None:
    try:
        info = c2pa.C2paSignerInfo(
            c2pa.C2paSigningAlg.ES256,
            credentials.cert_chain_pem.encode(),
            credentials.private_key_pem.encode(),
            None,
        )
        with (
            c2pa.Signer.from_info(info) as signer,
            c2pa.Context.from_dict(_NO_THUMBNAIL) as context,
            c2pa.Builder(manifest_definition(mime, ingredients), context) as builder,
        ):
            builder.sign(signer, mime, src, out)
    except (c2pa.C2paError, ValueError, TypeError) as exc:
        raise MarkingFailed(detail=f"{type(exc).__name__}: {str(exc)[:200]}") from exc


@dataclass(frozen=True, slots=True)
class ManifestReport:
    """What a file's Content Credentials say: whether there are any, whether they
    validate (signature and content hashes; ``trusted``: the chain ends at one of the
    given trust anchors), who signed, which generator made it."""

    present: bool
    valid: bool = False
    trusted: bool = False
    state: str | None = None
    """c2pa's validation state: ``Invalid``, ``Valid`` or ``Trusted``."""
    signer: str | None = None
    issuer: str | None = None
    claim_generator: str | None = None
    digital_source_type: str | None = None
    failures: list[str] = field(default_factory=list)
    """Validation failure codes (``assertion.dataHash.mismatch`` for a changed image)."""

    @property
    def ours(self) -> bool:
        """Whether the manifest is valid and names FaceFlow as its claim generator."""
        return self.valid and self.claim_generator == CLAIM_GENERATOR


_NO_MANIFEST = {"manifestnotfound", "notsupported", "io", "other", "filenotfound", "encoding"}
"""c2pa errors that say nothing about a manifest (none found, or the file unreadable)."""
_TRUST_FAILURES = {"signingCredential.untrusted"}
"""Failures that say only that the signer is not among the trust anchors."""


def read_manifest(
    data: bytes, mime: str | None, trust_anchors: str | None = None
) -> ManifestReport:
    """The Content Credentials of ``data`` (``mime``: its media type, or None to sniff).
    ``trust_anchors``: PEM certificates the signer's chain must end at to be ``trusted``.
    A file whose manifest is damaged, or whose content changed after signing, is present
    and not valid."""
    settings: dict[str, Any] = {"verify": {"verify_trust": bool(trust_anchors)}}
    if trust_anchors:
        settings["trust"] = {"user_anchors": trust_anchors}
    try:
        with (
            c2pa.Context.from_dict(settings) as context,
            c2pa.Reader(mime, io.BytesIO(data), context=context) as reader,
        ):
            state = reader.get_validation_state()
            results = reader.get_validation_results() or {}
            manifest = reader.get_active_manifest() or {}
    except c2pa.C2paError as exc:
        code = _error_code(exc)
        if code in _NO_MANIFEST:  # none, or a file c2pa cannot read as its type
            return ManifestReport(
                present=False, failures=[] if code == "manifestnotfound" else [code]
            )
        return ManifestReport(present=True, state="Invalid", failures=[code])
    failures = [str(f.get("code")) for f in results.get("activeManifest", {}).get("failure", [])]
    signature = manifest.get("signature_info") or {}
    generators = manifest.get("claim_generator_info") or [{}]
    return ManifestReport(
        present=True,
        valid=state in ("Valid", "Trusted") and not set(failures) - _TRUST_FAILURES,
        trusted=state == "Trusted",
        state=state,
        signer=signature.get("common_name"),
        issuer=signature.get("issuer"),
        claim_generator=generators[0].get("name"),
        digital_source_type=_source_type(manifest),
        failures=failures,
    )


def _source_type(manifest: dict[str, Any]) -> str | None:
    for assertion in manifest.get("assertions", []):
        if str(assertion.get("label", "")).startswith("c2pa.actions"):
            for action in assertion.get("data", {}).get("actions", []):
                if "digitalSourceType" in action:
                    return str(action["digitalSourceType"])
    return None


def _error_code(exc: c2pa.C2paError) -> str:
    """A short code for a c2pa error (its class name without c2pa's prefix)."""
    return type(exc).__name__.removeprefix("_C2pa").lower() or "error"


@dataclass(frozen=True, slots=True)
class Marker:
    """How a worker marks results: the watermark with the job's payload in the pixels,
    then the signed manifest in the encoded file (``PipelineContext.marker``)."""

    credentials: Credentials

    def watermark(self, image: RGBImage, job_id: str) -> RGBImage:
        """``image`` with the job's payload (``tasks.watermark``; unchanged below its
        smallest size)."""
        return watermark.embed(image, watermark.payload_for(job_id))

    def sign(self, data: bytes, mime: str, ingredients: list[Ingredient]) -> bytes:
        """``data`` with its signed manifest (``MarkingFailed`` when it cannot be signed)."""
        return sign(data, mime, self.credentials, ingredients)

    def sign_file(self, source: Path, dest: Path, mime: str, ingredients: list[Ingredient]) -> None:
        """``source`` with its signed manifest, written to ``dest`` (streamed)."""
        sign_file(source, dest, mime, self.credentials, ingredients)


@dataclass(frozen=True, slots=True)
class Inspection:
    """What a file says about its origin: its Content Credentials and, for an image large
    enough to carry one, this service's watermark."""

    media_type: str | None
    manifest: ManifestReport
    watermark_checked: bool
    """Whether the file decoded as an image, or a video, the watermark can be looked for in."""
    watermark: watermark.Payload | None

    @property
    def made_here(self) -> bool:
        """Whether either mark says this service made the file."""
        return self.manifest.ours or self.watermark is not None


VIDEO_RUNS = 3
"""Runs of consecutive frames a video's watermark is read from (start, middle, end)."""
RUN_FRAMES = 8
"""Frames per run (their soft votes summed; the runs' bits then take a majority)."""


def inspect_file(
    data: bytes, trust_anchors: str | None = None, limits: ImageLimits | None = None
) -> Inspection:
    """The Content Credentials and the watermark of ``data`` (an image or a video: its
    type sniffed from the bytes, ``UnsupportedFormat`` for any other; an image is decoded
    within ``limits``, a video's watermark read from ``VIDEO_RUNS`` x ``RUN_FRAMES``
    frames: ``video_watermark``)."""
    media_type = sniff_media_type(data)
    if media_type is None:
        raise UnsupportedFormat("Send a JPEG, PNG, WebP or MP4 file.")
    manifest = read_manifest(data, media_type, trust_anchors)
    if media_type.startswith("video/"):
        checked, payload = video_watermark(data)
        return Inspection(media_type, manifest, checked, payload)
    try:
        image = decode_image(data, limits or ImageLimits())
    except FaceFlowError:
        return Inspection(media_type, manifest, False, None)
    checked = watermark.markable(image)
    return Inspection(media_type, manifest, checked, watermark.detect(image) if checked else None)


def video_watermark(
    data: bytes, limits: VideoLimits | None = None
) -> tuple[bool, watermark.Payload | None]:
    """Whether the video ``data`` could be read for the watermark (a video within
    ``limits`` whose frames are large enough), and this service's payload in it: read
    from ``VIDEO_RUNS`` runs of ``RUN_FRAMES`` consecutive frames spread over the video
    (``watermark.read_video``). Decoded from a temporary file, a run at a time."""
    from tasks.video_io import frame_timestamps, probe_video, read_frames

    with tempfile.TemporaryDirectory(prefix="faceflow-verify-") as tmp:
        path = Path(tmp) / "video"
        path.write_bytes(data)
        try:
            info = probe_video(path, limits or VideoLimits())
            if info.width * info.height < watermark.MIN_PIXELS:
                return False, None
            pts = frame_timestamps(path)
            last = max(len(pts) - RUN_FRAMES, 0)
            starts = sorted({round(last * k / (VIDEO_RUNS - 1)) for k in range(VIDEO_RUNS)})
            runs = [
                [f.image for f in read_frames(path, s, s + RUN_FRAMES, timestamps=pts)]
                for s in starts
            ]
        except FaceFlowError:
            return False, None
    return True, watermark.read_video(runs)


def sniff_media_type(data: bytes) -> str | None:
    """The media type of an image (JPEG, PNG, WebP) or an MP4/MOV file, from its first
    bytes; None for anything else."""
    try:
        return f"image/{sniff_format(data)}"
    except FaceFlowError:
        pass
    if data[4:8] == b"ftyp":
        return "video/quicktime" if data[8:10] == b"qt" else "video/mp4"
    return None
