"""Blocks: registration, save/load round trips (secrets included), defaults, local storage,
the per-process block cache."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from blocks import ALL_BLOCKS, FusionSettings, init_default_blocks
from blocks.cache import BLOCK_CACHE, TTL_ENV
from blocks.settings import STAGE_NAMES, default_budgets_s, load_settings
from blocks.signing import load_credentials
from blocks.storage import (
    LOCAL_STORAGE_NAME,
    load_storage,
    location_of,
    read_bytes,
    write_bytes,
)
from faceflow.testing.prefect import PrefectServer
from flows.params import DEFAULT_SETTINGS_BLOCK, DEFAULT_SIGNING_BLOCK, DEFAULT_STORAGE_BLOCK
from tasks.errors import InvalidInput
from tasks.options import FusionOptions
from tasks.provenance import dev_root_path
from tests.orchestration.conftest import Home
from tests.orchestration.helpers import check_file_transfer, prefect_cli


def test_every_field_is_described_in_a_sentence() -> None:
    for block in ALL_BLOCKS:
        assert block._block_type_name and block._description
        for name, info in block.model_fields.items():
            assert info.description and info.description.endswith("."), (block, name)


def test_block_register_module(prefect_server: PrefectServer) -> None:
    prefect_cli(prefect_server, "block", "register", "-m", "blocks")
    for slug in ("fusion-settings",):
        response = httpx.get(f"{prefect_server.api_url}/block_types/slug/{slug}", timeout=10)
        assert response.status_code == 200, slug


def test_fusion_settings_round_trip_and_partial_stage_overrides(prefect_harness: Home) -> None:
    FusionSettings(
        fuser="inswapper", stage_budgets_s={"fuse": 5.0}, stage_retries={"detect": 0}
    ).save("round-trip", overwrite=True)
    loaded = load_settings("fusion-settings/round-trip")
    assert loaded.fuser == "inswapper"
    fuse = loaded.policy("fuse")
    assert (fuse.budget_s, fuse.retries) == (5.0, 1)
    assert loaded.policy("detect").retries == 0
    assert loaded.policy("load").budget_s == default_budgets_s()["load"]
    assert {loaded.policy(s).stage for s in STAGE_NAMES} == set(STAGE_NAMES)
    with pytest.raises(TypeError):
        load_settings(DEFAULT_STORAGE_BLOCK)


def test_invalid_stage_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        FusionSettings(stage_budgets_s={"detect": 0.0})
    with pytest.raises(ValueError):
        FusionSettings.model_validate({"stage_retries": {"paint": 1}})


def test_settings_fill_only_what_the_job_did_not_choose() -> None:
    settings = FusionSettings(fuser="inswapper", identity_weight=0.5)
    unset = settings.apply_defaults(FusionOptions.model_validate({}))
    assert (unset.fuser, unset.identity_weight) == ("inswapper", 0.5)
    chosen = settings.apply_defaults(FusionOptions.model_validate({"fuser": "classic"}))
    assert (chosen.fuser, chosen.identity_weight) == ("classic", 0.5)


def test_default_blocks_and_local_storage(prefect_harness: Home) -> None:
    saved = init_default_blocks(prefect_harness.path)
    assert (saved.storage, saved.settings) == (DEFAULT_STORAGE_BLOCK, DEFAULT_SETTINGS_BLOCK)
    assert saved.storage.endswith(LOCAL_STORAGE_NAME)
    assert saved.storage_path == prefect_harness.storage.resolve()
    write_bytes(DEFAULT_STORAGE_BLOCK, "results/x/attempt-1.png", b"\x89PNG-ish")
    assert (prefect_harness.storage / "results/x/attempt-1.png").read_bytes() == b"\x89PNG-ish"
    assert read_bytes(DEFAULT_STORAGE_BLOCK, "results/x/attempt-1.png") == b"\x89PNG-ish"
    store = load_storage(DEFAULT_STORAGE_BLOCK)
    uri = location_of(store, "results/x/attempt-1.png")
    assert uri == (prefect_harness.storage.resolve() / "results/x/attempt-1.png").as_uri()
    with pytest.raises(InvalidInput):
        read_bytes(DEFAULT_STORAGE_BLOCK, "inputs/zz/none.jpg")


def test_default_signing_block_holds_a_development_chain(
    prefect_harness: Home, tmp_path: Path
) -> None:
    """The harness made the chain at its first start; another call keeps it. A new home
    gets a new chain, saved as the block, whose leaf C2PA accepts (tests/test_provenance.py
    signs with it)."""
    kept = init_default_blocks(prefect_harness.path)
    assert kept.signing == DEFAULT_SIGNING_BLOCK and not kept.signing_created
    assert kept.trust_anchor == dev_root_path(prefect_harness.path.resolve())
    before = load_credentials(DEFAULT_SIGNING_BLOCK)
    fresh = init_default_blocks(tmp_path)
    try:
        assert fresh.signing_created and fresh.trust_anchor.is_file()
        assert (fresh.trust_anchor.parent / "signer.key").stat().st_mode & 0o077 == 0
        BLOCK_CACHE.clear()
        made = load_credentials(DEFAULT_SIGNING_BLOCK)
        assert made != before and made.cert_chain_pem.endswith(fresh.trust_anchor.read_text())
    finally:
        init_default_blocks(prefect_harness.path)  # the session's blocks again
        BLOCK_CACHE.clear()
    assert load_credentials(DEFAULT_SIGNING_BLOCK) == before


def test_local_storage_moves_files_by_path(prefect_harness: Home, tmp_path: Path) -> None:
    check_file_transfer(DEFAULT_STORAGE_BLOCK, tmp_path)
    assert not list(prefect_harness.storage.rglob("*.partial"))  # renamed when whole


def test_a_changed_block_is_used_once_the_cache_ttl_passed(
    prefect_harness: Home, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(TTL_ENV, "2")
    name = "fusion-settings/cache-ttl"
    FusionSettings(identity_weight=0.3).save("cache-ttl", overwrite=True)
    loaded_at = time.monotonic()
    assert load_settings(name).identity_weight == 0.3
    FusionSettings(identity_weight=0.6).save("cache-ttl", overwrite=True)
    cached = load_settings(name)
    if time.monotonic() - loaded_at < 1.9:  # a very slow save may outlast the TTL itself
        assert cached.identity_weight == 0.3  # within the TTL: no API call, the old document
    time.sleep(max(0.0, loaded_at + 2.1 - time.monotonic()))
    assert load_settings(name).identity_weight == 0.6  # the TTL passed: reloaded


def test_a_zero_cache_ttl_loads_every_time(
    prefect_harness: Home, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(TTL_ENV, "0")
    FusionSettings(identity_weight=0.2).save("cache-off", overwrite=True)
    assert load_settings("fusion-settings/cache-off").identity_weight == 0.2
    FusionSettings(identity_weight=0.7).save("cache-off", overwrite=True)
    assert load_settings("fusion-settings/cache-off").identity_weight == 0.7
