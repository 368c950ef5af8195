"""Object tier on S3 against raw s3fs, on the same server in the same run.

The benchmark starts its own S3 server (moto_server on loopback, tools/s3server.py). Blocks of
1, 2, 4 and 8 MiB (random bytes, so compression, off by default, plays no part) go through
``ObjectTier.write_many`` / ``read_many`` in batches, against s3fs's list forms
``fs.pipe({path: bytes})`` / ``fs.cat([paths])`` of the same sizes, with the same filesystem
instance (one connection pool) and the same concurrency. The tier's side includes what it does
beyond moving bytes: the header, the payload checksum on every read, the copy into the
caller's buffer. Sides alternate batch by batch and times are summed, so the drift of a shared
2-core machine lands on both alike.

Also measured: the cold rebuild (``scan``: one listing, then every header by concurrent ranged
GETs) against s3fs listing + ``cat_ranges`` of the same headers; a probe for 16 blocks another
node wrote (``probe``: windows of 1, 2, 4, 8, 1 concurrent ranged GETs) against one ranged GET
per block in turn; and the stored size of byte-shuffle + zstd-1 on bf16-like KV against plain
zstd-1 (no server).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import zstandard

from kvstore.block import BlockMeta, payload_checksum
from kvstore.keys import BlockHash
from tiers.object import ObjectTier
from tiers.object.config import ObjectConfig
from tiers.object.format import PROBE_BYTES, encode
from tools.bench._common import result
from tools.s3server import LocalS3

MiB = 1024 * 1024
SIZES = (1 * MiB, 2 * MiB, 4 * MiB, 8 * MiB)
BATCH = 16
CONCURRENCY = 16


def run(args: Any) -> Iterator[dict[str, Any]]:
    quick = bool(getattr(args, "quick", False))
    total = 30 * MiB if quick else 480 * MiB  # per side and direction
    yield _compression_ratio()
    with LocalS3() as server, tempfile.TemporaryDirectory(prefix="kvstore-bench-s3-") as tmp:
        server.make_bucket("bench")
        cfg = ObjectConfig(
            url="s3://bench/tier",
            capacity_bytes=4 * total,
            max_concurrency=CONCURRENCY,
            worker_interval_s=0,
            **server.tier_options(),
        )
        tier = ObjectTier("bench", cfg, root=Path(tmp))
        try:
            yield from _throughput(tier, total)
            yield from _rebuild_and_probe(tier, cfg, Path(tmp), 64 if quick else 512)
        finally:
            tier.close()


def _throughput(tier: ObjectTier, total: int) -> Iterator[dict[str, Any]]:
    fs = tier.blobs.fs  # the tier's own s3fs instance: the same client and connection pool
    raw_base = "bench/raw"
    rng = np.random.default_rng(0)
    sizes = [SIZES[i % len(SIZES)] for i in range(total * len(SIZES) // sum(SIZES))]
    # One source buffer per size (reused: moving bytes is what is measured, not the RNG).
    srcs = {s: memoryview(rng.integers(0, 256, s, dtype=np.uint8).tobytes()) for s in SIZES}
    metas = {s: BlockMeta(b"\x01" * 16, b"\x02" * 16, 0, s, 2e9, payload_checksum(srcs[s]), 0.0) for s in SIZES}
    dsts = [memoryview(bytearray(s)) for s in sizes[:BATCH]]
    keys = [BlockHash(i.to_bytes(16, "little")) for i in range(len(sizes))]
    raw_paths = [f"{raw_base}/{i:08d}" for i in range(len(sizes))]
    batches = [range(i, min(i + BATCH, len(sizes))) for i in range(0, len(sizes), BATCH)]

    def tier_put(b: range) -> None:
        errors = tier.write_many([(keys[i], srcs[sizes[i]], metas[sizes[i]]) for i in b])
        assert not any(errors), errors

    def raw_put(b: range) -> None:
        fs.pipe({raw_paths[i]: bytes(srcs[sizes[i]]) for i in b}, batch_size=CONCURRENCY)

    def tier_get(b: range) -> None:
        out = tier.read_many([keys[i] for i in b], dsts[: len(b)])
        assert all(isinstance(n, int) for n in out), out

    def raw_get(b: range) -> None:
        got = fs.cat([raw_paths[i] for i in b], batch_size=CONCURRENCY)
        for j, i in enumerate(b):  # into the caller's buffer, as an engine needs it
            dsts[j][: sizes[i]] = got[raw_paths[i]]

    for warm in (tier_put, raw_put, tier_get, raw_get):  # untimed: open the pooled connections
        warm(batches[0])
    spent = dict.fromkeys(("tier_put", "raw_put", "tier_get", "raw_get"), 0.0)
    for pair in ((("tier_put", tier_put), ("raw_put", raw_put)), (("tier_get", tier_get), ("raw_get", raw_get))):
        for j, b in enumerate(batches):
            for name, fn in pair if j % 2 == 0 else pair[::-1]:
                spent[name] += _timed(fn, b)
    nbytes = sum(sizes)
    mb = nbytes / 1e6
    extra = {"blocks": len(sizes), "block_sizes_mib": [s // MiB for s in SIZES], "batch": BATCH,
             "concurrency": CONCURRENCY, "total_bytes": nbytes, "server": "moto_server (loopback)"}
    yield result("s3", "put_many_1-8MiB", mb / spent["tier_put"], "MB/s", mb / spent["raw_put"], **extra)
    yield result("s3", "get_many_1-8MiB", mb / spent["tier_get"], "MB/s", mb / spent["raw_get"], **extra)
    fs.rm(raw_base, recursive=True)
    for k in keys:
        tier.delete(k)


def _rebuild_and_probe(tier: ObjectTier, cfg: ObjectConfig, root: Path, n: int) -> Iterator[dict[str, Any]]:
    """Cold rebuild of ``n`` small objects, and a probe for 16 blocks."""
    size = 64 * 1024
    data = memoryview(bytes(size))
    keys = [BlockHash(i.to_bytes(8, "little") * 2) for i in range(n)]
    meta = BlockMeta(b"\x01" * 16, b"\x02" * 16, 0, size, 2e9, payload_checksum(data), 0.0)
    for i in range(0, n, BATCH):
        tier.write_many([(k, data, meta) for k in keys[i : i + BATCH]])
    fs = tier.blobs.fs

    def tier_scan() -> None:
        fresh = ObjectTier("cold", cfg, root=root)
        try:
            assert len(list(fresh.scan())) == n
        finally:
            fresh.close()

    def raw_scan() -> None:
        paths = sorted(fs.find("bench/tier/blocks"))
        heads = fs.cat_ranges(paths, [0] * len(paths), [PROBE_BYTES] * len(paths), batch_size=CONCURRENCY)
        assert len(heads) == n

    scan_t, raw_t = _best_alternating(tier_scan, raw_scan, 3)
    yield result("s3", f"cold_rebuild_{n}_objects", n / scan_t, "objects/s", n / raw_t,
                 note="tier: list + concurrent ranged GETs of headers + checks; raw: s3fs find + cat_ranges")

    chain = keys[:16]
    reader = ObjectTier("reader", cfg, root=root)
    try:
        reader.usage()  # its own listing is done: what follows measures the probe alone

        def probe() -> None:
            assert len(reader.probe(chain)) == 16

        def one_by_one() -> None:
            for k in chain:
                fs.cat_file(tier.path(k), start=0, end=PROBE_BYTES)

        probe_t, seq_t = _best_alternating(probe, one_by_one, 5)
    finally:
        reader.close()
    yield result("s3", "probe_16_blocks", probe_t * 1e3, "ms", seq_t * 1e3,
                 note="baseline: one ranged GET per block in turn; lower is better")
    for k in keys:
        tier.delete(k)


def _compression_ratio() -> dict[str, Any]:
    """Stored size / raw size of 8 MiB of bf16-like KV: byte-shuffle + zstd-1 vs plain zstd-1."""
    x = np.random.default_rng(0).standard_normal(4 * MiB).astype(np.float32)
    bf16 = memoryview((x.view(np.uint32) >> 16).astype(np.uint16).tobytes())
    t0 = time.perf_counter()
    _, stored = encode(bf16, 2, 1)
    gbps = len(bf16) / (time.perf_counter() - t0) / 1e9
    plain = len(zstandard.ZstdCompressor(level=1).compress(bf16))
    return result("s3", "shuffle_zstd1_size_ratio_bf16", len(stored) / len(bf16), "ratio",
                  plain / len(bf16), encode_gbps=round(gbps, 3),
                  note="synthetic bf16 (normal values); lower is better")


def _best_alternating(a: Callable[[], None], b: Callable[[], None], repeat: int) -> tuple[float, float]:
    best_a = best_b = float("inf")
    for _ in range(repeat):
        best_a = min(best_a, _timed(lambda _: a(), None))
        best_b = min(best_b, _timed(lambda _: b(), None))
    return best_a, best_b


def _timed(fn: Callable[[Any], None], arg: Any) -> float:
    t0 = time.perf_counter()
    fn(arg)
    return time.perf_counter() - t0
