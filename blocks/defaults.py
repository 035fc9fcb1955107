"""Default block documents for the local stack (``faceflow blocks init``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from blocks.settings import FusionSettings
from blocks.storage import LOCAL_STORAGE_NAME, faceflow_home, local_storage

SETTINGS_NAME = "default"


@dataclass(frozen=True)
class SavedBlocks:
    """Document names of the blocks ``init_default_blocks`` saved."""

    storage: str
    settings: str
    storage_path: Path


def init_default_blocks(home: str | Path | None = None) -> SavedBlocks:
    """Save (overwrite) the local stack's storage and fusion settings blocks. (Webhooks are
    signed by the relay with each user's own secret, kept in the job store.)"""
    home_path = faceflow_home(home)
    storage = local_storage(home_path)
    Path(str(storage.basepath)).mkdir(parents=True, exist_ok=True)
    storage.save(LOCAL_STORAGE_NAME, overwrite=True)
    FusionSettings().save(SETTINGS_NAME, overwrite=True)
    return SavedBlocks(
        storage=f"local-file-system/{LOCAL_STORAGE_NAME}",
        settings=f"fusion-settings/{SETTINGS_NAME}",
        storage_path=Path(str(storage.basepath)),
    )
