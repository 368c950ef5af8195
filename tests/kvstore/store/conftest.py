"""Stores over null tiers for exact scenarios: tiny blocks, integer keys, a fake clock."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from kvstore.clock import FakeClock
from kvstore.config import StoreConfig, TierSpec
from kvstore.keys import KVLayout, LayerGroup, Namespace
from kvstore.store import KVStore

NS = Namespace("test/null", KVLayout("uint8", 4, (LayerGroup("full", 1, 1, 1),)))
BLOCK = bytes(NS.block_bytes)


def key(name: str) -> bytes:
    """A 16-byte block hash named for reading: ``key("a0")``."""
    return name.encode().ljust(16, b".")


def chain(*names: str) -> list[bytes]:
    return [key(n) for n in names]


def put(store: KVStore, names: Sequence[str], start: int = 0, **kw: Any) -> int:
    c = chain(*names)
    return store.put(NS, c, [BLOCK] * (len(c) - start), start=start, **kw)


def get(store: KVStore, names: Sequence[str]) -> int:
    c = chain(*names)
    return store.get_into(NS, c, [bytearray(NS.block_bytes) for _ in c])


def resident(store: KVStore) -> set[str]:
    return {bytes.fromhex(b["hash"]).rstrip(b".").decode() for b in store.iter_blocks()}


def where(store: KVStore) -> dict[str, list[str]]:
    return {bytes.fromhex(b["hash"]).rstrip(b".").decode(): b["tiers"] for b in store.iter_blocks()}


def null_tiers(*blocks: int) -> tuple[TierSpec, ...]:
    return tuple(TierSpec(f"t{i}", "null", {"capacity_blocks": n}) for i, n in enumerate(blocks))


@pytest.fixture
def null_store(tmp_path: Path) -> Iterator[Callable[..., KVStore]]:
    """``null_store(4, 8, policy="lru", tiers=None, **config)``: a registered store over null
    tiers of those capacities (or ``tiers``: tier objects), on a FakeClock."""
    built: list[KVStore] = []

    def make(*blocks: int, policy: str = "lru", tiers: list[Any] | None = None, **kw: Any) -> KVStore:
        specs = null_tiers(*blocks) if blocks else null_tiers(*(1 for _ in tiers or ()))
        cfg = StoreConfig(root=tmp_path / f"s{len(built)}", tiers=specs, policy=policy, persist_on_close=False, **kw)
        s = KVStore(cfg, clock=FakeClock(), tiers=tiers)
        s.register_namespace(NS)
        built.append(s)
        return s

    yield make
    for s in built:
        s.close()
