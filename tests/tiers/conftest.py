"""Fixtures shared by the tier tests: a factory that builds (and reopens) any registered tier,
block makers, and a helper that corrupts a payload where it lies on disk."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash

from kvstore.block import BlockMeta, payload_checksum
from kvstore.clock import FakeClock
from kvstore.keys import BlockHash
from kvstore.registry import TIERS, make_tier, tier_class
from tiers.base import Tier, tier_dir
from tiers.faulty import FaultyTier

KiB = 1024
MiB = 1024 * KiB

KINDS = ["hbm", "dram", "nvme", "object", "s3"]
"""Every registered tier kind: the conformance suite runs once per kind. "s3" is the object tier
on a real S3 server (moto_server, a separate process) instead of file://."""

REGISTRY_KIND = {"s3": "object"}

TIER_NAME = "t0"

# Small tiers keep the suite fast: 4 slabs of 1 MiB (the object tier has no slabs).
SMALL_OPTIONS: dict[str, dict[str, Any]] = {
    "hbm": {"capacity_bytes": "4MiB", "slab_bytes": "1MiB", "device": "cpu"},
    "dram": {"capacity_bytes": "4MiB", "slab_bytes": "1MiB"},
    "nvme": {"capacity_bytes": "4MiB", "slab_bytes": "1MiB"},
    "object": {"capacity_bytes": "4MiB"},
    "s3": {"capacity_bytes": "4MiB"},
}


class TierFactory:
    """Builds the tier of one kind through the registry, always on the same root and name, so
    that a persistent tier can be closed and reopened on its own files."""

    def __init__(
        self, kind: str, root: Path, clock: FakeClock, extra: dict[str, Any] | None = None
    ) -> None:
        self.kind = kind
        self.root = root
        self.clock = clock
        self.extra = extra or {}
        self.opened: list[Tier] = []

    def __call__(self, **overrides: Any) -> Tier:
        options = {**SMALL_OPTIONS[self.kind], **self.extra, **overrides}
        tier = make_tier(
            REGISTRY_KIND.get(self.kind, self.kind), TIER_NAME, options, root=self.root, clock=self.clock
        )
        self.opened.append(tier)
        return tier

    def reopen(self, tier: Tier, **overrides: Any) -> Tier:
        tier.close()
        return self(**overrides)

    @property
    def persistent(self) -> bool:
        return bool(tier_class(REGISTRY_KIND.get(self.kind, self.kind)).persistent)

    def require_persistent(self) -> None:
        if not self.persistent:
            pytest.skip(f"tier kind {self.kind!r} is not persistent")

    @property
    def dir(self) -> Path:
        return tier_dir(self.root, TIER_NAME)

    def corrupt(self, payload: bytes, *, at: int | None = None) -> None:
        """Flip one byte of ``payload`` where the tier keeps it: a file under :attr:`dir`, or
        the object in the bucket."""
        if "url" not in self.extra:
            _corrupt_payload(self.dir, payload, at=at)
            return
        tier = self.opened[0]
        fs = tier.blobs.fs  # type: ignore[attr-defined]
        hits = []
        for path in fs.find(tier._blocks):  # type: ignore[attr-defined]
            raw = bytearray(fs.cat_file(path))
            pos = raw.find(payload[:64])
            if pos >= 0 and raw[pos : pos + len(payload)] == payload:
                hits.append((path, raw, pos))
        assert len(hits) == 1, f"payload found {len(hits)} times in the bucket"
        path, raw, pos = hits[0]
        raw[pos + (len(payload) // 2 if at is None else at)] ^= 0xFF
        fs.pipe_file(path, bytes(raw))

    def close_all(self) -> None:
        for tier in reversed(self.opened):
            tier.close()


def _require_kind(kind: str) -> None:
    """Skip a kind whose module cannot be imported (a tier still being written elsewhere)."""
    module = TIERS[REGISTRY_KIND.get(kind, kind)].partition(":")[0]
    try:
        importlib.import_module(module)
    except ImportError as e:
        pytest.skip(f"tier kind {kind!r}: cannot import {module}: {e}")


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    _require_kind(request.param)
    return request.param


@pytest.fixture
def factory(
    kind: str, tmp_path: Path, clock: FakeClock, request: pytest.FixtureRequest
) -> Iterator[TierFactory]:
    extra = request.getfixturevalue("s3_tier_options") if kind == "s3" else None
    f = TierFactory(kind, tmp_path, clock, extra)
    yield f
    f.close_all()


@pytest.fixture
def plain_tier(factory: TierFactory) -> Tier:
    return factory()


@pytest.fixture(params=["plain", "faulty"])
def tier(request: pytest.FixtureRequest, factory: TierFactory) -> Tier:
    """The tier, and the same tier inside a FaultyTier with no fault armed: the wrapper must be
    indistinguishable from what it wraps."""
    inner = factory()
    return FaultyTier(inner) if request.param == "faulty" else inner


@dataclass(frozen=True)
class Block:
    key: BlockHash
    data: bytes
    meta: BlockMeta


def _make_block(
    size: int,
    seed: int,
    clock: FakeClock | None = None,
    *,
    depth: int = 0,
    ns: bytes = b"N" * 16,
) -> Block:
    """A block of ``size`` random bytes whose key and metadata derive from ``seed``.

    Random payloads make every block's bytes unique, so a byte pattern locates it on disk.
    """
    rng = np.random.default_rng(seed)
    data = rng.bytes(size)
    key = BlockHash(xxhash.xxh3_128_digest(seed.to_bytes(8, "little") + b"key"))
    parent = xxhash.xxh3_128_digest(seed.to_bytes(8, "little") + b"parent")
    now = clock() if clock is not None else 1_700_000_000.0
    meta = BlockMeta(
        ns=ns,
        parent=parent,
        depth=depth,
        size=size,
        expiry=now + 72 * 3600,
        checksum=payload_checksum(data),
        created=now,
    )
    return Block(key, data, meta)


def _corrupt_payload(directory: Path, payload: bytes, *, at: int | None = None) -> Path:
    """Flip one byte of ``payload`` where it lies in a file under ``directory``.

    Generic over tiers: it searches every file for the payload's bytes instead of knowing a
    layout. ``payload`` must be unique (random, at least 64 bytes). Returns the file changed.
    """
    probe = payload[:64]
    assert len(probe) >= 16, "use a payload of at least 16 random bytes"
    hits: list[tuple[Path, int]] = []
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        data = path.read_bytes()
        pos = data.find(probe)
        if pos >= 0 and data[pos : pos + len(payload)] == payload:
            hits.append((path, pos))
    assert len(hits) == 1, f"payload found {len(hits)} times under {directory}: {hits}"
    path, pos = hits[0]
    pos += len(payload) // 2 if at is None else at
    with open(path, "r+b") as f:
        f.seek(pos)
        byte = f.read(1)
        f.seek(pos)
        f.write(bytes([byte[0] ^ 0xFF]))
    return path


# Helpers reach tests as fixtures: tests/ is not a package, so tests cannot import conftest.
@pytest.fixture
def make_block() -> Callable[..., Block]:
    """``make_block(size, seed, clock=None, *, depth=0, ns=b"N" * 16) -> Block``."""
    return _make_block


@pytest.fixture
def corrupt_payload() -> Callable[..., Path]:
    """``corrupt_payload(directory, payload, *, at=None) -> Path``: flip one payload byte."""
    return _corrupt_payload


@pytest.fixture
def open_tier(tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """``open_tier(name="o", **options) -> ObjectTier`` under this test's directory (4 MiB
    unless told), closed at the end of the test."""
    opened: list[Any] = []

    def _open(name: str = "o", **options: Any) -> Any:
        options.setdefault("capacity_bytes", "4MiB")
        tier = make_tier("object", name, options, root=tmp_path, clock=FakeClock())
        opened.append(tier)
        return tier

    yield _open
    for t in opened:
        t.close()
