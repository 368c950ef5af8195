"""DRAM tier specifics: the shared-memory arena's life cycle, zero-copy locations, slab classes
and configuration. The Tier contract itself is in test_conformance.py."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.clock import FakeClock
from kvstore.errors import (
    BlockNotFound,
    BufferSizeError,
    ConfigError,
    TierFullError,
    TierIOError,
    UsageError,
)
from kvstore.registry import build_config, make_tier
from kvstore.shm import attach_arena
from tests.kvstore.test_buffers import record_memmoves
from tests.kvstore.test_shm import resident_bytes
from tiers.dram import DramConfig, DramTier

KiB = 1024
MiB = 1024 * KiB
MakeBlock = Callable[..., Any]
SHM = Path("/dev/shm")

pytestmark = pytest.mark.skipif(not SHM.is_dir(), reason="needs POSIX shared memory in /dev/shm")


@pytest.fixture
def dram(tmp_path: Path) -> Iterator[DramTier]:
    tier = DramTier("d0", DramConfig(4 * MiB, slab_bytes=1 * MiB), root=tmp_path, clock=FakeClock())
    yield tier
    tier.close()


def _run(code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter (its own resource tracker), capturing stderr."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


# ---- the arena's life cycle ----------------------------------------------------------------


def test_arena_is_a_named_segment_unlinked_on_close(tmp_path: Path) -> None:
    tier = DramTier("my tier/1", DramConfig(2 * MiB, slab_bytes=1 * MiB), root=tmp_path)
    name = tier.shm_name
    assert name.startswith("kvs-") and "/" not in name and " " not in name
    assert (SHM / name).stat().st_size == 2 * MiB
    assert tier.describe()["shm_name"] == name
    tier.close()
    assert not (SHM / name).exists()
    tier.close()


def test_two_tiers_get_distinct_segments(tmp_path: Path) -> None:
    cfg = DramConfig(1 * MiB, slab_bytes=1 * MiB)
    a, b = DramTier("d", cfg, root=tmp_path), DramTier("d", cfg, root=tmp_path)
    try:
        assert a.shm_name != b.shm_name
    finally:
        a.close()
        b.close()


def test_garbage_collected_tier_unlinks_its_arena(tmp_path: Path) -> None:
    tier = DramTier("d", DramConfig(1 * MiB, slab_bytes=1 * MiB), root=tmp_path)
    name = tier.shm_name
    del tier
    gc.collect()
    assert not (SHM / name).exists()


def test_the_arena_is_faulted_in_off_the_put_path(tmp_path: Path, make_block: MakeBlock) -> None:
    tier = DramTier("d", DramConfig(8 * MiB, slab_bytes=1 * MiB), root=tmp_path)
    try:
        block = make_block(300 * KiB, seed=1)
        tier.write(block.key, block.data, block.meta)  # puts need not wait for the prefault
        assert tier.prefault.done.wait(600)  # a bound for a wedged thread only
        assert tier.prefault.faulted_bytes == 8 * MiB
        assert resident_bytes(tier._buf) >= 8 * MiB  # noqa: SLF001 - the tier's own mapping
        out = bytearray(300 * KiB)
        assert tier.read_into(block.key, memoryview(out)) == len(out) and bytes(out) == bytes(block.data)
    finally:
        tier.close()


def test_a_tier_closed_while_it_faults_its_arena_in_unlinks_it(tmp_path: Path) -> None:
    tier = DramTier("d", DramConfig(64 * MiB, slab_bytes=1 * MiB), root=tmp_path)
    name = tier.shm_name
    tier.close()  # the prefault thread is stopped first: it holds a view of the arena
    assert tier.prefault.done.is_set()
    assert not (SHM / name).exists()


def test_read_many_moves_a_run_back_to_back_in_one_copy(dram: DramTier, make_block: MakeBlock, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = [make_block(64 * KiB, seed=i) for i in range(6)]
    for b in blocks:
        dram.write(b.key, b.data, b.meta)
    assert [dram.location(b.key)[0] for b in blocks] == [i * 64 * KiB for i in range(6)]  # type: ignore[index]
    copies: list[list[int]] = []
    pool = dram._copy  # noqa: SLF001

    class Counting:
        threads = pool.threads

        def copy(self, pairs: list[tuple[memoryview, memoryview]]) -> int:
            copies.append([d.nbytes for d, _ in pairs])
            return pool.copy(pairs)

    monkeypatch.setattr(dram, "_copy", Counting())
    dst = np.zeros(6 * 64 * KiB, np.uint8)
    views = [memoryview(dst)[i * 64 * KiB : (i + 1) * 64 * KiB] for i in range(6)]
    other = bytearray(64 * KiB)  # block 4 goes elsewhere: the run breaks there
    keys = [b.key for b in blocks]
    out = dram.read_many([*keys[:4], make_block(10, seed=99).key, *keys[4:]], [*views[:4], views[4], other, views[5]])
    assert out[:4] == [64 * KiB] * 4 and isinstance(out[4], BlockNotFound)
    assert out[5:] == [64 * KiB] * 2
    assert bytes(dst[: 4 * 64 * KiB]) == b"".join(bytes(b.data) for b in blocks[:4])
    assert bytes(other) == bytes(blocks[4].data) and bytes(views[5]) == bytes(blocks[5].data)
    # one batch: one span for the run, then the strays
    assert copies == [[4 * 64 * KiB, 64 * KiB, 64 * KiB]]
    small = [bytearray(10), bytearray(64 * KiB)]
    out = dram.read_many(keys[:2], small)
    assert isinstance(out[0], BufferSizeError) and out[1] == 64 * KiB and bytes(small[1]) == bytes(blocks[1].data)


def test_write_many_moves_a_run_back_to_back_in_one_copy(dram: DramTier, make_block: MakeBlock, monkeypatch: pytest.MonkeyPatch) -> None:
    import kvstore.buffers as buffers_module  # where the run is gathered (arena_pairs)

    spans: list[int] = []
    real_span = buffers_module.span

    def counting(first: memoryview, nbytes: int, *, writable: bool = True) -> memoryview | None:
        spans.append(nbytes)
        return real_span(first, nbytes, writable=writable)

    monkeypatch.setattr(buffers_module, "span", counting)
    blocks = [make_block(64 * KiB, seed=i) for i in range(5)]
    src = memoryview(b"".join(bytes(b.data) for b in blocks[:3]))  # one caller buffer, read-only
    bad = blocks[4].meta.with_expiry(0.0)
    items = [(b.key, src[i * 64 * KiB : (i + 1) * 64 * KiB], b.meta) for i, b in enumerate(blocks[:3])]
    items += [(blocks[3].key, bytes(blocks[3].data), blocks[3].meta), (blocks[4].key, b"short", bad)]
    out = dram.write_many(items)
    assert out[:4] == [None] * 4 and isinstance(out[4], BufferSizeError)
    assert spans == [3 * 64 * KiB]  # the run of three in one copy; block 3 (its own buffer) alone
    assert [dram.location(b.key) for b in blocks[:4]] == [(i * 64 * KiB, 64 * KiB) for i in range(4)]
    for b in blocks[:4]:
        dst = bytearray(64 * KiB)
        assert dram.read_into(b.key, memoryview(dst)) == 64 * KiB and bytes(dst) == bytes(b.data)
    assert not dram.contains(blocks[4].key)


def test_a_large_batch_is_copied_by_the_configured_threads(tmp_path: Path, make_block: MakeBlock,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    tier = DramTier("d0", DramConfig(64 * MiB, slab_bytes=16 * MiB, copy_threads=2), root=tmp_path, clock=FakeClock())
    try:
        assert tier.describe()["copy_threads"] == 2
        names = record_memmoves(monkeypatch)
        monkeypatch.setattr(tier._copy, "min_bytes", 8 * MiB)  # noqa: SLF001  # the pool of 2 splits 16 MiB
        blocks = [make_block(4 * MiB, seed=i) for i in range(4)]
        assert tier.write_many([(b.key, b.data, b.meta) for b in blocks]) == [None] * 4
        assert len(names) == 4  # one piece per block (each its own buffer), by whichever thread came first
        dst = np.zeros(16 * MiB, np.uint8)
        views = [memoryview(dst)[i * 4 * MiB : (i + 1) * 4 * MiB] for i in range(4)]
        assert tier.read_many([b.key for b in blocks], views) == [4 * MiB] * 4
        assert bytes(dst) == b"".join(bytes(b.data) for b in blocks)
        one = bytearray(4 * MiB)
        names.clear()
        assert tier.read_into(blocks[0].key, memoryview(one)) == 4 * MiB and bytes(one) == bytes(blocks[0].data)
        assert names == [threading.current_thread().name]  # 4 MiB: below min_bytes, one copy here
    finally:
        tier.close()


def test_explicit_name_and_collision(tmp_path: Path) -> None:
    cfg = DramConfig(1 * MiB, slab_bytes=1 * MiB, shm_name=f"kvs-test-{id(tmp_path):x}")
    tier = DramTier("d", cfg, root=tmp_path)
    try:
        assert tier.shm_name == cfg.shm_name
        with pytest.raises(TierIOError, match="already exists"):
            DramTier("other", cfg, root=tmp_path)
    finally:
        tier.close()
    assert not (SHM / cfg.shm_name).exists()


def test_unclosed_tier_leaks_nothing_at_exit(tmp_path: Path) -> None:
    proc = _run(
        f"""
        from pathlib import Path
        from kvstore.block import BlockMeta
        from tiers.dram import DramConfig, DramTier
        t = DramTier("d", DramConfig(1 << 20, slab_bytes=1 << 20), root=Path({str(tmp_path)!r}))
        t.write(b"k" * 16, b"x", BlockMeta(b"n" * 16, b"p" * 16, 0, 1, 0.0, 0, 0.0))
        print(t.shm_name)  # and exit without close(): the finalizer must clean up
        """
    )
    assert proc.returncode == 0, proc.stderr
    name = proc.stdout.strip()
    assert not (SHM / name).exists()
    assert "leaked" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_another_process_reads_the_arena_by_name(dram: DramTier, make_block: MakeBlock) -> None:
    block = make_block(5000, seed=1)
    dram.write(block.key, block.data, block.meta)
    offset, size = dram.location(block.key)  # type: ignore[misc]
    proc = _run(
        f"""
        import sys
        from kvstore.shm import attach_arena
        shm = attach_arena({dram.shm_name!r})
        sys.stdout.write(bytes(shm.buf[{offset}:{offset + size}]).hex())
        shm.close()
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert bytes.fromhex(proc.stdout) == block.data
    # The client's exit neither unlinked the arena nor made its resource tracker complain.
    assert (SHM / dram.shm_name).exists()
    assert "leaked" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_attach_in_the_owning_process(dram: DramTier, make_block: MakeBlock) -> None:
    block = make_block(100, seed=2)
    dram.write(block.key, block.data, block.meta)
    offset, size = dram.location(block.key)  # type: ignore[misc]
    shm = attach_arena(dram.shm_name)
    try:
        assert bytes(shm.buf[offset : offset + size]) == block.data
    finally:
        shm.close()


# ---- slots and locations ------------------------------------------------------------------------


def test_location_and_slot_reuse(dram: DramTier, make_block: MakeBlock) -> None:
    a, b = make_block(5000, seed=3), make_block(5000, seed=4)
    assert dram.location(a.key) is None
    dram.write(a.key, a.data, a.meta)
    dram.write(b.key, b.data, b.meta)
    assert dram.location(a.key) == (0, 5000)
    assert dram.location(b.key) == (8192, 5000)
    dram.delete(a.key)
    assert dram.location(a.key) is None
    c = make_block(6000, seed=5)
    dram.write(c.key, c.data, c.meta)
    assert dram.location(c.key) == (0, 6000)  # the freed slot of the same class


def test_usage_counts_whole_slots(dram: DramTier, make_block: MakeBlock) -> None:
    block = make_block(5000, seed=6)
    dram.write(block.key, block.data, block.meta)
    assert dram.usage().used_bytes == 8192
    assert dram.size_class(5000) == dram.size_class(8192) == 8192
    assert dram.size_class(8193) == 12288


def test_same_class_rewrite_stays_in_place(dram: DramTier, make_block: MakeBlock) -> None:
    a, b = make_block(5000, seed=7), make_block(7000, seed=8)
    dram.write(a.key, a.data, a.meta)
    where = dram.location(a.key)
    dram.write(a.key, b.data, b.meta)
    assert dram.location(a.key) == (where[0], 7000)  # type: ignore[index]
    assert dram.usage().used_bytes == 8192


def test_class_full_but_another_class_has_room(dram: DramTier, make_block: MakeBlock) -> None:
    # Four 1 MiB slabs: three hold 512 KiB blocks, the last is free for any class.
    big = [make_block(512 * KiB, seed=10 + i) for i in range(6)]
    for b in big:
        dram.write(b.key, b.data, b.meta)
    small = make_block(4096, seed=20)
    assert dram.fits(4096)
    dram.write(small.key, small.data, small.meta)
    extra = make_block(512 * KiB, seed=21)
    assert not dram.fits(512 * KiB)
    with pytest.raises(TierFullError):
        dram.write(extra.key, extra.data, extra.meta)
    assert dram.fits(4096)  # its own class still has free slots


def test_block_larger_than_a_slab_is_a_usage_error(dram: DramTier, make_block: MakeBlock) -> None:
    block = make_block(1 * MiB + 1, seed=30)
    with pytest.raises(UsageError, match="slab_bytes"):
        dram.write(block.key, block.data, block.meta)
    with pytest.raises(UsageError):
        dram.size_class(1 * MiB + 1)
    assert dram.usage().blocks == 0


def test_update_expiry_and_scan(dram: DramTier, make_block: MakeBlock) -> None:
    a, b = make_block(10, seed=31), make_block(20, seed=32)
    dram.write(a.key, a.data, a.meta)
    dram.write(b.key, b.data, b.meta)
    dram.update_expiry([(a.key, 123.0), (make_block(1, seed=33).key, 5.0)])
    assert dram.meta(a.key) == a.meta.with_expiry(123.0)
    assert dict(dram.scan()) == {a.key: a.meta.with_expiry(123.0), b.key: b.meta}


def test_strided_source_is_rejected(dram: DramTier, make_block: MakeBlock) -> None:
    block = make_block(100, seed=34)
    strided = memoryview(bytearray(200))[::2]
    with pytest.raises(UsageError, match="contiguous"):
        dram.write(block.key, strided, block.meta)


# ---- configuration --------------------------------------------------------------------------------


def test_config_from_loose_options(tmp_path: Path) -> None:
    cfg = build_config(DramConfig, {"capacity_bytes": "8MiB", "slab_bytes": "2MiB"}, "tier 'd'")
    assert cfg == DramConfig(8 * MiB, 2 * MiB, "")
    tier = make_tier("dram", "d", {"capacity_bytes": "3MiB", "slab_bytes": "2MiB"}, root=tmp_path)
    try:
        assert isinstance(tier, DramTier)
        assert tier.usage().capacity_bytes == 2 * MiB  # rounded down to whole slabs
    finally:
        tier.close()


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"capacity_bytes": 0}, "capacity_bytes"),
        ({"capacity_bytes": "1MiB", "slab_bytes": 5000}, "multiple of 4096"),
        ({"capacity_bytes": "1MiB", "slab_bytes": "2MiB"}, "smaller than one slab"),
        ({"capacity_bytes": "4MiB", "slab_bytes": "1MiB", "shm_name": "a/b"}, "no slash"),
        ({"capacity_bytes": "4MiB", "nonsense": 1}, "unknown option"),
        ({"capacity_bytes": "4MiB", "slab_bytes": "1MiB", "copy_threads": -1}, "copy_threads"),
        ({"capacity_bytes": "4MiB", "slab_bytes": "1MiB", "copy_threads": 65}, "copy_threads"),
        ({"capacity_bytes": "4MiB", "slab_bytes": "1MiB", "copy_threads": "two"}, "expected a number"),
    ],
)
def test_config_errors_say_what_to_do(options: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        build_config(DramConfig, options, "tier 'd'")
