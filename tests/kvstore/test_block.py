"""BlockMeta: the records of a chain built at once equal those built one at a time."""

from __future__ import annotations

import pytest

from kvstore.block import CHECKSUM_DEFERRED, BlockMeta

NS, P0, P1 = b"n" * 16, b"p" * 16, b"q" * 16


def test_of_chain_equals_one_record_per_block() -> None:
    chain = BlockMeta.of_chain(NS, [P0, P1], 3, 4096, 5.5, [7, CHECKSUM_DEFERRED], 1.25)
    one = [BlockMeta(NS, P0, 3, 4096, 5.5, 7, 1.25), BlockMeta(NS, P1, 4, 4096, 5.5, CHECKSUM_DEFERRED, 1.25)]
    assert chain == one and [hash(m) for m in chain] == [hash(m) for m in one]
    assert chain[0].pack() == one[0].pack() and chain[1].with_checksum(9) == one[1].with_checksum(9)
    with pytest.raises(AttributeError):
        chain[0].depth = 5  # type: ignore[misc]  # still frozen


def test_of_chain_checks_hash_lengths_and_counts() -> None:
    with pytest.raises(ValueError, match="16-byte"):
        BlockMeta.of_chain(NS, [P0, b"short"], 0, 1, 1.0, [0, 0], 0.0)
    with pytest.raises(ValueError):
        BlockMeta.of_chain(NS, [P0, P1], 0, 1, 1.0, [0], 0.0)  # a checksum per block
    assert BlockMeta.of_chain(NS, [], 0, 1, 1.0, [], 0.0) == []
