"""Default block documents for the local stack (``faceflow blocks init``)."""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from pydantic import SecretStr

from blocks.settings import FusionSettings
from blocks.storage import LOCAL_STORAGE_NAME, faceflow_home, local_storage
from blocks.webhooks import WebhookSettings

SETTINGS_NAME = "default"
WEBHOOK_SETTINGS_NAME = "default"
WEBHOOK_SECRET_ENV = "FACEFLOW_WEBHOOK_SECRET"


@dataclass(frozen=True)
class SavedBlocks:
    """Document names of the blocks ``init_default_blocks`` saved."""

    storage: str
    settings: str
    webhooks: str
    storage_path: Path


def init_default_blocks(
    home: str | Path | None = None, *, webhook_secret: str | None = None
) -> SavedBlocks:
    """Save (overwrite) the local stack's storage, fusion and webhook blocks.

    The webhook signing secret is ``webhook_secret``, else ``$FACEFLOW_WEBHOOK_SECRET``,
    else a fresh random one (local development only: receivers must be told the new one).
    """
    home_path = faceflow_home(home)
    storage = local_storage(home_path)
    Path(str(storage.basepath)).mkdir(parents=True, exist_ok=True)
    storage.save(LOCAL_STORAGE_NAME, overwrite=True)
    FusionSettings().save(SETTINGS_NAME, overwrite=True)
    secret = webhook_secret or os.environ.get(WEBHOOK_SECRET_ENV) or secrets.token_urlsafe(32)
    WebhookSettings(signing_secret=SecretStr(secret)).save(WEBHOOK_SETTINGS_NAME, overwrite=True)
    return SavedBlocks(
        storage=f"local-file-system/{LOCAL_STORAGE_NAME}",
        settings=f"fusion-settings/{SETTINGS_NAME}",
        webhooks=f"webhook-settings/{WEBHOOK_SETTINGS_NAME}",
        storage_path=Path(str(storage.basepath)),
    )
