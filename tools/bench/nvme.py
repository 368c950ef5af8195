"""NVMe tier throughput against raw ``O_DIRECT`` I/O on the same disk, in the same run.

For 1 MiB and 8 MiB blocks: the tier's ``write`` (payload + RocksDB record, not durable, with a
precomputed meta: the store computes checksums, not the tier) and ``read_into`` (which includes
the checksum verification every read does), each against plain ``pwrite``/``preadv`` of the same
bytes, block size and total through a page-aligned buffer, on a file of our own opened with
``O_DIRECT`` in the same directory. ``O_DIRECT`` bypasses the page cache, so reads are cold.

Rounds alternate which side goes first and the best of each side is reported, so drift of a
noisy machine does not land on one side only.
"""

from __future__ import annotations

import mmap
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.block import BlockMeta, payload_checksum
from kvstore.keys import BlockHash
from tiers.nvme import NvmeConfig, NvmeTier
from tools.bench._common import result

MiB = 1024 * 1024
BLOCK_SIZES = (1 * MiB, 8 * MiB)
SLAB_BYTES = 64 * MiB


def run(args: Any) -> Iterator[dict[str, Any]]:
    quick = bool(getattr(args, "quick", False))
    total = 64 * MiB if quick else 1024 * MiB
    rounds = 2 if quick else 3
    base = _bench_dir(getattr(args, "dir", None))
    fs = _fs_type(base)
    try:
        for bs in BLOCK_SIZES:
            yield from _measure(base, bs, total, rounds, fs)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _measure(base: Path, bs: int, total: int, rounds: int, fs: str) -> Iterator[dict[str, Any]]:
    n = total // bs
    label = f"{bs // MiB}MiB"
    src = _aligned(bs)
    src[:] = np.random.default_rng(0).integers(0, 256, bs, dtype=np.uint8).tobytes()
    dst = _aligned(bs)
    meta = BlockMeta(b"\x01" * 16, b"\x02" * 16, 0, bs, 0.0, payload_checksum(src), 0.0)
    keys = [BlockHash(i.to_bytes(16, "little")) for i in range(n)]
    offsets = [i * bs for i in range(n)]

    raw_path = base / f"raw-{label}.bin"
    fd, raw_direct = _open_raw(raw_path)
    tier = NvmeTier(f"bench-{label}", NvmeConfig(capacity_bytes=total), root=base)
    try:
        os.posix_fallocate(fd, 0, total)  # same starting state as the tier's preallocated file

        def raw_write() -> None:
            for off in offsets:
                os.pwrite(fd, src, off)

        def raw_read() -> None:
            for off in offsets:
                os.preadv(fd, [dst], off)

        def tier_write() -> None:
            for k in keys:
                tier.write(k, src, meta)

        def tier_read() -> None:
            for k in keys:
                tier.read_into(k, dst)

        best = {"raw_w": float("inf"), "tier_w": float("inf"), "raw_r": float("inf"), "tier_r": float("inf")}
        for r in range(rounds):
            # Untimed: empty the tier so every round writes fresh slots (in reverse, so the LIFO
            # free lists hand the slots back in ascending order, like the raw file's offsets).
            for k in reversed(keys):
                tier.delete(k)
            pairs: list[tuple[str, Callable[[], None]]] = [("raw_w", raw_write), ("tier_w", tier_write)]
            reads: list[tuple[str, Callable[[], None]]] = [("raw_r", raw_read), ("tier_r", tier_read)]
            if r % 2:
                pairs.reverse()
                reads.reverse()
            for name, fn in pairs + reads:
                best[name] = min(best[name], _timed(fn))
        extra = {
            "block_bytes": bs,
            "total_bytes": total,
            "direct_io": tier.describe()["direct_io"],
            "raw_direct_io": raw_direct,
            "fs": fs,
        }
    finally:
        tier.close()
        os.close(fd)
        raw_path.unlink(missing_ok=True)
    gbs = total / 1e9
    yield result("nvme", f"write_{label}", gbs / best["tier_w"], "GB/s", gbs / best["raw_w"], **extra)
    yield result("nvme", f"read_{label}", gbs / best["tier_r"], "GB/s", gbs / best["raw_r"], **extra)


def _timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _aligned(n: int) -> memoryview:
    """A page-aligned writable buffer (an anonymous mapping), like pinned engine memory."""
    return memoryview(mmap.mmap(-1, n))


def _open_raw(path: Path) -> tuple[int, bool]:
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
    o_direct = getattr(os, "O_DIRECT", 0)
    if o_direct:
        try:
            return os.open(path, flags | o_direct, 0o644), True
        except OSError:
            pass
    return os.open(path, flags, 0o644), False


def _bench_dir(requested: str | None) -> Path:
    """A fresh directory under ``requested`` (default: the current directory, not /tmp, which
    is tmpfs on many systems and would measure memory instead of the disk)."""
    parent = Path(requested) if requested else Path.cwd()
    parent.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=".kvstore-bench-nvme-", dir=parent))
    fs = _fs_type(path)
    if fs in ("tmpfs", "ramfs", "overlay"):
        print(
            f"warning: {parent} is on {fs}; the nvme benchmark measures memory, not a disk. "
            "Pass --dir on the disk to measure.",
            file=sys.stderr,
        )
    return path


def _fs_type(path: Path) -> str:
    """The filesystem type of the longest mount point containing ``path`` (Linux), or ''."""
    real = os.path.realpath(path)
    best, fstype = "", ""
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) > len(best):
                    best, fstype = mnt, parts[2]
    except OSError:
        pass
    return fstype
