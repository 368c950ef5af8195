"""NVMe tier throughput against raw ``O_DIRECT`` I/O on the same disk, in the same run.

For 1 MiB and 8 MiB blocks: the tier's ``write`` (payload + RocksDB record, not durable, with a
precomputed meta: the store computes checksums, not the tier), ``read_into`` one block at a time
and ``read_many`` of a segment's blocks (how the store reads a run of a load), both including
the checksum verification every read does, each against plain ``pwrite``/``preadv`` of the same
bytes, block size and total through a page-aligned buffer, on a file of our own opened with
``O_DIRECT`` in the same directory. ``O_DIRECT`` bypasses the page cache, so reads are cold.
Raw reads each block with its own ``preadv`` (the goal's baseline, unchanged); the tier's
``read_many`` reads blocks whose slots lie back to back (here, blocks written in order) in one
``preadv`` of up to 16 MiB, which is where it gains over raw per-block reads.

The sides alternate every segment (and which goes first): each segment is one trial, the tier's
rate beside raw's on the same blocks a moment apart, and each figure is the trial with the
median ratio (``trial_ratios`` lists them all). A noisy neighbour that slows a few segments of
one side then moves a few trials, not the figure; the drift of the disk lands on both sides.
An untimed warm-up segment of each side runs first (the tier's pool threads, RocksDB's caches,
the first requests to a cold file).
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
from tools.bench._common import median_trial, result

MiB = 1024 * 1024
BLOCK_SIZES = (1 * MiB, 8 * MiB)
RING_BYTES = 64 * MiB
SEGMENT_BYTES = 64 * MiB


def run(args: Any) -> Iterator[dict[str, Any]]:
    quick = bool(getattr(args, "quick", False))
    total = 64 * MiB if quick else 1024 * MiB
    rounds = 2 if quick else 4  # even: read_into and read_many take turns by round
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
    # Rings of distinct caller buffers (like engine pages), the same for both sides: reusing one
    # buffer would keep it cache-hot and flatter whichever side touches the bytes.
    ring = max(1, min(n, RING_BYTES // bs))
    srcs = [_aligned(bs) for _ in range(ring)]
    dsts = [_aligned(bs) for _ in range(ring)]
    rng = np.random.default_rng(0)
    for s in srcs:
        s[:] = rng.integers(0, 256, bs, dtype=np.uint8).tobytes()
    for d in dsts:
        d[:] = bytes(bs)  # fault the pages in now, not inside whichever side reads first
    metas = [
        BlockMeta(b"\x01" * 16, b"\x02" * 16, 0, bs, 0.0, payload_checksum(s), 0.0) for s in srcs
    ]
    keys = [BlockHash(i.to_bytes(16, "little")) for i in range(n)]
    per_seg = max(1, min(SEGMENT_BYTES, total // 4) // bs)
    segments = [range(i, min(i + per_seg, n)) for i in range(0, n, per_seg)]

    raw_path = base / f"raw-{label}.bin"
    fd, raw_direct = _open_raw(raw_path)
    tier = NvmeTier(f"bench-{label}", NvmeConfig(capacity_bytes=total), root=base)
    try:
        os.posix_fallocate(fd, 0, total)  # same starting state as the tier's preallocated file

        def raw_write(seg: range) -> None:
            for i in seg:
                os.pwrite(fd, srcs[i % ring], i * bs)

        def tier_write(seg: range) -> None:
            for i in seg:
                tier.write(keys[i], srcs[i % ring], metas[i % ring])

        def raw_read(seg: range) -> None:
            for i in seg:
                os.preadv(fd, [dsts[i % ring]], i * bs)

        def tier_read(seg: range) -> None:
            for i in seg:
                tier.read_into(keys[i], dsts[i % ring])

        def tier_read_many(seg: range) -> None:
            got = tier.read_many([keys[i] for i in seg], [dsts[i % ring] for i in seg])
            assert got == [bs] * len(seg), f"read_many failed: {got[:3]}"

        # Segments alternate between the sides (and which side goes first); each segment is a
        # trial of every side, so a disk whose speed drifts during the run slows both alike.
        rates: dict[str, list[float]] = {n: [] for n in ("raw_w", "tier_w", "raw_r", "tier_r", "raw_rm", "tier_rm")}
        writes: list[tuple[str, Callable[[range], None]]] = [("raw_w", raw_write), ("tier_w", tier_write)]
        for fn in (raw_write, tier_write, raw_read, tier_read, tier_read_many):
            fn(segments[0])  # warm-up, untimed (emptied again below)
        for r in range(rounds):
            # Untimed: empty the tier so every round writes fresh slots (in reverse, so the LIFO
            # free lists hand the slots back in ascending order, like the raw file's offsets).
            for k in reversed(keys):
                tier.delete(k)
            # Every byte written is read once: a second read of the same blocks (read_many
            # after read_into) may be served by the VM host's page cache, which O_DIRECT does
            # not bypass, and flattered whichever side read second. So the tier's two read
            # paths take turns by round, each against raw reads of bytes as fresh as its own.
            reads: list[tuple[str, Callable[[range], None]]] = (
                [("raw_r", raw_read), ("tier_r", tier_read)] if r % 2 == 0
                else [("raw_rm", raw_read), ("tier_rm", tier_read_many)]
            )
            for phase in (writes, reads):
                for j, seg in enumerate(segments):
                    for name, fn in phase if (j + r // 2) % 2 == 0 else phase[::-1]:
                        rates[name].append(len(seg) * bs / 1e9 / _timed(fn, seg))
        extra = {
            "block_bytes": bs,
            "total_bytes": total * rounds,
            "direct_io": tier.describe()["direct_io"],
            "raw_direct_io": raw_direct,
            "fs": fs,
        }
    finally:
        tier.close()
        os.close(fd)
        raw_path.unlink(missing_ok=True)
    for metric, ours, raw, goal in (
        ("write", "tier_w", "raw_w", None),
        ("read", "tier_r", "raw_r", 0.8),
        ("read_many", "tier_rm", "raw_rm", 0.8),
    ):
        value, baseline, ratios = median_trial(list(zip(rates[ours], rates[raw], strict=True)))
        yield result("nvme", f"{metric}_{label}", value, "GB/s", baseline, goal_ratio=goal,
                     trial_ratios=ratios, **extra)


def _timed(fn: Callable[[range], None], seg: range) -> float:
    t0 = time.perf_counter()
    fn(seg)
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
