"""A config the store would refuse is refused before anything is allocated (issue 33, item 8).

``capacity_bytes = "1000TiB"`` on NVMe used to build a slab map in proportion to it (a
``MemoryError`` after 24 s under a 2 GiB cap); a misspelled policy or admission rule, or an option
it does not take, was caught only after the NVMe file was preallocated. Each is now a
ConfigError raised in bounded memory, with no file left behind.
"""

from __future__ import annotations

import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from kvstore.config import StoreConfig, TierSpec
from kvstore.errors import ConfigError
from kvstore.store import KVStore
from tests.conftest import small_tiers


def _tiers(nvme: str = "1MiB", dram: str = "1MiB") -> tuple[TierSpec, ...]:
    return (
        TierSpec("dram", "dram", {"capacity_bytes": dram, "slab_bytes": "256KiB"}),
        TierSpec("nvme", "nvme", {"capacity_bytes": nvme, "slab_bytes": "256KiB"}),
    )


CASES: list[tuple[str, dict[str, Any], str]] = [
    ("nvme past the disk", {"tiers": _tiers(nvme="1000TiB")}, "more than the filesystem"),
    ("nvme far past the disk", {"tiers": _tiers(nvme=str(1 << 62))}, "more than the filesystem"),
    ("dram past the machine", {"tiers": _tiers(dram="1000TiB")}, "more than this machine's memory"),
    ("misspelled policy", {"tiers": small_tiers(), "policy": "densty"}, "densty"),
    ("policy option it does not take", {"tiers": small_tiers(), "policy_options": {"ghost_factr": 4}}, "ghost_factr"),
    ("misspelled admission", {"tiers": small_tiers(), "admission": "resue"}, "resue"),
    ("admission option it does not take", {"tiers": small_tiers(), "admission_options": {"budget": 1}}, "budget"),
]


@pytest.mark.parametrize(("what", "kw", "says"), CASES, ids=[c[0] for c in CASES])
def test_refused_before_anything_is_allocated(tmp_path: Path, what: str, kw: dict[str, Any], says: str) -> None:
    root = tmp_path / "store"
    tracemalloc.start()
    try:
        with pytest.raises(ConfigError, match=says):
            KVStore(StoreConfig(root=root, **kw))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, f"{what}: {peak} bytes allocated before the refusal"
    left = [p for p in root.rglob("*") if p.is_file()] if root.exists() else []
    assert not left, f"{what}: files left behind: {left}"


@pytest.mark.parametrize("where", ["publish", "replay"])
def test_an_unauthenticated_event_stream_binds_loopback_only(tmp_path: Path, where: str) -> None:
    """Issue 33, item 7: ``publish = "tcp://0.0.0.0:5557"`` with no tenants put every block hash
    and prompt token off the machine unauthenticated; refused as a non-loopback HTTP port is."""
    from kvstore.events import EventsConfig
    from kvstore.server.config import ServerConfig, TenantSpec
    from kvstore.server.daemon import Daemon

    def events(host: str) -> EventsConfig:
        urls = {"publish": "tcp://127.0.0.1:5557", where: f"tcp://{host}:5558"}
        return EventsConfig(**urls)  # type: ignore[arg-type]

    with pytest.raises(ConfigError, match=f"\\[events\\] {where} .* not loopback"):
        Daemon(StoreConfig(root=tmp_path, events=events("0.0.0.0")), ServerConfig())
    Daemon(StoreConfig(root=tmp_path, events=events("127.0.0.1")), ServerConfig())  # loopback: fine
    tenants = (TenantSpec("a", "token-of-tenant-a-0123456789"),)
    Daemon(StoreConfig(root=tmp_path, events=events("0.0.0.0")), ServerConfig(host="0.0.0.0", tenants=tenants))
