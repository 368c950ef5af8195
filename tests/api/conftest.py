"""The implementations of :class:`kvstore.api.KVCacheAPI`, built alike for the API suite.

``store``: a :class:`KVStore` in this process. ``shm`` and ``tcp``: a real daemon
(:class:`ThreadedDaemon`: the asyncio server, its HTTP control plane and data plane on loopback
sockets) with the same tiers and a :class:`kvstore.client.Client` on that plane. Every world
runs on a fake clock, and its object tier can be switched off (as a remote store that is down).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvstore.api import KVCacheAPI
from kvstore.client import connect
from kvstore.clock import Clock, FakeClock
from kvstore.config import StoreConfig, TierSpec
from kvstore.registry import make_tier
from kvstore.server import daemon as daemon_module
from kvstore.server.config import ServerConfig
from kvstore.server.daemon import ThreadedDaemon
from kvstore.store import KVStore
from tests.conftest import BB
from tiers.faulty import FaultyTier

IMPLS = ("store", "shm", "tcp")
DRAM_BLOCKS = 8
TIERS = (
    TierSpec("dram", "dram", {"capacity_bytes": DRAM_BLOCKS * BB, "slab_bytes": 4 * BB}),
    TierSpec("object", "object", {"capacity_bytes": 256 * BB}),
)


class Switchable(FaultyTier):
    """A tier that can be made unreachable, as an object store behind an open circuit breaker."""

    up = True

    def available(self) -> bool:
        return self.up and self.inner.available()


@dataclass
class World:
    kind: str
    api: KVCacheAPI[Any]
    clock: FakeClock
    object_tier: Switchable


def _store(cfg: StoreConfig, clock: Clock, made: list[Switchable]) -> KVStore:
    built = [make_tier(s.kind, s.name, dict(s.options), cfg.root, clock) for s in cfg.tiers]
    built[-1] = Switchable(built[-1])
    made.append(built[-1])
    return KVStore(cfg, clock=clock, tiers=built)


@contextlib.contextmanager
def open_world(kind: str, root: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[World]:
    """One implementation of the API over :data:`TIERS` in ``root``, closed on exit."""
    clock = FakeClock()
    made: list[Switchable] = []
    cfg = StoreConfig(root=root, tiers=TIERS)
    if kind == "store":
        with _store(cfg, clock, made) as store:
            yield World(kind, store, clock, made[0])
        return
    with monkeypatch.context() as m:
        m.setattr(daemon_module, "KVStore", lambda c, clock: _store(c, clock, made))
        d = ThreadedDaemon(cfg, ServerConfig(http_port=0, data_port=0, ucx_port=0), clock=clock)
    try:
        with connect(d.url, plane=kind, retries=0) as client:
            assert client.plane == kind
            yield World(kind, client, clock, made[0])
    finally:
        d.stop()


@pytest.fixture(params=IMPLS)
def world(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[World]:
    with open_world(request.param, tmp_path / request.param, monkeypatch) as w:
        yield w


@pytest.fixture
def open_worlds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[], list[World]]]:
    """Every implementation at once, for tests that compare their answers."""
    with contextlib.ExitStack() as stack:

        def open_all() -> list[World]:
            return [stack.enter_context(open_world(k, tmp_path / f"all-{k}", monkeypatch)) for k in IMPLS]

        yield open_all
