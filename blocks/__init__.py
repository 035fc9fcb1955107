"""FaceFlow's Prefect blocks: ``prefect block register -m blocks`` registers them."""

from blocks.defaults import init_default_blocks
from blocks.settings import FusionSettings

ALL_BLOCKS = (FusionSettings,)
"""The block types FaceFlow defines (storage uses Prefect's and prefect-aws's own)."""

__all__ = ["ALL_BLOCKS", "FusionSettings", "init_default_blocks"]
