"""Default block documents for the local stack (``faceflow blocks init``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from blocks.settings import FusionSettings
from blocks.signing import dev_chain, save_credentials
from blocks.storage import LOCAL_STORAGE_NAME, faceflow_home, local_storage
from tasks.provenance import dev_root_path

SETTINGS_NAME = "default"


@dataclass(frozen=True)
class SavedBlocks:
    """Document names of the blocks ``init_default_blocks`` saved."""

    storage: str
    settings: str
    storage_path: Path
    signing: str
    """The Secret block with the development signing chain (``blocks.signing``)."""
    signing_created: bool
    """Whether this call made the development chain (first start)."""
    trust_anchor: Path
    """The development root certificate (PEM): the anchor that verifies its results."""


def init_default_blocks(home: str | Path | None = None) -> SavedBlocks:
    """Save (overwrite) the local stack's storage, fusion settings and signing blocks; the
    signing block holds the development chain under ``<home>/c2pa/``, made at first use.
    (Webhooks are signed by the relay with each user's own secret, kept in the job store.)"""
    home_path = faceflow_home(home)
    storage = local_storage(home_path)
    Path(str(storage.basepath)).mkdir(parents=True, exist_ok=True)
    storage.save(LOCAL_STORAGE_NAME, overwrite=True)
    FusionSettings().save(SETTINGS_NAME, overwrite=True)
    chain = dev_chain(home_path)
    return SavedBlocks(
        storage=f"local-file-system/{LOCAL_STORAGE_NAME}",
        settings=f"fusion-settings/{SETTINGS_NAME}",
        storage_path=Path(str(storage.basepath)),
        signing=save_credentials(chain.credentials),
        signing_created=chain.created,
        trust_anchor=dev_root_path(home_path),
    )
