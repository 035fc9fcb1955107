"""Watermark bench: bit accuracy of the invisible mark after the edits a result meets.

Run: ``.venv/bin/python bench/watermark.py [--rounds 3] [--json]``.

For each sample photo (skimage's astronaut and coffee, matplotlib's grace_hopper,
insightface's t1) and each method, embeds a random payload and decodes it after: nothing,
JPEG re-encoding at quality 75 and 50, a resize to half (decoded as is, and scaled back up
to the marked size), a 10 % crop (a centred crop to 90 % of each side), and a
screenshot-like PNG round trip (RGBA PNG, read back as RGB). Prints, per method and edit,
the mean bit accuracy, the share of payloads read back whole, and the ms to embed and to
decode one image and the worst PSNR of a marked photo. Methods: ``dwtDct`` (``tasks.watermark``: 48 bits, what results carry)
and ``rivaGan`` (invisible-watermark's ONNX models, 32 bits: the only size they take),
skipped with a note when it cannot run here. Asserts nothing.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cv2
import numpy as np
from PIL import Image

from faceflow import samples
from tasks import watermark
from tasks.types import RGBImage

Embed = Callable[[RGBImage, list[int]], RGBImage]
Read = Callable[[RGBImage], list[int]]


def _jpeg(image: RGBImage, quality: int) -> RGBImage:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, "JPEG", quality=quality)
    return np.asarray(Image.open(io.BytesIO(buffer.getvalue())).convert("RGB"))


def _half(image: RGBImage) -> RGBImage:
    h, w = image.shape[:2]
    return np.asarray(cv2.resize(image, (w // 2, h // 2), interpolation=cv2.INTER_AREA), np.uint8)


def _half_back(image: RGBImage) -> RGBImage:
    h, w = image.shape[:2]
    return np.asarray(cv2.resize(_half(image), (w, h), interpolation=cv2.INTER_CUBIC), np.uint8)


def _crop(image: RGBImage) -> RGBImage:
    h, w = image.shape[:2]
    dy, dx = h // 20, w // 20
    return np.ascontiguousarray(image[dy : h - dy, dx : w - dx])


def _screenshot(image: RGBImage) -> RGBImage:
    buffer = io.BytesIO()
    Image.fromarray(image).convert("RGBA").save(buffer, "PNG")
    return np.asarray(Image.open(io.BytesIO(buffer.getvalue())).convert("RGB"))


EDITS: dict[str, Callable[[RGBImage], RGBImage]] = {
    "none": lambda image: image,
    "jpeg q75": lambda image: _jpeg(image, 75),
    "jpeg q50": lambda image: _jpeg(image, 50),
    "resize 1/2": _half,
    "resize 1/2, back up": _half_back,
    "crop 10 %": _crop,
    "png screenshot": _screenshot,
}
DETECTED = ("none", "jpeg q75", "jpeg q50", "resize 1/2", "crop 10 %", "png screenshot")
"""Edits whose copies ``tasks.watermark.detect`` is also asked about (dwtDct only)."""


def dwt_dct() -> tuple[int, Embed, Read]:
    """``tasks.watermark``'s method (service mark bits fixed, so ``detect`` can find it)."""

    def embed(image: RGBImage, bits: list[int]) -> RGBImage:
        bits[: watermark.SERVICE_BITS] = watermark.Payload(watermark.SERVICE_MARK, 0).bits()[
            : watermark.SERVICE_BITS
        ]
        return watermark.embed(image, watermark.Payload.from_bits(bits))

    def read(image: RGBImage) -> list[int]:
        return watermark.read_bits(image) or [0] * watermark.PAYLOAD_BITS

    return watermark.PAYLOAD_BITS, embed, read


def riva_gan() -> tuple[int, Embed, Read]:
    """invisible-watermark's RivaGAN (its package imports torch)."""
    from imwatermark.rivaGan import RivaWatermark

    RivaWatermark.loadModel()

    def embed(image: RGBImage, bits: list[int]) -> RGBImage:
        bgr = cv2.cvtColor(image, cv2.COLOR_RGB2BGR)
        out = RivaWatermark(bits, 32).encode(bgr)
        return np.asarray(cv2.cvtColor(np.asarray(out, np.uint8), cv2.COLOR_BGR2RGB), np.uint8)

    def read(image: RGBImage) -> list[int]:
        bgr = cv2.cvtColor(np.ascontiguousarray(image), cv2.COLOR_RGB2BGR)
        return [int(b) for b in RivaWatermark([], 32).decode(bgr)]

    return 32, embed, read


METHODS: dict[str, Callable[[], tuple[int, Embed, Read]]] = {
    "dwtDct": dwt_dct,
    "rivaGan": riva_gan,
}


def photos() -> dict[str, RGBImage]:
    """The sample photos."""
    return {
        "astronaut": samples.astronaut_rgb(),
        "coffee": samples.no_face_rgb(),
        "grace_hopper": samples.grace_hopper_rgb(),
        "t1": samples.t1_rgb(),
    }


def measure(method: str, rounds: int, rng: random.Random) -> dict[str, object]:
    """Per edit: mean bit accuracy and whole-payload reads; embed and decode ms."""
    bits_n, embed, read = METHODS[method]()
    accuracy: dict[str, list[float]] = {edit: [] for edit in EDITS}
    detected: dict[str, list[bool]] = {edit: [] for edit in DETECTED}
    embed_ms: list[float] = []
    read_ms: list[float] = []
    psnr: list[float] = []
    for _, image in photos().items():
        for _ in range(rounds):
            bits = [rng.randrange(2) for _ in range(bits_n)]
            start = time.perf_counter()
            marked = embed(image, bits)
            embed_ms.append((time.perf_counter() - start) * 1e3)
            psnr.append(float(cv2.PSNR(np.ascontiguousarray(marked), image)))
            for edit, apply in EDITS.items():
                edited = apply(marked)
                start = time.perf_counter()
                got = read(edited)
                if edit == "none":
                    read_ms.append((time.perf_counter() - start) * 1e3)
                accuracy[edit].append(sum(a == b for a, b in zip(bits, got, strict=True)) / bits_n)
                if method == "dwtDct" and edit in DETECTED:
                    found = watermark.detect(np.ascontiguousarray(edited))
                    detected[edit].append(found == watermark.Payload.from_bits(bits))
    return {
        "bits": bits_n,
        "accuracy": {e: statistics.fmean(v) for e, v in accuracy.items()},
        "whole": {e: sum(1 for a in v if a == 1.0) / len(v) for e, v in accuracy.items()},
        "detected": {e: sum(v) / len(v) for e, v in detected.items() if v},
        "embed_ms": statistics.median(embed_ms),
        "read_ms": statistics.median(read_ms),
        "psnr_db": min(psnr),
    }


def false_positives() -> tuple[int, int]:
    """``tasks.watermark.detect`` on the unmarked sample photos and every edit of them:
    (marks found, images read)."""
    reads = [
        watermark.detect(np.ascontiguousarray(edit(image)))
        for image in photos().values()
        for edit in EDITS.values()
    ]
    return sum(1 for found in reads if found is not None), len(reads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="Payloads per photo.")
    parser.add_argument("--methods", default="dwtDct,rivaGan")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rng = random.Random(25)
    results: dict[str, object] = {}
    for method in args.methods.split(","):
        try:
            results[method] = measure(method, args.rounds, rng)
        except Exception as exc:  # a method that cannot run here is reported, not fatal
            results[method] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
    if args.json:
        print(json.dumps(results, indent=2))
        return
    sizes = {name: f"{im.shape[1]}x{im.shape[0]}" for name, im in photos().items()}
    print(f"photos: {sizes}; {args.rounds} payloads each; load {os.getloadavg()[0]:.1f}")
    print(f"| edit | {' | '.join(f'{m} bit acc. / whole' for m in results)} |")
    print(f"|---|{'---|' * len(results)}")
    for edit in EDITS:
        cells = []
        for result in results.values():
            if not isinstance(result, dict) or "error" in result:
                cells.append("n/a")
                continue
            acc, whole = result["accuracy"], result["whole"]
            cells.append(f"{acc[edit]:.3f} / {whole[edit]:.0%}")
        print(f"| {edit} | {' | '.join(cells)} |")
    dwt = results.get("dwtDct")
    if isinstance(dwt, dict) and "detected" in dwt:
        found = ", ".join(f"{e} {share:.0%}" for e, share in dwt["detected"].items())
        print(f"tasks.watermark.detect finds the payload: {found}")
        hits, reads = false_positives()
        print(f"false positives on unmarked photos and their edits: {hits} of {reads}")
    for method, result in results.items():
        if isinstance(result, dict) and "error" in result:
            print(f"{method}: not measured ({result['error']})")
        elif isinstance(result, dict):
            print(
                f"{method}: {result['bits']} bits, embed {result['embed_ms']:.1f} ms, "
                f"decode {result['read_ms']:.1f} ms per image (median), "
                f"PSNR {result['psnr_db']:.1f} dB (worst)"
            )


if __name__ == "__main__":
    main()
