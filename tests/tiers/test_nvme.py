"""NVMe-specific behaviour: O_DIRECT paths, persistence, corruption, crash order, fallbacks.

The protocol-level behaviour every tier shares is in test_conformance.py.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

from kvstore.block import BlockMeta, payload_checksum
from kvstore.errors import (
    BlockNotFound,
    BufferSizeError,
    ConfigError,
    CorruptBlockError,
    TierFullError,
    TierIOError,
)
from kvstore.keys import BlockHash
from kvstore.registry import make_tier
from tiers._direct import ALIGN, DirectFile, address
from tiers.base import tier_dir
from tiers.nvme import NvmeConfig, NvmeTier

REPO = Path(__file__).resolve().parents[2]
NS = b"N" * 16
PARENT = b"P" * 16
KiB = 1024
MiB = 1024 * 1024
SLAB = 2 * MiB
CAPACITY = 16 * MiB
# Around page boundaries, and blocks of a MiB and more (a partial last page, several slab pages).
SIZES = [1, 100, 4095, 4096, 4097, 100_000, 512 * KiB, 600_001, MiB, MiB + 3, 2 * MiB]


def key(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(16, "little"))


def payload(size: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def make_meta(
    data: bytes, *, depth: int = 0, expiry: float = 2e9, size: int | None = None
) -> BlockMeta:
    return BlockMeta(
        NS,
        PARENT,
        depth,
        len(data) if size is None else size,
        expiry,
        payload_checksum(data),
        1.7e9,
    )


def aligned(n: int) -> memoryview:
    return memoryview(mmap.mmap(-1, max(n, 1)))


def unaligned(n: int) -> memoryview:
    mv = memoryview(bytearray(n + 1))[1:]
    assert address(mv) % ALIGN
    return mv


def open_tier(root: Path, name: str = "nvme", **options: object) -> NvmeTier:
    cfg = {"capacity_bytes": CAPACITY, "slab_bytes": SLAB, **options}
    return NvmeTier(name, NvmeConfig(**cfg), root=root)  # type: ignore[arg-type]


@pytest.fixture(params=[True, False], ids=["direct", "buffered"])
def tier(request: pytest.FixtureRequest, tmp_path: Path):
    t = open_tier(tmp_path, direct_io=request.param)
    yield t
    t.close()


# ---- round trips --------------------------------------------------------------------------------


@pytest.mark.parametrize("size", SIZES)
def test_round_trip_exact_bytes_aligned_and_unaligned(tier: NvmeTier, size: int) -> None:
    data = payload(size, seed=size)
    src_aligned = aligned(size)
    src_aligned[:size] = data
    tier.write(key(1), data, make_meta(data))  # bytes: never 4096-aligned, goes via bounce
    tier.write(key(2), src_aligned[:size], make_meta(data))  # zero-copy bulk
    tier.write(key(3), unaligned(size), make_meta(bytes(size)))
    for k, want in ((key(1), data), (key(2), data), (key(3), bytes(size))):
        for dst in (aligned(size + 2 * ALIGN), unaligned(size + 2 * ALIGN)):
            dst[size:] = b"\xee" * (dst.nbytes - size)
            assert tier.read_into(k, dst) == size
            assert dst[:size] == want
            # Bytes past the payload belong to the caller (maybe the next block): untouched.
            assert dst[size:] == b"\xee" * (dst.nbytes - size)


def test_numpy_source_and_destination_of_any_dtype(tier: NvmeTier) -> None:
    src = np.arange(50_000, dtype=np.float16)
    data = src.tobytes()
    tier.write(key(1), memoryview(src), make_meta(data))
    dst = np.zeros(50_000, dtype=np.float16)
    assert tier.read_into(key(1), memoryview(dst)) == len(data)
    assert np.array_equal(dst, src)


def test_replacing_a_key_frees_the_old_slot(tier: NvmeTier) -> None:
    a, b = payload(10_000, 1), payload(10_000, 2)
    tier.write(key(1), a, make_meta(a))
    used = tier.usage().used_bytes
    tier.write(key(1), b, make_meta(b, depth=7))
    assert tier.usage().used_bytes == used and tier.usage().blocks == 1
    dst = bytearray(10_000)
    tier.read_into(key(1), memoryview(dst))
    assert bytes(dst) == b and tier.meta(key(1)).depth == 7  # type: ignore[union-attr]


def test_misses_and_bad_buffers(tier: NvmeTier) -> None:
    data = payload(5000)
    tier.write(key(1), data, make_meta(data))
    with pytest.raises(BlockNotFound):
        tier.read_into(key(2), aligned(5000))
    with pytest.raises(BufferSizeError, match="at least 5000"):
        tier.read_into(key(1), memoryview(bytearray(4999)))
    with pytest.raises(BufferSizeError):
        tier.write(key(3), data, make_meta(data, size=4096))
    assert not tier.contains(key(3))
    assert tier.meta(key(2)) is None
    assert tier.delete(key(1)) and not tier.delete(key(1))
    assert tier.usage().used_bytes == 0 and tier.usage().blocks == 0


def test_size_class_and_fits(tier: NvmeTier) -> None:
    assert tier.size_class(1) == tier.size_class(4096) == 4096
    assert tier.size_class(4097) == 8192
    assert tier.fits(SLAB)
    with pytest.raises(ValueError, match="slab_bytes"):
        tier.fits(SLAB + 1)


def test_read_many_reports_errors_per_block(tier: NvmeTier) -> None:
    data = payload(3000)
    tier.write(key(1), data, make_meta(data))
    out = tier.read_many([key(1), key(2)], [aligned(3000), aligned(3000)])
    assert out[0] == 3000 and isinstance(out[1], BlockNotFound)


def test_read_many_of_a_run_reads_every_block_and_verifies_each(tmp_path: Path) -> None:
    sizes = [MiB, 600_001, 3000, MiB + 3, 2 * MiB]
    blocks = {key(i): payload(n, seed=i) for i, n in enumerate(sizes)}
    with open_tier(tmp_path) as t:
        for k, data in blocks.items():
            t.write(k, data, make_meta(data), durable=True)
    path = tier_dir(tmp_path, "nvme") / "data.slab"
    raw = bytearray(path.read_bytes())
    at = raw.find(blocks[key(3)][:64])
    raw[at + MiB] ^= 0x01  # block 3's last bytes: only its own checksum can tell
    path.write_bytes(raw)
    keys = [*blocks, key(99)]
    dsts = [aligned(n) for n in sizes] + [aligned(10)]
    dsts[1] = unaligned(sizes[1])
    dsts[2] = aligned(100)  # too small
    with open_tier(tmp_path) as t:
        out = t.read_many(keys, dsts)
    assert out[0] == MiB and dsts[0][:MiB] == blocks[key(0)]
    assert out[1] == 600_001 and dsts[1][:600_001] == blocks[key(1)]
    assert isinstance(out[2], BufferSizeError)
    assert isinstance(out[3], CorruptBlockError) and key(3).hex() in str(out[3])
    assert out[4] == 2 * MiB and dsts[4][: 2 * MiB] == blocks[key(4)]
    assert isinstance(out[5], BlockNotFound)


def test_read_many_reports_a_device_error_for_its_block_only(tier: NvmeTier, monkeypatch: pytest.MonkeyPatch) -> None:
    data = [payload(MiB, seed=i) for i in range(3)]
    for i, d in enumerate(data):
        tier.write(key(i), d, make_meta(d))
    bad = tier._index[key(1)][0]  # the file offset of block 1's slot
    real_preadv = os.preadv
    reads: list[tuple[int, int]] = []

    def eio_on_the_second_block(fd: int, bufs: list[memoryview], offset: int) -> int:
        n = sum(b.nbytes for b in bufs)
        reads.append((offset, n))
        if offset <= bad < offset + n:
            raise OSError(errno.EIO, "Input/output error")
        return real_preadv(fd, bufs, offset)

    monkeypatch.setattr(os, "preadv", eio_on_the_second_block)
    dsts = [aligned(MiB) for _ in data]
    out = tier.read_many([key(i) for i in range(3)], dsts)
    assert out[0] == MiB and dsts[0][:MiB] == data[0]
    assert out[2] == MiB and dsts[2][:MiB] == data[2]
    assert isinstance(out[1], TierIOError) and out[1].errno == errno.EIO
    # Blocks 0 and 1 lie back to back: one read of both, then block by block once it failed.
    assert reads[0][0] == tier._index[key(0)][0] and reads[0][1] >= 2 * MiB


def test_read_many_reads_slots_back_to_back_in_one_request(tier: NvmeTier, monkeypatch: pytest.MonkeyPatch) -> None:
    sizes = [MiB, MiB, 64 * KiB, 100_000, MiB, MiB]  # a partial page ends a run: its tail is bounced
    data = [payload(n, seed=i) for i, n in enumerate(sizes)]
    for i, d in enumerate(data):
        tier.write(key(i), d, make_meta(d))
    offsets = [tier._index[key(i)][0] for i in range(len(sizes))]
    real_preadv = os.preadv
    reads: list[tuple[int, int]] = []

    def counting(fd: int, bufs: list[memoryview], offset: int) -> int:
        reads.append((offset, len(bufs)))
        return real_preadv(fd, bufs, offset)

    monkeypatch.setattr(os, "preadv", counting)
    dsts = [aligned(n) for n in sizes]
    dsts[5] = unaligned(MiB)  # through the bounce buffer: on its own
    assert tier.read_many([key(i) for i in range(len(sizes))], dsts) == sizes
    for d, want in zip(dsts, data, strict=True):
        assert d[: len(want)] == want
    # Blocks 0 and 1 lie back to back (one slab): one preadv starts at block 0 with both.
    assert offsets[1] == offsets[0] + MiB
    assert any(at == offsets[0] and views >= 2 for at, views in reads), (offsets, reads)
    assert len(reads) < len(sizes)
    if tier._file is not None and tier._file.direct:
        assert (offsets[5], 1) in reads  # the unaligned buffer: through the bounce buffer, alone


# ---- persistence --------------------------------------------------------------------------------


def test_reopen_recovers_every_block_with_its_meta(tmp_path: Path) -> None:
    blocks = {key(i): payload(size, seed=i) for i, size in enumerate(SIZES)}
    metas = {k: make_meta(d, depth=i, expiry=2e9 + i) for i, (k, d) in enumerate(blocks.items())}
    with open_tier(tmp_path) as t:
        for k, d in blocks.items():
            t.write(k, d, metas[k], durable=True)
        t.delete(key(0))
        usage = t.usage()
    del blocks[key(0)]
    with open_tier(tmp_path) as t:
        assert t.usage() == usage
        assert dict(t.scan()) == {k: metas[k] for k in blocks}
        for k, d in blocks.items():
            m = t.meta(k)
            assert m == metas[k] and m.ns == NS and m.parent == PARENT  # type: ignore[union-attr]
            dst = aligned(len(d))
            assert t.read_into(k, dst) == len(d) and dst[: len(d)] == d
        # The rebuilt allocator hands out no slot that a recovered block holds.
        extra = payload(MiB, seed=99)
        t.write(key(100), extra, make_meta(extra))
        for k, d in blocks.items():
            dst = aligned(len(d))
            t.read_into(k, dst)
            assert dst[: len(d)] == d


def test_update_expiry_survives_reopen(tmp_path: Path) -> None:
    data = payload(8000)
    with open_tier(tmp_path) as t:
        t.write(key(1), data, make_meta(data, expiry=100.0))
        t.write(key(2), data, make_meta(data, expiry=100.0))
        t.update_expiry([(key(1), 5000.0), (key(9), 1.0)])  # unknown keys are skipped
        assert t.meta(key(1)).expiry == 5000.0  # type: ignore[union-attr]
        t.flush()
    with open_tier(tmp_path) as t:
        assert t.meta(key(1)).expiry == 5000.0  # type: ignore[union-attr]
        assert t.meta(key(2)).expiry == 100.0  # type: ignore[union-attr]
        assert not t.contains(key(9))
        dst = aligned(8000)
        t.read_into(key(1), dst)
        assert dst[:8000] == data


def test_capacity_can_grow_on_reopen(tmp_path: Path) -> None:
    data = payload(MiB)
    with open_tier(tmp_path) as t:
        t.write(key(1), data, make_meta(data))
    with open_tier(tmp_path, capacity_bytes=2 * CAPACITY) as t:
        assert t.usage().capacity_bytes == 2 * CAPACITY
        assert os.path.getsize(tier_dir(tmp_path, "nvme") / "data.slab") == 2 * CAPACITY
        dst = aligned(MiB)
        t.read_into(key(1), dst)
        assert dst[:MiB] == data


def test_blocks_beyond_a_shrunk_capacity_are_dropped(tmp_path: Path) -> None:
    small, big = payload(4096, 1), payload(8192, 2)
    with open_tier(tmp_path) as t:
        t.write(key(1), small, make_meta(small))  # slab 0 (class 4096)
        t.write(key(2), big, make_meta(big))  # slab 1 (class 8192)
    with open_tier(tmp_path, capacity_bytes=SLAB) as t:
        assert t.contains(key(1)) and not t.contains(key(2))
        assert t.describe()["dropped_on_open"] == 1
        assert os.path.getsize(tier_dir(tmp_path, "nvme") / "data.slab") == SLAB


def test_slab_bytes_mismatch_on_reopen_is_a_config_error(tmp_path: Path) -> None:
    open_tier(tmp_path).close()
    with pytest.raises(ConfigError, match=r"slab_bytes=2097152.*slab_bytes = 2097152"):
        open_tier(tmp_path, slab_bytes=4 * MiB)
    open_tier(tmp_path).close()  # the failed open released the DB


def test_records_are_dropped_when_the_data_file_is_gone(tmp_path: Path) -> None:
    data = payload(4096)
    with open_tier(tmp_path) as t:
        t.write(key(1), data, make_meta(data))
    (tier_dir(tmp_path, "nvme") / "data.slab").unlink()
    with open_tier(tmp_path) as t:
        assert not t.contains(key(1)) and t.describe()["dropped_on_open"] == 1
    with open_tier(tmp_path) as t:
        assert t.describe()["dropped_on_open"] == 0


def test_a_second_open_of_the_same_tier_is_refused(tmp_path: Path) -> None:
    with open_tier(tmp_path), pytest.raises(TierIOError, match="close it first"):
        open_tier(tmp_path)


def test_close_is_idempotent_and_later_calls_fail_clearly(tmp_path: Path) -> None:
    t = open_tier(tmp_path)
    t.close()
    t.close()
    with pytest.raises(TierIOError, match="closed"):
        t.write(key(1), b"x", make_meta(b"x"))
    with pytest.raises(TierIOError, match="closed"):
        t.read_into(key(1), aligned(1))


# ---- integrity and crash order ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("size", "flip_at"),
    [(10_000, 5000), (MiB + 3, 10), (MiB + 3, MiB + 1)],
    ids=["small", "large-body", "large-tail"],
)
def test_flipped_payload_bytes_read_as_corrupt(tmp_path: Path, size: int, flip_at: int) -> None:
    data = payload(size, seed=5)
    with open_tier(tmp_path) as t:
        t.write(key(1), data, make_meta(data), durable=True)
    path = tier_dir(tmp_path, "nvme") / "data.slab"
    raw = bytearray(path.read_bytes())
    start = raw.find(data[:64])
    assert start >= 0
    raw[start + flip_at] ^= 0x01
    path.write_bytes(raw)
    with open_tier(tmp_path) as t:
        with pytest.raises(CorruptBlockError, match=key(1).hex()):
            t.read_into(key(1), aligned(size))
        with pytest.raises(CorruptBlockError):
            t.read_into(key(1), unaligned(size))


def test_killed_before_the_record_leaves_no_readable_block(tmp_path: Path) -> None:
    """A process killed after the payload but before its record: the block never appears."""
    script = textwrap.dedent(
        f"""
        import os, sys
        sys.path.insert(0, {str(REPO)!r})
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from pathlib import Path
        from test_nvme import key, make_meta, open_tier, payload
        t = open_tier(Path({str(tmp_path)!r}))
        a, b = payload(5000, 1), payload(5000, 2)
        t.write(key(1), a, make_meta(a), durable=True)
        t._db_call = lambda fn: os._exit(3)  # die where the record would be put
        t.write(key(2), b, make_meta(b), durable=True)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 3, proc.stderr
    with open_tier(tmp_path) as t:
        assert t.contains(key(1)) and not t.contains(key(2))
        assert t.usage().blocks == 1 and t.usage().used_bytes == t.size_class(5000)
        dst = aligned(5000)
        t.read_into(key(1), dst)
        assert dst[:5000] == payload(5000, 1)


def test_device_error_on_write_leaves_nothing_behind(
    tier: NvmeTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    def enospc(self: DirectFile, src: memoryview, offset: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(DirectFile, "write_at", enospc)
    data = payload(5000)
    with pytest.raises(TierIOError, match="disk is full") as e:
        tier.write(key(1), data, make_meta(data))
    assert "data.slab" in str(e.value) and e.value.errno == errno.ENOSPC
    assert not tier.contains(key(1)) and tier.usage().used_bytes == 0
    monkeypatch.undo()
    tier.write(key(1), data, make_meta(data))
    assert tier.contains(key(1))


@pytest.mark.parametrize("size", [10_000, 2 * MiB - 5], ids=["small", "large"])
def test_device_error_on_read_is_a_tier_io_error(
    tier: NvmeTier, monkeypatch: pytest.MonkeyPatch, size: int
) -> None:
    data = payload(size)
    tier.write(key(1), data, make_meta(data))

    def eio(self: DirectFile, dst: memoryview, n: int, offset: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(DirectFile, "read_into", eio)
    with pytest.raises(TierIOError, match="I/O error: check the disk") as e:
        tier.read_into(key(1), aligned(size))
    assert e.value.errno == errno.EIO
    monkeypatch.undo()
    dst = aligned(size)
    assert tier.read_into(key(1), dst) == size and dst[:size] == data


@pytest.mark.parametrize("size", [MiB, 2 * MiB - 5])
def test_read_into_reads_a_block_in_one_request(
    tier: NvmeTier, monkeypatch: pytest.MonkeyPatch, size: int
) -> None:
    # One large request, as a raw O_DIRECT read makes: pieces of a block read one after another
    # each waited for the disk's latency (0.47-0.68 of raw on a virtio disk).
    data = payload(size, seed=3)
    tier.write(key(1), data, make_meta(data))
    real_read = DirectFile.read_into
    calls: list[tuple[int, int]] = []

    def counting(self: DirectFile, dst: memoryview, n: int, offset: int) -> None:
        calls.append((n, offset))
        real_read(self, dst, n, offset)

    monkeypatch.setattr(DirectFile, "read_into", counting)
    dst = aligned(size)
    assert tier.read_into(key(1), dst) == size and dst[:size] == data
    assert [n for n, _ in calls] == [size]


# ---- capacity -----------------------------------------------------------------------------------


def test_full_tier_raises_and_stays_usable(tmp_path: Path) -> None:
    with open_tier(tmp_path, capacity_bytes=128 * KiB, slab_bytes=64 * KiB) as t:
        blocks = [payload(32 * KiB, seed=i) for i in range(4)]
        for i, d in enumerate(blocks):
            t.write(key(i), d, make_meta(d))
        before = t.usage()
        assert not t.fits(32 * KiB)
        with pytest.raises(TierFullError, match="capacity_bytes"):
            t.write(key(10), blocks[0], make_meta(blocks[0]))
        with pytest.raises(TierFullError):  # another size class: no slab left for it either
            t.write(key(11), b"x" * 100, make_meta(b"x" * 100))
        assert t.usage() == before and not t.contains(key(10)) and not t.contains(key(11))
        # Rewriting a present key of a full tier succeeds (its own slot is given up first).
        t.write(key(0), blocks[1], make_meta(blocks[1]))
        assert t.delete(key(1))
        t.write(key(10), blocks[0], make_meta(blocks[0]))
        for k, want in (
            (key(0), blocks[1]),
            (key(2), blocks[2]),
            (key(3), blocks[3]),
            (key(10), blocks[0]),
        ):
            dst = aligned(32 * KiB)
            t.read_into(k, dst)
            assert dst[: 32 * KiB] == want


# ---- configuration and environment --------------------------------------------------------------


def test_unwritable_directory_gives_a_clear_error(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "a-file"
    not_a_dir.write_text("")
    with pytest.raises((TierIOError, ConfigError), match="choose another store root") as e:
        open_tier(not_a_dir)
    assert str(not_a_dir) in str(e.value)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"capacity_bytes": 1 * MiB, "slab_bytes": 2 * MiB}, "smaller than one slab"),
        ({"capacity_bytes": 16 * MiB, "slab_bytes": 5000}, "multiple of 4096"),
        ({"capacity_bytes": 0}, "positive size"),
        ({"capacity_bytes": 16 * MiB, "slab_bytes": SLAB, "direct_io": "yes"}, "true or false"),
    ],
)
def test_bad_config_is_rejected(options: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        NvmeConfig(**options)  # type: ignore[arg-type]


def test_built_from_the_registry_with_size_strings(tmp_path: Path) -> None:
    t = make_tier("nvme", "disk", {"capacity_bytes": "8MiB", "slab_bytes": "1MiB"}, tmp_path)
    try:
        assert isinstance(t, NvmeTier) and t.usage().capacity_bytes == 8 * MiB
        assert (tier_dir(tmp_path, "disk") / "meta.rocksdb").is_dir()
    finally:
        t.close()


def test_buffered_mode_when_configured(tmp_path: Path) -> None:
    with open_tier(tmp_path, direct_io=False) as t:
        d = t.describe()
        assert d["direct_io"] is False and "config" in d["direct_io_fallback"]


def test_falls_back_to_buffered_io_when_o_direct_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_open = os.open

    def tmpfs_like_open(path: str, flags: int, mode: int = 0o777) -> int:
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, mode)

    monkeypatch.setattr(os, "open", tmpfs_like_open)
    with open_tier(tmp_path) as t:
        d = t.describe()
        assert d["direct_io"] is False and "refused O_DIRECT" in d["direct_io_fallback"]
        data = payload(MiB + 3)
        t.write(key(1), data, make_meta(data))
        dst = unaligned(MiB + 3)
        t.read_into(key(1), dst)
        assert dst == data


# ---- concurrency --------------------------------------------------------------------------------


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_concurrent_writers_and_readers_of_distinct_keys(tmp_path: Path, direct: bool) -> None:
    tier = open_tier(tmp_path, capacity_bytes=32 * MiB, direct_io=direct)
    sizes = [4096, 5000, 600_001, 100]
    errors: list[BaseException] = []

    def worker(t_id: int) -> None:
        try:
            mine = {
                key(t_id * 100 + i): payload(sizes[i % 4], seed=t_id * 100 + i) for i in range(12)
            }
            for k, d in mine.items():
                tier.write(k, d, make_meta(d))
            for _ in range(2):
                for k, d in mine.items():
                    dst = aligned(len(d)) if len(d) % 2 else unaligned(len(d))
                    assert tier.read_into(k, dst) == len(d)
                    assert dst[: len(d)] == d
            for k in list(mine)[:4]:
                assert tier.delete(k)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    try:
        assert not errors, errors
        assert tier.usage().blocks == 8 * 8
        assert len(list(tier.scan())) == 8 * 8
    finally:
        tier.close()


# ---- benchmark smoke ----------------------------------------------------------------------------


def test_bench_quick_json(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tools.bench", "nvme", "--quick", "--json", "--dir", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    assert {r["metric"] for r in rows} == {
        f"{op}_{size}" for op in ("write", "read", "read_many") for size in ("1MiB", "8MiB")
    }
    for r in rows:
        assert {"bench", "metric", "value", "unit", "baseline", "ratio"} <= set(r)
        assert r["bench"] == "nvme" and r["unit"] == "GB/s" and r["value"] > 0 and r["baseline"] > 0
    assert list(tmp_path.iterdir()) == []  # the benchmark cleans up after itself
