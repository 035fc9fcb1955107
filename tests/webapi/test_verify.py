"""``POST /v1/verify`` over real HTTP: marks found, the job named only to its owner,
tampered and unmarked files, authentication and the per-key rate limit; and the webapi
still never imports torch or the pipeline."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from sqlalchemy.engine import Engine

from blocks.signing import make_chain
from faceflow.testing.jobs import auth, make_user, new_job
from tasks.images import encode_image
from tasks.provenance import Credentials, Marker
from tests.samples import astronaut_rgb, encode, grace_hopper_rgb
from tests.webapi.conftest import make_settings, serve
from webapi.config import Settings
from webapi.crud import NewUser
from webapi.errors import RateLimited
from webapi.main import create_app
from webapi.routes.verify import VerifyLimiter

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Chain:
    credentials: Credentials
    root: Path


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> Chain:
    credentials, root_pem = make_chain("FaceFlow verify test")
    root = tmp_path_factory.mktemp("c2pa") / "root.pem"
    root.write_text(root_pem)
    return Chain(credentials, root)


def marked_jpeg(chain: Chain, job_id: str) -> bytes:
    """A photo marked as the store stage marks a job's result."""
    marker = Marker(chain.credentials)
    pixels = marker.watermark(grace_hopper_rgb(), job_id)
    return marker.sign(encode_image(pixels, "jpeg", 90), "image/jpeg", [])


@dataclass(frozen=True)
class Served:
    """The app on loopback, its job store and settings."""

    url: str
    engine: Engine
    settings: Settings

    def user(self) -> NewUser:
        return make_user(self.engine, self.settings)


@pytest.fixture
def served(database_url: str, engine: Engine, tmp_path: Path, chain: Chain) -> Iterator[Served]:
    settings = make_settings(
        database_url, tmp_path, c2pa_trust_anchors=chain.root, verify_per_minute=5
    )
    with serve(create_app(settings)) as url:
        yield Served(url, engine, settings)


def post(url: str, user: NewUser, data: bytes) -> httpx.Response:
    headers = {**auth(user), "Content-Type": "application/octet-stream"}
    return httpx.post(f"{url}/v1/verify", content=data, headers=headers, timeout=60)


def test_verify_names_the_job_only_to_its_owner(served: Served, chain: Chain) -> None:
    url = served.url
    owner, other = served.user(), served.user()
    job = new_job(served.engine, served.settings, owner)
    new_job(served.engine, served.settings, other)
    data = marked_jpeg(chain, str(job.id))

    mine = post(url, owner, data)
    assert mine.status_code == 200, mine.text
    body = mine.json()
    assert body["made_by_this_service"] and body["media_type"] == "image/jpeg"
    assert body["manifest"]["present"] and body["manifest"]["valid"]
    assert body["manifest"]["trusted"] and body["manifest"]["claim_generator"] == "FaceFlow"
    assert body["manifest"]["signer"] == "FaceFlow verify test signer"
    assert body["watermark"] == {"checked": True, "present": True, "job_id": str(job.id)}

    theirs = post(url, other, data).json()
    assert theirs["made_by_this_service"] and theirs["watermark"]["present"]
    assert theirs["watermark"]["job_id"] is None

    orphan = post(url, owner, marked_jpeg(chain, str(uuid.uuid4()))).json()
    assert orphan["made_by_this_service"] and orphan["watermark"]["job_id"] is None


def test_a_marked_video_names_its_job_and_the_size_is_bounded(
    database_url: str, engine: Engine, tmp_path: Path, chain: Chain
) -> None:
    """An MP4 whose frames carry the job's watermark and whose file carries its manifest,
    as the video flow stores it; a file past ``verify_max_bytes`` is refused (413)."""
    from faceflow.clips import pan_frames, write_clip
    from tasks import watermark
    from tasks.provenance import sign_file

    settings = make_settings(database_url, tmp_path, c2pa_trust_anchors=chain.root)
    owner = make_user(engine, settings)
    job = new_job(engine, settings, owner)
    frames = pan_frames(480, 360, 24)
    payload = watermark.payload_for(str(job.id))
    write_clip([watermark.VIDEO.embed(f, payload) for f in frames], tmp_path / "clip.mp4")
    sign_file(tmp_path / "clip.mp4", tmp_path / "signed.mp4", "video/mp4", chain.credentials, [])
    data = (tmp_path / "signed.mp4").read_bytes()
    with serve(create_app(settings)) as url:
        body = post(url, owner, data).json()
        assert body["media_type"] == "video/mp4" and body["made_by_this_service"]
        assert body["manifest"]["valid"] and body["manifest"]["trusted"]
        assert body["watermark"] == {"checked": True, "present": True, "job_id": str(job.id)}
    small = settings.model_copy(update={"verify_max_bytes": len(data) - 1})
    with serve(create_app(small)) as url:
        refused = post(url, owner, data)
        assert refused.status_code == 413, refused.text


def test_tampered_and_unmarked_files(served: Served, chain: Chain) -> None:
    url, user = served.url, served.user()
    tampered = bytearray(marked_jpeg(chain, str(uuid.uuid4())))
    tampered[-4000] ^= 0xFF
    body = post(url, user, bytes(tampered)).json()
    assert body["manifest"]["present"] and not body["manifest"]["valid"]
    assert "assertion.dataHash.mismatch" in body["manifest"]["failures"]

    plain = post(url, user, encode(astronaut_rgb(), "PNG")).json()
    assert not plain["made_by_this_service"]
    assert not plain["manifest"]["present"] and not plain["watermark"]["present"]
    assert plain["watermark"]["checked"]

    gif = post(url, user, b"GIF89a" + bytes(64))
    assert gif.status_code == 415 and gif.json()["error"]["code"] == "unsupported_format"
    broken = post(url, user, b"\xff\xd8\xff" + bytes(500)).json()  # a JPEG's first bytes only
    assert not broken["manifest"]["present"] and not broken["watermark"]["checked"]

    empty = post(url, user, b"")
    assert empty.status_code == 422 and empty.json()["error"]["code"] == "invalid_request"


def test_verify_needs_a_key_and_is_rate_limited(served: Served) -> None:
    url = served.url
    anonymous = httpx.post(f"{url}/v1/verify", content=b"x", timeout=30)
    assert anonymous.status_code == 401
    user = served.user()
    data = encode(astronaut_rgb(), "JPEG")
    codes = [post(url, user, data).status_code for _ in range(6)]
    assert codes == [200] * 5 + [429]
    limited = post(url, user, data)
    assert limited.json()["error"]["code"] == "rate_limited"
    assert int(limited.headers["Retry-After"]) >= 1
    assert post(url, served.user(), data).status_code == 200


def test_limiter_window() -> None:
    limiter = VerifyLimiter(2)
    key = uuid.uuid4()
    limiter.admit(key, now=0.0)
    limiter.admit(key, now=1.0)
    with pytest.raises(RateLimited) as refused:
        limiter.admit(key, now=2.0)
    assert refused.value.retry_after == pytest.approx(58.0)
    limiter.admit(key, now=60.5)  # the first one left the window


def test_verify_imports_neither_torch_nor_the_pipeline(tmp_path: Path, chain: Chain) -> None:
    script = textwrap.dedent(
        f"""
        import sys
        from pathlib import Path
        from fastapi.testclient import TestClient
        import webapi.main
        from tests.webapi.conftest import make_settings
        from faceflow.testing.jobs import auth, make_user
        from webapi.migrations import upgrade

        tmp = Path({str(tmp_path)!r})
        url = f"sqlite:///{{tmp / 'verify.db'}}"
        upgrade(url)
        app = webapi.main.create_app(make_settings(url, tmp))
        data = Path({str(tmp_path / "marked.jpg")!r}).read_bytes()
        with TestClient(app) as client:
            user = make_user(app.state.engine, app.state.settings)
            response = client.post("/v1/verify", content=data, headers=auth(user))
            assert response.status_code == 200, response.text
            assert response.json()["watermark"]["present"], response.text
        heavy = sorted(
            name for name in sys.modules
            if name.split(".")[0] in ("torch", "prefect", "onnxruntime", "imwatermark")
            or name in ("tasks.stages", "tasks.pipeline", "tasks.detect", "tasks.models")
        )
        print("HEAVY", heavy)
        """
    )
    (tmp_path / "marked.jpg").write_bytes(marked_jpeg(chain, str(uuid.uuid4())))
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "HEAVY []" in result.stdout, result.stdout
