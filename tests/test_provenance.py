"""Marked results: a real fused result signed with a freshly made chain and read back by
c2pa's Reader; its watermark; tampered, re-keyed and unmarked files."""

from __future__ import annotations

import hashlib
import io
import json
import uuid
from dataclasses import dataclass
from pathlib import Path

import c2pa
import numpy as np
import pytest
from PIL import Image

from blocks.signing import make_chain
from tasks import watermark
from tasks.errors import MarkingFailed
from tasks.options import FusionOptions
from tasks.pipeline import PipelineContext, marked_encode_stage
from tasks.provenance import (
    CLAIM_GENERATOR,
    DIGITAL_SOURCE_TYPE,
    Credentials,
    Ingredient,
    Marker,
    inspect_file,
    read_manifest,
    service_version,
    sign,
)
from tasks.stages import InMemory, InProcess, InputBytes, Work, run_stages
from tests import samples


@dataclass(frozen=True)
class Marked:
    """A fused result marked by the store stage, and what made it."""

    work: Work
    job_id: str
    credentials: Credentials
    root_pem: str


@pytest.fixture(scope="module")
def marked() -> Marked:
    """Astronaut's face into Grace Hopper, through every stage, marked (JPEG q90)."""
    credentials, root_pem = make_chain("FaceFlow test")
    job_id = str(uuid.uuid4())
    ctx = PipelineContext(marker=Marker(credentials))
    data = InputBytes(samples.astronaut_jpeg_bytes(), samples.grace_hopper_jpeg_bytes())
    work = Work(InMemory(data), FusionOptions(output_format="jpeg"), job_id=job_id)
    run_stages([work], ctx, InProcess(ctx))
    assert work.marks == ["c2pa", "watermark"]
    return Marked(work, job_id, credentials, root_pem)


def _pixels(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def test_result_manifest_read_by_c2pa_reader(marked: Marked) -> None:
    data = marked.work.encoded
    assert data is not None
    with c2pa.Reader("image/jpeg", io.BytesIO(data)) as reader:
        manifest = reader.get_active_manifest()
        assert reader.get_validation_state() in ("Valid", "Trusted")
    assert manifest is not None
    generator = manifest["claim_generator_info"][0]
    assert (generator["name"], generator["version"]) == (CLAIM_GENERATOR, service_version())
    (actions,) = [a for a in manifest["assertions"] if a["label"].startswith("c2pa.actions")]
    assert actions["data"]["actions"][0]["digitalSourceType"] == DIGITAL_SOURCE_TYPE
    ingredients = {i["title"]: i["instance_id"] for i in manifest["ingredients"]}
    assert ingredients == {
        "source": "sha256:" + hashlib.sha256(samples.astronaut_jpeg_bytes()).hexdigest(),
        "target": "sha256:" + hashlib.sha256(samples.grace_hopper_jpeg_bytes()).hexdigest(),
    }
    assert "thumbnail" not in json.dumps(manifest)  # no picture of anyone's input or result

    report = read_manifest(data, "image/jpeg", marked.root_pem)
    assert report.valid and report.trusted and report.ours and report.failures == []
    assert report.signer == "FaceFlow test signer" and report.issuer == "FaceFlow test"
    other_root = make_chain("someone else")[1]
    untrusted = read_manifest(data, "image/jpeg", other_root)
    assert untrusted.valid and not untrusted.trusted


@pytest.mark.parametrize("fmt", ["png", "jpeg", "webp"])
def test_formats_round_trip(marked: Marked, fmt: str) -> None:
    options = FusionOptions(output_format=fmt)
    image = marked.work.image
    assert image is not None
    ingredients = [Ingredient.of("target", b"target bytes", "image/png")]
    _, data, marks = marked_encode_stage(
        image, options, Marker(marked.credentials), job_id=marked.job_id, ingredients=ingredients
    )
    assert marks == ["c2pa", "watermark"]
    found = inspect_file(data, marked.root_pem)
    assert found.media_type == options.content_type
    assert found.manifest.valid and found.manifest.trusted
    assert found.watermark == watermark.payload_for(marked.job_id)
    assert found.made_here


def test_watermark_survives_jpeg_q75_and_stripped_metadata(marked: Marked) -> None:
    assert marked.work.encoded is not None
    pixels = _pixels(marked.work.encoded)
    stripped = samples.encode(pixels, "PNG")  # the pixels alone: the manifest is gone
    found = inspect_file(stripped)
    assert not found.manifest.present
    assert found.watermark == watermark.payload_for(marked.job_id)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "JPEG", quality=75)
    again = inspect_file(buffer.getvalue())
    assert again.watermark is not None
    assert again.watermark.tag == uuid.UUID(marked.job_id).int >> 96
    assert again.made_here and not again.manifest.present


def test_tampered_file_fails_verification(marked: Marked) -> None:
    data = bytearray(marked.work.encoded or b"")
    data[-4000] ^= 0xFF  # inside the image data, after the manifest
    report = read_manifest(bytes(data), "image/jpeg", marked.root_pem)
    assert report.present and not report.valid and not report.ours
    assert "assertion.dataHash.mismatch" in report.failures
    start = bytes(marked.work.encoded or b"").find(b"c2pa.signature")
    assert start > 0
    data = bytearray(marked.work.encoded or b"")
    data[start + 200] ^= 0xFF  # inside the signature box
    broken = read_manifest(bytes(data), "image/jpeg", marked.root_pem)
    assert broken.present and not broken.valid


def test_signing_with_a_key_that_is_not_the_certificates_fails(marked: Marked) -> None:
    other = make_chain("other")[0]
    mismatched = Credentials(marked.credentials.cert_chain_pem, other.private_key_pem)
    jpeg = samples.encode(samples.astronaut_rgb(), "JPEG")
    with pytest.raises(MarkingFailed) as failed:
        sign(jpeg, "image/jpeg", mismatched, [])
    assert failed.value.code == "marking_failed" and failed.value.permanent
    with pytest.raises(MarkingFailed):
        sign(jpeg, "image/jpeg", Credentials("not a PEM", "not a key"), [])


def test_unmarked_photos_read_as_unmarked() -> None:
    """No sample photo, nor any crop, half or re-encoding of it, reads as marked."""
    reads = 0
    for image in (
        samples.astronaut_rgb(),
        samples.grace_hopper_rgb(),
        samples.t1_rgb(),
        samples.no_face_rgb(),
    ):
        h, w = image.shape[:2]
        variants = [
            image,
            image[h // 20 : h - h // 20, w // 20 : w - w // 20],
            image[: h // 2 + 64, : w // 2 + 64],
            image[h // 3 :, w // 4 :],
        ]
        for variant in variants:
            for fmt in ("PNG", "JPEG"):
                found = inspect_file(samples.encode(np.ascontiguousarray(variant), fmt))
                assert not found.manifest.present and found.watermark is None
                assert not found.made_here
                reads += 1
    assert reads == 32


def test_payload_bits_and_job_tags() -> None:
    job = uuid.uuid4()
    payload = watermark.payload_for(str(job))
    assert payload.ours and payload.tag == job.int >> 96
    assert watermark.Payload.from_bits(payload.bits()) == payload
    low, high = watermark.tag_range(payload.tag)
    assert low <= job <= high
    assert watermark.job_tag("not-a-uuid") == watermark.job_tag("not-a-uuid")
    small = np.zeros((100, 100, 3), np.uint8)
    assert watermark.embed(small, payload) is small and watermark.detect(small) is None


def test_cli_verify(marked: Marked, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from faceflow.cli import app

    root = tmp_path / "root.pem"
    root.write_text(marked.root_pem)
    result_file = tmp_path / "result.jpg"
    result_file.write_bytes(marked.work.encoded or b"")
    run = CliRunner().invoke(app, ["verify", str(result_file), "--trust", str(root)])
    assert run.exit_code == 0, run.output
    found = json.loads(run.output)
    assert found["made_by_this_service"] and found["manifest"]["trusted"]
    assert found["watermark"]["job_tag"] == marked.job_id.replace("-", "")[:8]
    plain = tmp_path / "plain.png"
    plain.write_bytes(samples.encode(samples.astronaut_rgb(), "PNG"))
    run = CliRunner().invoke(app, ["verify", str(plain), "--home", str(tmp_path)])
    assert run.exit_code == 1 and not json.loads(run.output)["made_by_this_service"]


def test_cli_fuse_marks_its_result_unless_told_not_to(tmp_path: Path) -> None:
    """``faceflow fuse`` signs with the home's development chain (made on first use) and
    watermarks with the job id it prints; ``--no-mark`` warns; a chain that cannot sign
    fails ``marking_failed`` and writes nothing."""
    from typer.testing import CliRunner

    from faceflow.cli import app

    source, target = tmp_path / "source.jpg", tmp_path / "target.jpg"
    source.write_bytes(samples.astronaut_jpeg_bytes())
    target.write_bytes(samples.grace_hopper_jpeg_bytes())
    home = tmp_path / "home"
    base = ["fuse", str(source), str(target), "--home", str(home), "--json", "-o"]

    out = tmp_path / "marked.jpg"
    run = CliRunner().invoke(app, [*base, str(out)])
    assert run.exit_code == 0, run.output
    summary = json.loads(run.stdout)
    assert summary["marks"] == ["c2pa", "watermark"]
    found = inspect_file(out.read_bytes(), (home / "c2pa" / "root.pem").read_text())
    assert found.manifest.ours and found.manifest.trusted
    assert found.watermark == watermark.payload_for(summary["job_id"])

    bare = tmp_path / "bare.jpg"
    run = CliRunner().invoke(app, [*base, str(bare), "--no-mark"])
    assert run.exit_code == 0, run.output
    assert "--no-mark" in run.stderr and json.loads(run.stdout)["marks"] == []
    found = inspect_file(bare.read_bytes())
    assert not found.manifest.present and found.watermark is None

    (home / "c2pa" / "signer.key").write_text(make_chain("someone else")[0].private_key_pem)
    refused = tmp_path / "refused.jpg"
    run = CliRunner().invoke(app, [*base, str(refused)])
    assert run.exit_code == 1 and "error[marking_failed]" in run.stderr
    assert not refused.exists()
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("")
    run = CliRunner().invoke(app, [*base[:3], "--home", str(blocked), "-o", str(refused)])
    assert run.exit_code == 1 and "error[marking_failed]" in run.stderr
    assert not refused.exists()
