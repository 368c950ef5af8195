"""The put path's deferred checksums: a block put into a volatile tier carries none; every
persistent copy (a demotion, a durable put, the copies made on close) carries the payload's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvstore.block import CHECKSUM_DEFERRED, BlockMeta, payload_checksum
from kvstore.store import KVStore
from tests.conftest import BB, SMALL_NS, chain_for, payload, small_tiers


def _put(store: KVStore, chain: list[bytes], **kw: object) -> int:
    return store.put(SMALL_NS, chain, [payload(h) for h in chain], **kw)  # type: ignore[arg-type]


def test_a_volatile_copy_defers_its_checksum_and_a_demoted_copy_carries_it(make_store) -> None:  # type: ignore[no-untyped-def]
    s = make_store(tiers=small_tiers(dram_blocks=4, nvme_blocks=16, object_blocks=32))
    dram, nvme = s.tiers[0], s.tiers[1]
    first = chain_for(1, 4)
    assert _put(s, first) == 4
    assert [dram.meta(h).checksum for h in first] == [CHECKSUM_DEFERRED] * 4
    assert _put(s, chain_for(2, 4)) == 4  # the first chain moves down to NVMe
    assert all(not dram.contains(h) and nvme.contains(h) for h in first)
    assert [nvme.meta(h).checksum for h in first] == [payload_checksum(payload(h)) for h in first]
    buf = np.zeros(4 * BB, np.uint8)
    assert s.get_into(SMALL_NS, first, buf) == 4  # NVMe verifies what it serves
    assert buf.tobytes() == b"".join(payload(h) for h in first)


def test_a_durable_put_writes_checksummed_copies(make_store) -> None:  # type: ignore[no-untyped-def]
    s = make_store()
    dram_only, durable = chain_for(3, 2, shared_prefix_blocks=2), chain_for(4, 3, shared_prefix_blocks=2)
    assert _put(s, dram_only) == 2
    assert s.put(SMALL_NS, durable, [payload(h) for h in durable[2:]], start=2, durable=True) == 1
    nvme = s.tiers[1]
    assert [nvme.meta(h).checksum for h in durable] == [payload_checksum(payload(h)) for h in durable]


def test_copies_persisted_on_close_are_checksummed(tmp_path: Path, make_store) -> None:  # type: ignore[no-untyped-def]
    s = make_store()
    chain = chain_for(5, 3)
    assert _put(s, chain) == 3
    s.close()
    reopened = make_store()  # a warm restart: only the NVMe copies are left, and they verify
    buf = np.zeros(3 * BB, np.uint8)
    assert reopened.get_into(SMALL_NS, chain, buf) == 3
    assert buf.tobytes() == b"".join(payload(h) for h in chain)


def test_a_deferred_checksum_cannot_be_packed() -> None:
    meta = BlockMeta(b"N" * 16, b"P" * 16, 0, BB, 0.0, CHECKSUM_DEFERRED, 0.0)
    with pytest.raises(ValueError, match="checksum was deferred"):
        meta.pack()
    assert BlockMeta.unpack(meta.with_checksum(7).pack()).checksum == 7
