"""Object tier specifics: object layout and headers, damaged objects, namespaces, capacity,
sharing between nodes, and a non-local fsspec filesystem (memory://). The Tier contract itself
is in test_conformance.py."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import secrets
import shutil
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest

from kvstore.block import BlockMeta, payload_checksum
from kvstore.errors import (
    BlockNotFound,
    ConfigError,
    CorruptBlockError,
    TierFullError,
    TierIOError,
    UsageError,
)
from kvstore.registry import build_config
from tiers.base import tier_dir
from tiers.object import (
    FORMAT_VERSION,
    MAGIC,
    MIN_HEADER,
    ObjectConfig,
    ObjectTier,
    pack_header,
    unpack_header,
)
from tiers.object.format import RAW, SHUFFLE_ZSTD, Header, decode_into, encode

KiB = 1024
MiB = 1024 * KiB
MakeBlock = Callable[..., Any]


@pytest.fixture
def memory_url() -> Iterator[str]:
    """A fresh prefix on fsspec's in-process memory filesystem: the non-local write path."""
    prefix = f"/kvs-test-{secrets.token_hex(6)}"
    yield f"memory://{prefix}"
    fs = fsspec.filesystem("memory")
    if fs.exists(prefix):
        fs.rm(prefix, recursive=True)


def _read(tier: ObjectTier, key: bytes, size: int) -> bytes:
    dst = bytearray(size)
    assert tier.read_into(key, memoryview(dst)) == size  # type: ignore[arg-type]
    return bytes(dst)


# ---- layout --------------------------------------------------------------------------------


def test_objects_are_content_addressed_and_self_describing(
    open_tier: Callable[..., ObjectTier], tmp_path: Path, make_block: MakeBlock
) -> None:
    tier = open_tier()
    block = make_block(5000, seed=1)
    tier.write(block.key, block.data, block.meta)
    h = block.key.hex()
    path = tier_dir(tmp_path, "o") / "objects" / "blocks" / h[:2] / f"{h}.kvb"
    assert tier.path(block.key) == path.as_posix()
    raw = path.read_bytes()
    assert raw[:4] == MAGIC
    version, length = struct.unpack_from("<HI", raw, 4)
    assert (version, length) == (FORMAT_VERSION, MIN_HEADER)
    assert len(raw) == MIN_HEADER + 5000
    assert raw[MIN_HEADER:] == block.data
    header = unpack_header(raw[:length], block.key, str(path))
    assert (header.meta, header.descriptor, header.stored) == (block.meta, b"", 5000)
    # No temp file is left beside the object.
    assert os.listdir(path.parent) == [path.name]


def test_header_round_trip_with_descriptor(make_block: MakeBlock) -> None:
    block = make_block(10, seed=2)
    header = pack_header(block.key, block.meta, b'{"model_id":"m"}')
    assert len(header) == MIN_HEADER + 16
    got = unpack_header(header, block.key, "x")
    assert (got.meta, got.descriptor) == (block.meta, b'{"model_id":"m"}')
    with pytest.raises(CorruptBlockError, match="holds block"):
        unpack_header(header, make_block(10, seed=3).key, "x")
    with pytest.raises(CorruptBlockError, match="truncated"):
        unpack_header(header[:-1], block.key, "x")


def test_namespace_descriptors_travel_in_headers(
    open_tier: Callable[..., ObjectTier], make_block: MakeBlock
) -> None:
    tier = open_tier()
    ns_a, ns_b = b"A" * 16, b"B" * 16
    tier.register_namespace(ns_a, b"descriptor of A")
    a = make_block(100, seed=4, ns=ns_a)
    b = make_block(100, seed=5, ns=ns_b)
    tier.write(a.key, a.data, a.meta)
    tier.write(b.key, b.data, b.meta)
    assert tier.namespaces() == {ns_a: b"descriptor of A"}
    tier.close()
    # A cold reader learns the descriptor from the objects alone.
    fresh = open_tier()
    assert fresh.namespaces() == {ns_a: b"descriptor of A"}
    assert _read(fresh, a.key, 100) == a.data


@pytest.mark.parametrize("local", [True, False])
def test_header_larger_than_one_probe(
    open_tier: Callable[..., ObjectTier], memory_url: str, make_block: MakeBlock, local: bool
) -> None:
    tier = open_tier() if local else open_tier(url=memory_url)
    ns = b"L" * 16
    descriptor = bytes(range(256)) * 40  # 10 KiB: the header needs a second ranged read
    tier.register_namespace(ns, descriptor)
    a = make_block(3000, seed=16, ns=ns)
    tier.write(a.key, a.data, a.meta)
    assert _read(tier, a.key, 3000) == a.data
    tier.close()
    fresh = open_tier() if local else open_tier(url=memory_url)
    assert dict(fresh.scan()) == {a.key: a.meta}
    assert fresh.namespaces() == {ns: descriptor}
    assert fresh.meta(a.key) == a.meta


@pytest.mark.parametrize("itemsize", [1, 2, 4])
@pytest.mark.parametrize("size", [0, 1, 7, 4096, 4099])
def test_codec_round_trips_any_size(itemsize: int, size: int) -> None:
    data = (np.arange(size, dtype=np.uint32) % 7).astype(np.uint8).tobytes()  # compressible
    codec, stored = encode(memoryview(data), itemsize, 1)
    meta = BlockMeta(b"N" * 16, b"P" * 16, 0, size, 0.0, payload_checksum(data), 0.0)
    header = Header(meta, b"", codec, itemsize, len(stored), 0)
    out = bytearray(size + 3)
    decode_into(header, memoryview(bytes(stored)), memoryview(out), "x")
    assert bytes(out[:size]) == data
    if size >= 4096:  # long repetitive runs always compress
        assert codec == SHUFFLE_ZSTD


def test_incompressible_payloads_are_stored_raw_and_bad_streams_are_corrupt() -> None:
    data = np.random.default_rng(0).bytes(5000)
    assert encode(memoryview(data), 2, 1)[0] == RAW  # zstd would only add bytes
    meta = BlockMeta(b"N" * 16, b"P" * 16, 0, 5000, 0.0, payload_checksum(data), 0.0)
    with pytest.raises(CorruptBlockError, match="does not decode"):
        decode_into(Header(meta, b"", SHUFFLE_ZSTD, 2, 10, 0), memoryview(b"not zstd!!"), memoryview(bytearray(5000)), "x")


def test_compressed_objects_on_the_local_filesystem(
    open_tier: Callable[..., ObjectTier], make_block: MakeBlock
) -> None:
    tier = open_tier(compress_namespaces=["*"])
    ns = b"C" * 16
    tier.register_namespace(ns, b'{"model_id": "m", "layout": {"dtype": "bfloat16"}}')
    data = bytes(8192)
    blk = make_block(8192, seed=60, ns=ns)
    meta = dataclasses.replace(blk.meta, checksum=payload_checksum(data))
    tier.write(blk.key, data, meta)
    assert Path(tier.path(blk.key)).stat().st_size < 1000
    assert _read(tier, blk.key, 8192) == data


def test_register_namespace_checks_its_arguments(open_tier: Callable[..., ObjectTier]) -> None:
    tier = open_tier()
    with pytest.raises(UsageError, match="16 bytes"):
        tier.register_namespace(b"short", b"")
    with pytest.raises(UsageError, match="at most"):
        tier.register_namespace(b"N" * 16, bytes(70_000))


# ---- damaged objects --------------------------------------------------------------------------


def _damage(path: Path, how: str) -> None:
    raw = bytearray(path.read_bytes())
    if how == "magic":
        raw[0:4] = b"NOPE"
    elif how == "version":
        struct.pack_into("<H", raw, 4, FORMAT_VERSION + 1)
    elif how == "header_byte":
        raw[30] ^= 0x01  # inside the BlockMeta: only the header checksum can tell
    elif how == "truncated":
        del raw[-1]
    elif how == "trailing":
        raw += b"\0"
    elif how == "header_only":
        del raw[MIN_HEADER:]
    elif how == "stub":
        del raw[5:]
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize(
    "how", ["magic", "version", "header_byte", "truncated", "trailing", "header_only", "stub"]
)
def test_damaged_object_is_corrupt_and_skipped_by_scan(
    open_tier: Callable[..., ObjectTier], make_block: MakeBlock, how: str
) -> None:
    tier = open_tier()
    good, bad = make_block(5000, seed=6), make_block(5000, seed=7)
    tier.write(good.key, good.data, good.meta)
    tier.write(bad.key, bad.data, bad.meta)
    tier.close()
    _damage(Path(tier.path(bad.key)), how)
    fresh = open_tier()
    with pytest.raises(CorruptBlockError):
        fresh.read_into(bad.key, memoryview(bytearray(5000)))
    assert dict(fresh.scan()) == {good.key: good.meta}
    # Another format version is foreign (left alone, counted apart), not damaged.
    foreign = how == "version"
    assert fresh.describe()["bad_headers"] == (0 if foreign else 1)
    assert fresh.describe()["foreign_objects"] == (1 if foreign else 0)
    assert fresh.usage().blocks == 1
    assert _read(fresh, good.key, 5000) == good.data


def test_object_under_another_blocks_name_is_corrupt(
    open_tier: Callable[..., ObjectTier], make_block: MakeBlock
) -> None:
    tier = open_tier()
    a, b = make_block(100, seed=8), make_block(100, seed=9)
    tier.write(a.key, a.data, a.meta)
    target = Path(tier.path(b.key))
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(tier.path(a.key), target)
    with pytest.raises(CorruptBlockError, match="holds block"):
        tier.read_into(b.key, memoryview(bytearray(100)))


def test_scan_ignores_temp_files_and_counts_bad_names(
    open_tier: Callable[..., ObjectTier], make_block: MakeBlock
) -> None:
    tier = open_tier()
    a = make_block(100, seed=10)
    tier.write(a.key, a.data, a.meta)
    directory = Path(tier.path(a.key)).parent
    (directory / f"{a.key.hex()}.kvb.tmp-deadbeef").write_bytes(b"half a write")
    (directory / "not-a-hash.kvb").write_bytes(b"junk")
    assert dict(tier.scan()) == {a.key: a.meta}
    assert tier.describe()["bad_headers"] == 1


# ---- writes ----------------------------------------------------------------------------------------


def test_failed_write_leaves_nothing(
    open_tier: Callable[..., ObjectTier], make_block: MakeBlock, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = open_tier()
    a = make_block(1000, seed=11)

    def no_rename(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", no_rename)
    with pytest.raises(TierIOError, match="No space"):
        tier.write(a.key, a.data, a.meta, durable=True)
    monkeypatch.undo()
    assert not tier.contains(a.key)
    assert tier.usage().used_bytes == 0
    assert os.listdir(Path(tier.path(a.key)).parent) == []
    tier.write(a.key, a.data, a.meta)  # the reservation was released
    assert tier.usage().used_bytes == 1000


def test_capacity_counts_payload_bytes(
    open_tier: Callable[..., ObjectTier], make_block: MakeBlock
) -> None:
    tier = open_tier(capacity_bytes=10_000)
    a, b, c = make_block(6000, seed=12), make_block(6000, seed=13), make_block(4000, seed=14)
    tier.write(a.key, a.data, a.meta)
    assert tier.fits(4000) and not tier.fits(4001)
    with pytest.raises(TierFullError):
        tier.write(b.key, b.data, b.meta)
    tier.write(a.key, b.data, b.meta)  # a rewrite needs only the difference
    tier.write(c.key, c.data, c.meta)
    assert tier.usage().used_bytes == 10_000


def test_update_expiry_is_a_no_op(
    open_tier: Callable[..., ObjectTier], make_block: MakeBlock
) -> None:
    tier = open_tier()
    a = make_block(100, seed=15)
    tier.write(a.key, a.data, a.meta)
    tier.update_expiry([(a.key, 1.0)])
    assert tier.meta(a.key) == a.meta


def test_flush_then_reopen(open_tier: Callable[..., ObjectTier], make_block: MakeBlock) -> None:
    tier = open_tier()
    blocks = [make_block(100 + i, seed=20 + i) for i in range(5)]
    for b in blocks:
        tier.write(b.key, b.data, b.meta)
    tier.flush()
    tier.close()
    fresh = open_tier()
    assert dict(fresh.scan()) == {b.key: b.meta for b in blocks}


# ---- sharing between nodes ------------------------------------------------------------------


def test_a_second_node_finds_blocks_by_hash(
    open_tier: Callable[..., ObjectTier], tmp_path: Path, make_block: MakeBlock
) -> None:
    url = f"file://{tmp_path.as_posix()}/bucket"
    node_a, node_b = open_tier("a", url=url), open_tier("b", url=url)
    assert node_b.usage().blocks == 0  # B lists the bucket on first use, before A writes
    block = make_block(5000, seed=30)
    node_a.write(block.key, block.data, block.meta)
    # B has not listed the bucket since A wrote: contains() answers from B's map, but a read
    # by hash goes to the store.
    assert not node_b.contains(block.key)
    assert node_b.meta(block.key) == block.meta
    assert _read(node_b, block.key, 5000) == block.data
    assert dict(node_b.scan()) == {block.key: block.meta}
    assert node_b.contains(block.key)


# ---- a non-local filesystem -----------------------------------------------------------------


def test_memory_filesystem_round_trip(
    open_tier: Callable[..., ObjectTier], memory_url: str, make_block: MakeBlock
) -> None:
    tier = open_tier(url=memory_url)
    a, b = make_block(5000, seed=40), make_block(1, seed=41)
    tier.write(a.key, a.data, a.meta, durable=True)
    tier.write(b.key, memoryview(bytearray(b.data)), b.meta)
    assert _read(tier, a.key, 5000) == a.data
    assert tier.meta(b.key) == b.meta
    assert tier.delete(b.key) is True
    assert tier.delete(b.key) is False
    with pytest.raises(BlockNotFound):
        tier.read_into(b.key, memoryview(bytearray(1)))
    tier.close()
    fresh = open_tier(url=memory_url)
    assert dict(fresh.scan()) == {a.key: a.meta}
    assert fresh.usage().used_bytes == 5000


def test_memory_filesystem_detects_corruption(
    open_tier: Callable[..., ObjectTier], memory_url: str, make_block: MakeBlock
) -> None:
    # Synchronous writes: with write-behind, a send still in flight could land after the
    # damage below and repair it (same key, same bytes).
    tier = open_tier(url=memory_url, write_behind=False)
    a = make_block(5000, seed=42)
    tier.write(a.key, a.data, a.meta)
    fs = fsspec.filesystem("memory")
    raw = bytearray(fs.cat_file(tier.path(a.key)))
    raw[-100] ^= 0x40
    fs.pipe_file(tier.path(a.key), bytes(raw))
    with pytest.raises(CorruptBlockError, match="payload checksum"):
        tier.read_into(a.key, memoryview(bytearray(5000)))
    fs.pipe_file(tier.path(a.key), bytes(raw[:-1]))
    with pytest.raises(CorruptBlockError, match="torn"):
        tier.read_into(a.key, memoryview(bytearray(5000)))


# ---- configuration -----------------------------------------------------------------------------


def test_config_defaults_and_parsing() -> None:
    cfg = build_config(ObjectConfig, {"capacity_bytes": "2GiB"}, "tier 'o'")
    assert cfg == ObjectConfig(url="", capacity_bytes=2 * 1024**3, storage_options={})
    assert ObjectConfig().capacity_bytes == 1024**4


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"capacity_bytes": 0}, "capacity_bytes"),
        ({"storage_options": "key=1"}, "storage_options"),
        ({"url": 5}, "url"),
    ],
)
def test_config_errors_say_what_to_do(options: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        build_config(ObjectConfig, options, "tier 'o'")


def test_unknown_protocol_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot use url"):
        ObjectTier("o", ObjectConfig(url="nosuchproto://x"), root=tmp_path)


@pytest.mark.skipif(importlib.util.find_spec("s3fs") is not None, reason="s3fs is installed")
def test_missing_s3fs_names_the_extra(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"kvstore\[s3\]"):
        ObjectTier("o", ObjectConfig(url="s3://bucket/kv"), root=tmp_path)


def test_closed_tier_refuses_io(
    open_tier: Callable[..., ObjectTier], make_block: MakeBlock
) -> None:
    tier = open_tier()
    a = make_block(10, seed=50)
    tier.write(a.key, a.data, a.meta)
    tier.close()
    with pytest.raises(TierIOError, match="closed"):
        tier.read_into(a.key, memoryview(bytearray(10)))
