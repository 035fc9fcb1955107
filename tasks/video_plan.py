"""Plans for a video job, from what the analysis pass found in every frame: scene cuts,
render chunks, face tracks and the face plan (which face of which frame gets which source).

Pure numpy over per-frame detections, so it is tested on synthetic tracks and runs in the
coordinating flow without a model:

- **scene cuts**: a frame whose colour signature differs from the previous one's by more
  than ``CUT_THRESHOLD`` starts a new shot;
- **chunks** of about ``target_s`` seconds, each end moved to a cut within ``window_s``
  when there is one (a chunk then starts on a new shot, where nothing carries over);
- **tracks**: faces linked frame to frame by box overlap (never across a cut), a track
  surviving up to ``max_gap`` frames without a detection; such gaps are filled by
  interpolation, so a face the detector misses for a few frames is still swapped (no
  flicker back to the original face);
- **smoothing**: landmarks and boxes of each run of a track filtered with a centred
  Gaussian (zero phase: no lag), never across a cut or an unfilled gap;
- **assignment**: which tracks are swapped follows the photo rules (``largest``, ``all``,
  an index, or a per-face mapping). For ``largest`` and an index the choice is made per
  frame but changes only after ``hysteresis`` consecutive frames agree, so the swapped
  identity never flips on a one-frame size change. A per-face mapping (``assign_mapping``)
  recognises people: each entry's person is a reference image's face, or the face with
  its number in reading order in the *key frame* (the first frame that shows as many faces
  as the highest number needs); every track goes to the entry whose person it resembles
  (identity embeddings of several of its frames, at least the same-person similarity), so
  a person keeps their source when they move, cross another, leave and come back, or
  reappear after a cut.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from tasks.errors import InvalidInput, NoFaceFound
from tasks.mapping import reading_order
from tasks.options import FaceChoice, FaceMapping
from tasks.types import Box, Face, FloatArray, RGBImage

CUT_THRESHOLD = 0.2
"""Half the L1 distance between two frames' colour histograms above which a shot starts
(the test story: 0.25-0.36 at its cuts, at most 0.073 between frames of a pan)."""
SIGNATURE_BINS = 16
DEFAULT_MAX_GAP = 8
DEFAULT_HYSTERESIS = 5
DEFAULT_SMOOTHING_SIGMA = 1.5
MIN_IOU = 0.3


def frame_signature(image: RGBImage) -> FloatArray:
    """A frame's colour signature: per-channel histograms of a 64-px-wide thumbnail,
    normalised to sum to one (what ``scene_cuts`` compares)."""
    step = max(1, image.shape[1] // 64)
    thumb = image[::step, ::step].reshape(-1, 3)
    hist = [
        np.bincount(thumb[:, c] // (256 // SIGNATURE_BINS), minlength=SIGNATURE_BINS)
        for c in range(3)
    ]
    joined = np.concatenate(hist).astype(np.float32)
    return joined / max(1.0, float(joined.sum()))


def scene_cuts(signatures: Sequence[FloatArray], threshold: float = CUT_THRESHOLD) -> list[int]:
    """The frames that start a new shot (never frame 0), from consecutive signatures."""
    cuts = []
    for i in range(1, len(signatures)):
        if 0.5 * float(np.abs(signatures[i] - signatures[i - 1]).sum()) > threshold:
            cuts.append(i)
    return cuts


@dataclass(frozen=True, slots=True)
class Chunk:
    """Frames ``[start, stop)`` of the video, rendered and encoded as one segment."""

    index: int
    start: int
    stop: int

    @property
    def frames(self) -> int:
        """How many frames the chunk holds."""
        return self.stop - self.start


def plan_chunks(
    times_s: Sequence[float],
    cuts: Sequence[int] = (),
    *,
    target_s: float = 10.0,
    window_s: float = 2.5,
) -> list[Chunk]:
    """Chunks of about ``target_s`` seconds of presentation time (``times_s``: each frame's
    time), each boundary moved to the nearest cut within ``window_s``; a last piece shorter
    than half the target joins the chunk before it."""
    n = len(times_s)
    if n == 0:
        return []
    times = np.asarray(times_s, dtype=np.float64)
    bounds = [0]
    while True:
        start = bounds[-1]
        goal = times[start] + target_s
        ideal = int(np.searchsorted(times, goal))
        if ideal >= n:
            break
        near = [c for c in cuts if start < c < n and abs(times[c] - goal) <= window_s]
        stop = min(near, key=lambda c: abs(times[c] - goal)) if near else max(ideal, start + 1)
        bounds.append(stop)
    if len(bounds) > 1 and times[-1] - times[bounds[-1]] < target_s / 2:
        bounds.pop()
    bounds.append(n)
    return [Chunk(i, a, b) for i, (a, b) in enumerate(itertools.pairwise(bounds))]


@dataclass
class Track:
    """One face followed through consecutive frames of one shot."""

    id: int
    detected: dict[int, Face] = field(default_factory=dict)
    faces: dict[int, Face] = field(default_factory=dict)  # detected + filled, then smoothed
    filled: set[int] = field(default_factory=set)
    jitter_before: float = 0.0
    jitter_after: float = 0.0

    @property
    def first(self) -> int:
        """The first frame the track covers."""
        return min(self.faces or self.detected)

    @property
    def last(self) -> int:
        """The last frame the track covers."""
        return max(self.faces or self.detected)

    def mean_area(self) -> float:
        """The mean box area over the track's detections."""
        return float(np.mean([f.box.area for f in self.detected.values()]))


def build_tracks(
    frames: Sequence[Sequence[Face]],
    cuts: Sequence[int] = (),
    *,
    max_gap: int = DEFAULT_MAX_GAP,
    min_iou: float = MIN_IOU,
) -> list[Track]:
    """Link each frame's faces to the tracks of the frames before by box overlap (greedy,
    best first); a track not seen for more than ``max_gap`` frames, or at a cut, ends."""
    cut_set = set(cuts)
    tracks: list[Track] = []
    open_: list[Track] = []
    for index, faces in enumerate(frames):
        if index in cut_set:
            open_ = []
        open_ = [t for t in open_ if index - max(t.detected) <= max_gap + 1]
        pairs = sorted(
            (
                (t.detected[max(t.detected)].box.iou(face.box), ti, fi)
                for ti, t in enumerate(open_)
                for fi, face in enumerate(faces)
            ),
            reverse=True,
        )
        used_t: set[int] = set()
        used_f: set[int] = set()
        for overlap, ti, fi in pairs:
            if overlap < min_iou or ti in used_t or fi in used_f:
                continue
            open_[ti].detected[index] = faces[fi]
            used_t.add(ti)
            used_f.add(fi)
        for fi, face in enumerate(faces):
            if fi not in used_f:
                track = Track(len(tracks), {index: face})
                tracks.append(track)
                open_.append(track)
    for track in tracks:
        _fill_gaps(track)
    return tracks


def _fill_gaps(track: Track) -> None:
    """Interpolate boxes and landmarks over the frames a track skips (its gaps are at most
    ``max_gap`` by construction)."""
    seen = sorted(track.detected)
    track.faces = dict(track.detected)
    for a, b in itertools.pairwise(seen):
        for index in range(a + 1, b):
            t = (index - a) / (b - a)
            track.faces[index] = _lerp(track.detected[a], track.detected[b], t)
            track.filled.add(index)


def _lerp(a: Face, b: Face, t: float) -> Face:
    box = Box(*((1 - t) * np.array(_box(a)) + t * np.array(_box(b))).tolist())
    landmarks = ((1 - t) * a.landmarks + t * b.landmarks).astype(np.float32)
    return Face(box, min(a.score, b.score), landmarks)


def _box(face: Face) -> tuple[float, float, float, float]:
    return (face.box.x1, face.box.y1, face.box.x2, face.box.y2)


def gaussian_smooth(values: npt.NDArray[np.float64], sigma: float) -> npt.NDArray[np.float64]:
    """Centred (zero-phase) Gaussian filter along axis 0. The ends are extended by point
    reflection (``2 * end - mirror``), so a steady motion stays straight up to the ends
    instead of folding back."""
    if sigma <= 0 or len(values) < 3:
        return values
    radius = min(max(1, round(3 * sigma)), len(values) - 1)
    x = np.arange(-radius, radius + 1, dtype=np.float64)
    kernel = np.exp(-0.5 * (x / sigma) ** 2)
    kernel /= kernel.sum()
    head = 2 * values[0] - values[1 : radius + 1][::-1]
    tail = 2 * values[-1] - values[-radius - 1 : -1][::-1]
    padded = np.concatenate([head, values, tail])
    out = np.empty_like(values)
    for i in range(len(values)):
        out[i] = np.tensordot(kernel, padded[i : i + 2 * radius + 1], axes=(0, 0))
    return out


def jitter_px(points: npt.NDArray[np.float64]) -> float:
    """Landmark jitter in px per frame: the mean length of each landmark's second
    difference over consecutive frames, halved (a steady drift scores 0)."""
    if len(points) < 3:
        return 0.0
    second = points[2:] - 2 * points[1:-1] + points[:-2]
    return float(np.linalg.norm(second, axis=-1).mean() / 2)


def smooth_track(track: Track, sigma: float = DEFAULT_SMOOTHING_SIGMA) -> None:
    """Smooth the track's landmarks and boxes over its frames (one run: a track never
    spans a cut); records the jitter before and after."""
    frames = sorted(track.faces)
    marks = np.stack([track.faces[i].landmarks for i in frames]).astype(np.float64)
    boxes = np.array([_box(track.faces[i]) for i in frames], dtype=np.float64)
    smooth_marks, smooth_boxes = gaussian_smooth(marks, sigma), gaussian_smooth(boxes, sigma)
    track.jitter_before, track.jitter_after = jitter_px(marks), jitter_px(smooth_marks)
    for k, index in enumerate(frames):
        face = track.faces[index]
        track.faces[index] = Face(
            Box(*smooth_boxes[k].tolist()), face.score, smooth_marks[k].astype(np.float32)
        )


@dataclass(frozen=True, slots=True)
class Swap:
    """One face of one frame to replace, and the source image whose face goes onto it."""

    track: int
    face: Face
    source: int = 0


@dataclass
class FacePlan:
    """Per frame, the faces to swap; the tracks behind them; the shots."""

    frames: list[list[Swap]]
    tracks: list[Track]
    cuts: list[int]
    switches: int = 0  # frames where a rule's or a mapping entry's swapped track changed
    key_frame: int | None = None  # where a mapping's target numbers were counted

    def swapped_frames(self, track: int) -> int:
        """How many frames swap ``track``."""
        return sum(1 for swaps in self.frames if any(s.track == track for s in swaps))

    def source_of(self, track: int) -> int | None:
        """The source ``track`` is swapped with (None: never swapped)."""
        return next((s.source for swaps in self.frames for s in swaps if s.track == track), None)


@dataclass(frozen=True, slots=True)
class Identities:
    """How a per-face mapping tells people apart: ``embed`` gives each track's identity
    embedding (from a few of its frames), ``similarity`` compares two (in [0, 1];
    ``threshold`` and above: the same person), ``references`` are the job's reference
    images' embeddings, by index."""

    embed: Callable[[Sequence[Track]], Sequence[FloatArray]]
    similarity: Callable[[FloatArray, FloatArray], float]
    references: Sequence[FloatArray] = ()
    threshold: float = 0.5


def plan_faces(
    frames: Sequence[Sequence[Face]],
    cuts: Sequence[int],
    choice: FaceChoice,
    *,
    mapping: Sequence[FaceMapping] = (),
    identities: Identities | None = None,
    max_gap: int = DEFAULT_MAX_GAP,
    hysteresis: int = DEFAULT_HYSTERESIS,
    sigma: float = DEFAULT_SMOOTHING_SIGMA,
) -> FacePlan:
    """The face plan of a video from each frame's detections (largest first).

    ``choice`` as for a photo; a per-face ``mapping`` instead (``assign_mapping``, which
    needs ``identities``)."""
    tracks = build_tracks(frames, cuts, max_gap=max_gap)
    for track in tracks:
        smooth_track(track, sigma)
    plan = FacePlan([[] for _ in frames], tracks, list(cuts))
    if mapping:
        assert identities is not None, "a per-face mapping needs identity embeddings"
        assign_mapping(plan, mapping, identities)
    elif choice == "all":
        for track in tracks:
            for index, face in track.faces.items():
                plan.frames[index].append(Swap(track.id, face))
    else:
        rank = 0 if choice == "largest" else int(choice)
        _assign_by_rank(plan, rank, hysteresis)
    return plan


def _present(tracks: Sequence[Track], index: int) -> list[Track]:
    return [t for t in tracks if index in t.faces]


def _assign_by_rank(plan: FacePlan, rank: int, hysteresis: int) -> None:
    """Per frame the track at ``rank`` by box size, switching only after ``hysteresis``
    frames agree, or at once when the current one is gone or a shot starts."""
    current: int | None = None
    streak_for: int | None = None
    streak = 0
    cuts = set(plan.cuts)
    for index in range(len(plan.frames)):
        present = sorted(
            _present(plan.tracks, index), key=lambda t: t.faces[index].box.area, reverse=True
        )
        wanted = present[rank].id if rank < len(present) else None
        ids = {t.id for t in present}
        if index in cuts or current not in ids:
            if current is not None and wanted is not None and index not in cuts:
                plan.switches += 1
            current, streak_for, streak = wanted, None, 0
        elif wanted != current:
            streak = streak + 1 if wanted == streak_for else 1
            streak_for = wanted
            if streak >= hysteresis:
                current, streak_for, streak = wanted, None, 0
                plan.switches += 1
        else:
            streak_for, streak = None, 0
        if current is not None:
            track = plan.tracks[current]
            plan.frames[index].append(Swap(current, track.faces[index]))


def key_frame(plan: FacePlan, faces: int) -> int:
    """The first frame that shows at least ``faces`` faces (tracked ones, gaps filled):
    where a mapping's target numbers are counted. ``InvalidInput`` when none does."""
    for index in range(len(plan.frames)):
        if len(_present(plan.tracks, index)) >= faces:
            return index
    raise InvalidInput(
        f"Target face {faces - 1} is out of range: no frame of the video shows {faces} faces."
    )


def assign_mapping(plan: FacePlan, mapping: Sequence[FaceMapping], identities: Identities) -> None:
    """Swap each track with the source of the mapping entry whose person it is.

    An entry's person is its reference image's face, or (``target``) the track at that
    number in reading order in the key frame (``key_frame``). Every other track goes to
    the entry it resembles most, at ``identities.threshold`` or above; tracks like no
    entry stay as they are. Per frame an entry swaps one track: its most similar present
    one (a switch is counted when that changes while the previous one is still there).
    ``InvalidInput`` when two entries name the same person, ``NoFaceFound`` when a
    reference resembles no face of the video."""
    anchors: dict[int, int] = {}  # entry → its key-frame track
    wanted = [m.target for m in mapping if m.target is not None]
    if wanted:
        plan.key_frame = key_frame(plan, max(wanted) + 1)
        present = _present(plan.tracks, plan.key_frame)
        order = reading_order([t.faces[plan.key_frame] for t in present])
        for e, m in enumerate(mapping):
            if m.target is not None:
                anchors[e] = present[order[m.target]].id
    if len(set(anchors.values())) < len(anchors):
        raise InvalidInput("Two mapping entries name the same target face.")
    vectors = list(identities.embed(plan.tracks))
    people = [
        identities.references[m.reference] if m.reference is not None else vectors[anchors[e]]
        for e, m in enumerate(mapping)
    ]
    anchored = {t: e for e, t in anchors.items()}
    owner: dict[int, tuple[int, float]] = {}  # track → (entry, similarity)
    for track in plan.tracks:
        if track.id in anchored:
            owner[track.id] = (anchored[track.id], 1.0)
            continue
        scores = [identities.similarity(vectors[track.id], person) for person in people]
        best = int(np.argmax(scores))
        if scores[best] >= identities.threshold:
            owner[track.id] = (best, scores[best])
    for e, m in enumerate(mapping):
        if m.reference is None or any(entry == e for entry, _ in owner.values()):
            continue
        near = max(plan.tracks, key=lambda t: identities.similarity(vectors[t.id], people[e]))
        if near.id in anchored:
            raise InvalidInput(
                f"Two mapping entries name the same person: reference {m.reference} "
                f"resembles target face {mapping[anchored[near.id]].target} most."
            )
        raise NoFaceFound(f"No face in the video resembles reference image {m.reference}.")
    _swap_owned(plan, mapping, owner)


def _swap_owned(
    plan: FacePlan, mapping: Sequence[FaceMapping], owner: dict[int, tuple[int, float]]
) -> None:
    """Per frame and entry, the entry's most similar present track."""
    last: dict[int, int] = {}
    for index in range(len(plan.frames)):
        present = _present(plan.tracks, index)
        ids = {t.id for t in present}
        for e, m in enumerate(mapping):
            mine = [t for t in present if t.id in owner and owner[t.id][0] == e]
            if not mine:
                continue
            chosen = max(mine, key=lambda t: (owner[t.id][1], -t.id))
            if e in last and last[e] != chosen.id and last[e] in ids:
                plan.switches += 1
            last[e] = chosen.id
            plan.frames[index].append(Swap(chosen.id, chosen.faces[index], m.source))
