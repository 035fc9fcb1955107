"""FaceFlow's Prefect blocks: ``prefect block register -m blocks`` registers them."""

from blocks.defaults import init_default_blocks
from blocks.settings import FusionSettings
from blocks.webhooks import WebhookSettings

ALL_BLOCKS = (FusionSettings, WebhookSettings)
"""The block types FaceFlow defines (storage uses Prefect's and prefect-aws's own)."""

__all__ = ["ALL_BLOCKS", "FusionSettings", "WebhookSettings", "init_default_blocks"]
