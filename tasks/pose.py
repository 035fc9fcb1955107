"""Head pose from the 5 landmarks, with a generic face's proportions.

In the frame of the eye line (roll removed), the nose tip of a frontal face sits on the
line between the eyes' and the mouth's midpoints, about half way down (the ArcFace
template's ratio, ``_NEUTRAL_DOWN``). A turned head moves the nose sideways by its depth
times sin(yaw); a nodding one moves it along that line. With the nose ``_NOSE_DEPTH``
half eye-distances (horizontally) and ``_NOSE_DEPTH_DOWN`` eye-to-mouth distances
(vertically) in front of the eyes' and mouth's plane, as on an average adult face, the
angles follow. Expect a few degrees of error (expressions move the mouth corners): enough
to flag a source whose head is turned far from the target's (``POSE_LIMITS``), not to
measure gaze.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from tasks.report import PoseAngles

_NEUTRAL_DOWN = 0.495
"""Nose position from the eye line (0) to the mouth line (1) on the ArcFace template."""
_NOSE_DEPTH = 0.97
"""Nose tip depth in front of the eyes, in half eye-distances (about 30 mm / 31 mm)."""
_NOSE_DEPTH_DOWN = 0.46
"""Nose tip depth in front of the eye-mouth plane, in eye-to-mouth distances (30 / 65 mm)."""

POSE_LIMITS = PoseAngles(yaw=25.0, pitch=20.0, roll=45.0)
"""Largest |target - source| difference per angle that still counts as matching poses."""


def head_pose(landmarks: npt.ArrayLike) -> PoseAngles:
    """Yaw, pitch and roll in degrees of a face from its 5 landmarks (``LANDMARK_NAMES``).

    Positive yaw: the nose points to the viewer's right; positive pitch: the face looks
    down; roll: the eye line's angle in image coordinates (clockwise positive).
    """
    points = np.asarray(landmarks, dtype=np.float64).reshape(5, 2)
    eyes_mid = (points[0] + points[1]) / 2.0
    mouth_mid = (points[3] + points[4]) / 2.0
    across = points[1] - points[0]
    half_eyes = float(np.linalg.norm(across)) / 2.0
    roll = math.degrees(math.atan2(across[1], across[0]))
    down = mouth_mid - eyes_mid
    length = float(np.linalg.norm(down))
    if half_eyes < 1e-6 or length < 1e-6:
        return PoseAngles(yaw=0.0, pitch=0.0, roll=round(roll, 1))
    unit_down = down / length
    unit_across = np.array([unit_down[1], -unit_down[0]])  # perpendicular, towards +x
    nose = points[2] - eyes_mid
    sideways = float(nose @ unit_across) / half_eyes
    along = float(nose @ unit_down) / length
    yaw = math.degrees(math.atan(sideways / _NOSE_DEPTH))
    pitch = math.degrees(math.atan((along - _NEUTRAL_DOWN) / _NOSE_DEPTH_DOWN))
    return PoseAngles(yaw=round(yaw, 1), pitch=round(pitch, 1), roll=round(roll, 1))


def pose_difference(source: PoseAngles, target: PoseAngles) -> PoseAngles:
    """``target - source`` per angle (roll wrapped to [-180, 180))."""
    roll = (target.roll - source.roll + 180.0) % 360.0 - 180.0
    return PoseAngles(
        yaw=round(target.yaw - source.yaw, 1),
        pitch=round(target.pitch - source.pitch, 1),
        roll=round(roll, 1),
    )


def pose_mismatch(difference: PoseAngles, limits: PoseAngles = POSE_LIMITS) -> bool:
    """Whether any angle of ``difference`` exceeds its limit."""
    return (
        abs(difference.yaw) > limits.yaw
        or abs(difference.pitch) > limits.pitch
        or abs(difference.roll) > limits.roll
    )


MIRROR_GAIN = 8.0
"""Degrees by which mirroring the source must bring its yaw closer to the target's."""


def mirrored(pose: PoseAngles) -> PoseAngles:
    """The pose of the same face mirrored left to right."""
    return PoseAngles(yaw=-pose.yaw, pitch=pose.pitch, roll=-pose.roll)


def should_mirror(source: PoseAngles, target: PoseAngles) -> bool:
    """Whether the source, mirrored, faces the target's way: the yaws have opposite signs
    and mirroring brings them at least ``MIRROR_GAIN`` degrees closer."""
    return abs(target.yaw + source.yaw) + MIRROR_GAIN <= abs(target.yaw - source.yaw)


def fused_pose(source: PoseAngles, target: PoseAngles, *, mirror: bool) -> PoseAngles:
    """The pose of the source as it is fused onto ``target``: mirrored where
    ``should_mirror`` (and ``mirror`` allows it)."""
    return mirrored(source) if mirror and should_mirror(source, target) else source
