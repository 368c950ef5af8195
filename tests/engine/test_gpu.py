"""The GPU load path's host side: runs of equally spaced blocks, copies out of a lease or buffer."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from engine.gpu import HostBlocks, runs  # noqa: E402


def test_runs_group_equally_spaced_blocks() -> None:
    assert runs([]) == []
    assert runs([0]) == [(0, 1, 0)]
    assert runs([0, 8, 16, 24]) == [(0, 4, 8)]
    assert runs([0, 10, 20, 30, 100, 110, 5, 200]) == [(0, 4, 10), (4, 2, 10), (6, 2, 195)]
    # A step back cannot be a 2-D copy's pitch: the block goes alone.
    assert runs([50, 10, 20]) == [(0, 1, 0), (1, 2, 10)]


def test_host_blocks_copy_range_and_release() -> None:
    src = torch.arange(3 * 16, dtype=torch.uint8).view(3, 16)
    hb = HostBlocks(src)
    dst = torch.zeros(3, 16, dtype=torch.uint8)
    hb.copy_range(dst, 4, 12)
    assert torch.equal(dst[:, 4:12], src[:, 4:12])
    assert int(dst[:, :4].sum()) == 0 and int(dst[:, 12:].sum()) == 0
    assert hb.num_blocks == 3 and torch.equal(hb.block(1), src[1])
    hb.release()


def test_arena_blocks_copy_from_a_lease(make_store) -> None:
    from engine.gpu import ArenaBlocks
    from tests.conftest import BB, SMALL_NS, chain_for, payload

    s = make_store()
    if not hasattr(s, "acquire"):
        pytest.skip("this store has no leases")
    chain = chain_for(11, 4)
    s.put(SMALL_NS, chain, [payload(h) for h in chain])
    blocks = ArenaBlocks(s, s.acquire(SMALL_NS, chain))
    assert blocks.num_blocks == 4
    dst = torch.zeros(4, BB, dtype=torch.uint8)
    blocks.copy_range(dst, 0, BB)
    for i, h in enumerate(chain):
        assert bytes(dst[i].numpy()) == payload(h)
        assert bytes(blocks.block(i).numpy()) == payload(h)
    blocks.release()
    assert (s.index.in_use[s.index.live_ids()] == 0).all()
