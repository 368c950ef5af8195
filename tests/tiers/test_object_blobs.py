"""The object tier's backends behind one interface: ``LocalBlobs`` (plain files) and
``RemoteBlobs`` (fsspec's memory:// filesystem, the non-local path) pass the same contract."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest

from kvstore.clock import FakeClock
from kvstore.errors import BlockNotFound, CorruptBlockError
from tiers.object.blobs import Blob, BlobStore, open_blobs
from tiers.object.config import ObjectConfig
from tiers.object.format import pack_header

MakeBlock = Callable[..., Any]


@pytest.fixture(params=["local", "remote"])
def blobs(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[BlobStore]:
    if request.param == "local":
        url = f"file://{tmp_path.absolute().as_posix()}/objects"
    else:
        url = f"memory:///kvs-blobs-{secrets.token_hex(6)}"
    store, base = open_blobs("o", url, ObjectConfig(capacity_bytes=1 << 20), FakeClock(), wake=None)
    assert store.local == (request.param == "local") and base.endswith(url.rsplit("/", 1)[-1])
    store.base = base  # type: ignore[attr-defined]
    yield store
    store.close()
    fs = fsspec.filesystem("memory")
    if request.param == "remote" and fs.exists(base):
        fs.rm(base, recursive=True)


def _blob(store: BlobStore, block: Any) -> Blob:
    path = f"{store.base}/blocks/{block.key.hex()[:2]}/{block.key.hex()}.kvb"  # type: ignore[attr-defined]
    return Blob(block.key, path, pack_header(block.key, block.meta) + block.data, block.meta.size)


def test_write_then_read_verified(blobs: BlobStore, make_block: MakeBlock) -> None:
    a, b = make_block(5000, seed=1), make_block(100, seed=2)
    ba, bb = _blob(blobs, a), _blob(blobs, b)
    assert blobs.write([ba, bb], durable=True) == [None, None]
    dsts = [memoryview(bytearray(5000)), memoryview(bytearray(100))]
    metas = blobs.read_into([(a.key, ba.path, dsts[0]), (b.key, bb.path, dsts[1])])
    assert metas == [a.meta, b.meta] and bytes(dsts[0]) == a.data and bytes(dsts[1]) == b.data
    (h,) = blobs.headers([(a.key, ba.path)])
    assert not isinstance(h, Exception) and h.meta == a.meta
    prefix = f"{blobs.base}/blocks"  # type: ignore[attr-defined]
    listed = {ba.path: len(ba.data), bb.path: len(bb.data)}
    first, second = sorted(listed)
    assert blobs.list(prefix) == listed
    assert blobs.list(prefix, after=first) == {second: listed[second]}
    assert blobs.list(prefix, limit=1) == {first: listed[first]}


def test_misses_damage_and_deletes(blobs: BlobStore, make_block: MakeBlock) -> None:
    a, b = make_block(300, seed=3), make_block(300, seed=4)
    ba = _blob(blobs, a)
    wrong = Blob(b.key, _blob(blobs, b).path, ba.data, ba.size)  # a's bytes under b's name
    assert blobs.write([ba, wrong], durable=False) == [None, None]
    blobs.flush()
    missing = make_block(10, seed=5)
    out = blobs.read_into([(missing.key, _blob(blobs, missing).path, memoryview(bytearray(10))),
                           (b.key, wrong.path, memoryview(bytearray(300)))])
    assert isinstance(out[0], BlockNotFound) and isinstance(out[1], CorruptBlockError)
    assert blobs.delete_block(a.key, [ba.path], known=False) is True
    assert blobs.delete_block(a.key, [ba.path], known=False) is False
    blobs.delete([wrong.path, wrong.path + ".never-written"])  # missing paths are no error
    assert blobs.list(f"{blobs.base}/blocks") == {}  # type: ignore[attr-defined]


def test_side_objects_are_best_effort(blobs: BlobStore) -> None:
    p = f"{blobs.base}/touch/ab/x.kvt"  # type: ignore[attr-defined]
    assert blobs.put_small({p: b"touch"}) == [True]
    assert blobs.cat([p, p + ".missing"]) == [b"touch", None]
    assert blobs.queued(b"k" * 16) is None and blobs.available()  # type: ignore[arg-type]
