"""The local object tier's header manifest: written at close, read back at the next open when
it is current, and ignored (or partly ignored) when it is missing, stale or torn."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvstore.clock import FakeClock
from kvstore.registry import make_tier
from tiers.object import ObjectTier, manifest
from tiers.object import local as local_backend

MakeBlock = Callable[..., Any]


@pytest.fixture
def file_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Paths whose header was read from the object file itself."""
    reads: list[str] = []
    real = local_backend.raw_header

    def counted(path: str) -> bytes:
        reads.append(path)
        return real(path)

    monkeypatch.setattr(local_backend, "raw_header", counted)
    return reads


def _fill(tier: ObjectTier, make_block: MakeBlock, seeds: range) -> dict[bytes, Any]:
    blocks = {}
    for s in seeds:
        b = make_block(4096, seed=s)
        tier.write(b.key, b.data, b.meta)
        blocks[b.key] = b.meta
    return blocks


def _scan(tier: ObjectTier) -> dict[bytes, Any]:
    return dict(tier.scan())


def test_a_current_manifest_replaces_every_header_read(open_tier: Callable[..., ObjectTier], make_block: MakeBlock, file_reads: list[str]) -> None:
    tier = open_tier(worker_interval_s=0)
    blocks = _fill(tier, make_block, range(20))
    tier.close()
    assert os.path.exists(tier._manifest_path)  # noqa: SLF001 - where the manifest lives
    file_reads.clear()
    again = open_tier(worker_interval_s=0)
    assert _scan(again) == blocks
    assert file_reads == []  # every header came from the manifest
    assert again.usage().blocks == 20


def test_a_crash_leaves_no_manifest(open_tier: Callable[..., ObjectTier], make_block: MakeBlock, file_reads: list[str]) -> None:
    """A restart that used the manifest removes it: a run that then crashes (no close) leaves
    none, and the next restart reads every header, including those the run changed."""
    tier = open_tier(worker_interval_s=0)
    blocks = _fill(tier, make_block, range(6))
    tier.close()
    crashed = open_tier(worker_interval_s=0)
    assert _scan(crashed) == blocks
    assert not os.path.exists(crashed._manifest_path)  # noqa: SLF001
    blocks |= _fill(crashed, make_block, range(6, 8))
    file_reads.clear()
    again = open_tier(worker_interval_s=0)  # crashed is never closed
    assert _scan(again) == blocks
    assert len(file_reads) == 8


def test_a_stale_manifest_serves_only_the_objects_it_describes(
    open_tier: Callable[..., ObjectTier], make_block: MakeBlock, file_reads: list[str]
) -> None:
    """Objects changed by no run of this tier since the manifest (another node on a shared
    directory, or a manifest whose removal a crash undid): listed objects that are not the
    ones recorded (new, rewritten, gone) are read from their files."""
    tier = open_tier(worker_interval_s=0)
    blocks = _fill(tier, make_block, range(10))
    tier.close()
    saved = Path(tier._manifest_path).read_bytes()  # noqa: SLF001
    other = open_tier(worker_interval_s=0)
    new = _fill(other, make_block, range(10, 14))
    blocks |= new
    gone = next(iter(blocks))
    other.delete(gone)
    del blocks[gone]
    b = make_block(4000, seed=3)  # rewritten: another size, so another stat whatever the clock
    other.delete(b.key)
    other.write(b.key, b.data, b.meta)
    blocks[b.key] = b.meta
    Path(tier._manifest_path).write_bytes(saved)  # noqa: SLF001 - the old manifest is back
    file_reads.clear()
    again = open_tier(worker_interval_s=0)
    assert _scan(again) == blocks
    assert sorted(file_reads) == sorted(again.path(k) for k in [*new, b.key])


@pytest.mark.parametrize("damage", ["missing", "torn", "garbage", "left_temp"])
def test_a_missing_or_torn_manifest_falls_back_to_the_headers(
    open_tier: Callable[..., ObjectTier], make_block: MakeBlock, file_reads: list[str], damage: str
) -> None:
    tier = open_tier(worker_interval_s=0)
    blocks = _fill(tier, make_block, range(12))
    tier.close()
    path = tier._manifest_path  # noqa: SLF001
    data = Path(path).read_bytes()
    if damage == "missing":
        os.unlink(path)
    elif damage == "torn":  # cut short: the checksum no longer holds
        Path(path).write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        Path(path).write_bytes(b"not a manifest at all")
    else:  # a crash while the next manifest was being written: the old one is still whole
        Path(f"{path}.tmp").write_bytes(data[:10])
    file_reads.clear()
    again = open_tier(worker_interval_s=0)
    assert _scan(again) == blocks
    assert len(file_reads) == (0 if damage == "left_temp" else 12)
    again.close()
    assert manifest.load(path) is not None and len(manifest.load(path) or ()) == 12  # rewritten whole


def test_reading_offline_writes_no_manifest(tmp_path: Path, make_block: MakeBlock) -> None:
    tier = make_tier("object", "o", {"capacity_bytes": "4MiB", "worker_interval_s": 0, "manifest": False},
                     root=tmp_path, clock=FakeClock())
    _fill(tier, make_block, range(3))
    tier.close()
    assert not os.path.exists(tier._manifest_path)  # noqa: SLF001
    found = ObjectTier.read_offline("o", tier.config, tmp_path, FakeClock())
    assert len(found.blocks) == 3
    assert not os.path.exists(tier._manifest_path)  # noqa: SLF001 - the offline read wrote none
