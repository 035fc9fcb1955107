"""The names of the pipeline's stages, in the order ``tasks.stages.PIPELINE`` runs them
(checked there at import). Apart from the table so that what only names stages (the
settings block, the video coordinator that loads it on the control pool) does not import
the pipeline and its models."""

from __future__ import annotations

from typing import Literal, get_args

StageName = Literal[
    "load",
    "moderate_inputs",
    "detect",
    "align",
    "fuse",
    "enhance",
    "postprocess",
    "quality",
    "moderate_result",
    "store",
]
"""The stages, in the order ``PIPELINE`` runs them."""
STAGE_NAMES: tuple[StageName, ...] = get_args(StageName)
