"""A chain may extend another namespace's cached prefix (a hybrid model's window pieces under
its full part, kvstore.hybrid), but loads never cross a namespace and the blocks a put writes
are always the put's own namespace's."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvstore.errors import UsageError
from kvstore.keys import KVLayout, LayerGroup, Namespace
from kvstore.store import KVStore
from tests.kvstore.store.conftest import NS, chain, put, resident

# Another namespace of the same deployment with another block size (a window part).
PIECES = Namespace("test/null#pieces", KVLayout("uint8", 4, (LayerGroup("full", 1, 1, 2),)))

Make = Callable[..., KVStore]


def _put_piece(s: KVStore, names: list[str], start: int) -> int:
    c = chain(*names)
    return s.put(PIECES, c, [bytes(PIECES.block_bytes)] * (len(c) - start), start=start)


def test_a_piece_hangs_under_another_namespaces_prefix_and_leaves_before_it(null_store: Make) -> None:
    s = null_store(8)
    s.register_namespace(PIECES)
    put(s, ["a0", "a1"])
    assert _put_piece(s, ["a0", "a1", "p2"], start=2) == 1
    idx = s.index
    assert int(idx.children[idx.id_of(chain("a1")[0])]) == 1  # the piece is a1's child
    # Loads never cross a namespace: the full part's blocks are no hit for the pieces' namespace,
    # and a piece is no hit for the full part's.
    assert s.lookup(PIECES, chain("a0", "a1", "p2")).num_blocks == 0
    assert s.lookup(NS, chain("a0", "a1", "p2")).num_blocks == 2
    assert s.get_into(NS, chain("a0", "a1", "p2"), [bytearray(NS.block_bytes) for _ in range(3)]) == 2
    # Prefix-closure across the two: a1 cannot leave while its piece is cached.
    assert s.delete(NS, chain("a1")) == 2 and resident(s) == {"a0"}


def test_the_blocks_a_put_writes_must_be_its_own_namespaces(null_store: Make) -> None:
    s = null_store(8)
    s.register_namespace(PIECES)
    put(s, ["a0", "a1"])
    with pytest.raises(UsageError, match="another place"):
        _put_piece(s, ["a0", "a1"], start=1)  # a1 is the full part's block: not a piece to write
    assert resident(s) == {"a0", "a1"}
