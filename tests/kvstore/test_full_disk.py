"""Device failures reach the caller as clear errors and leave the store usable.

One test uses a real full filesystem (a 1 MiB tmpfs mounted for the test; skipped where the
test may not mount), the others inject failures with FaultyTier.
"""

from __future__ import annotations

import errno
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.clock import FakeClock
from kvstore.config import StoreConfig, TierSpec
from kvstore.errors import ConfigError, TierIOError
from kvstore.registry import make_tier
from kvstore.store import KVStore
from tests.conftest import BB, SMALL_NS, chain_for, small_tiers
from tests.kvstore.test_store import assert_payloads, load, put_chain
from tiers.faulty import FaultyTier


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_real_full_disk_on_the_object_tier(tmp_path: Path, tiny_fs: Path) -> None:
    tiers = (
        TierSpec("dram", "dram", {"capacity_bytes": 64 * BB, "slab_bytes": 4 * BB}),
        TierSpec("object", "object", {"capacity_bytes": 4096 * BB, "url": f"file://{tiny_fs}/objects"}),
    )
    with KVStore(StoreConfig(root=tmp_path / "store", tiers=tiers), clock=FakeClock()) as s:
        s.register_namespace(SMALL_NS)
        acked = []
        with pytest.raises(TierIOError, match="No space left"):
            for i in range(400):  # 1 MiB holds < 256 blocks of 4 KiB + headers
                c = chain_for(i, 1)
                put_chain(s, c, durable=True)
                acked.append(c)
        assert len(acked) > 10
        # Still usable: everything acknowledged reads back, volatile puts and lookups work.
        for c in acked[-5:]:
            n, buf = load(s, c)
            assert n == 1
            assert_payloads(c, buf, n)
        extra = chain_for(9999, 2)
        assert put_chain(s, extra) == 2
        assert load(s, extra)[0] == 2
        # Freeing room makes durable puts work again.
        assert s.delete(SMALL_NS, [acked[0][0], acked[1][0], acked[2][0]]) == 3
        put_chain(s, chain_for(5000, 1), durable=True)


def test_nvme_capacity_larger_than_the_disk_is_refused_at_open(tmp_path: Path, tiny_fs: Path) -> None:
    # Refused before posix_fallocate: the message says what was asked and what is free, and
    # nothing is left behind on the disk.
    with pytest.raises(ConfigError, match="(?s)capacity_bytes asks for.*free"):
        make_tier("nvme", "nvme", {"capacity_bytes": "64MiB", "slab_bytes": "1MiB"}, tiny_fs)
    assert not list(tiny_fs.rglob("data.slab"))


def test_injected_write_failure_on_durable_put(tmp_path: Path) -> None:
    clock = FakeClock()
    tiers = [make_tier(t.kind, t.name, dict(t.options), tmp_path, clock) for t in small_tiers()]
    faulty = FaultyTier(tiers[1])
    tiers[1] = faulty
    with KVStore(StoreConfig(root=tmp_path, tiers=small_tiers()), clock=clock, tiers=tiers) as s:
        s.register_namespace(SMALL_NS)
        c = chain_for(1, 3)
        faulty.inject("write", TierIOError(errno.ENOSPC, "No space left on device"), times=1)
        with pytest.raises(TierIOError):
            put_chain(s, c, durable=True)
        assert s.stats()["tier_errors"] == 1
        # The blocks reached DRAM; a retry of the durable put completes the durable copy.
        assert load(s, c)[0] == 3
        put_chain(s, c, durable=True)
        assert all(faulty.contains(h) for h in c)


def test_injected_read_failure_falls_back_to_another_copy(tmp_path: Path) -> None:
    clock = FakeClock()
    tiers = [make_tier(t.kind, t.name, dict(t.options), tmp_path, clock) for t in small_tiers()]
    faulty = FaultyTier(tiers[0])
    tiers[0] = faulty
    with KVStore(StoreConfig(root=tmp_path, tiers=small_tiers()), clock=clock, tiers=tiers) as s:
        s.register_namespace(SMALL_NS)
        c = chain_for(2, 3)
        put_chain(s, c, durable=True)  # written once, to NVMe
        load(s, c)  # promoted: copies in DRAM and NVMe
        faulty.inject("read_into", TierIOError, when=lambda k: k == c[1])
        n, buf = load(s, c)
        assert n == 3
        assert_payloads(c, buf, n)
        assert s.stats()["hits_by_tier"] == {"dram": 2, "nvme": 3 + 1}  # the promoting load, then this one
