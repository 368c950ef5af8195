"""The GPU load path's host side: runs of equally spaced blocks, copies out of a lease or buffer."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import threading  # noqa: E402

from engine.gpu import HostBlocks, HostRing, runs  # noqa: E402


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


def test_arena_blocks_copy_a_later_range_in_column_pieces(make_store) -> None:
    """Blocks ``first..`` of a lease, copied a column range at a time (a restore's layer groups
    past its head): every byte lands, and the range's runs are worked out once."""
    from engine.gpu import ArenaBlocks
    from tests.conftest import BB, SMALL_NS, chain_for, payload

    s = make_store()
    chain = chain_for(12, 6)
    s.put(SMALL_NS, chain, [payload(h) for h in chain])
    blocks = ArenaBlocks(s, s.acquire(SMALL_NS, chain))
    dst = torch.zeros(6, BB, dtype=torch.uint8)
    half = BB // 2
    for lo, hi in ((0, half), (half, BB)):
        blocks.copy_into(dst[2:, lo:hi], lo, hi, first=2)
    assert int(dst[:2].count_nonzero()) == 0
    for i, h in enumerate(chain[2:], start=2):
        assert bytes(dst[i].numpy()) == payload(h)
    assert blocks.runs_of(2, 4) is blocks.runs_of(2, 4)
    blocks.release()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_arena_blocks_copy_on_a_given_stream(make_store, device: str) -> None:
    """``copy_into(..., stream=)`` (a restore's head, queued on the copy stream without making
    it current): every byte lands once that stream's event has, and the current stream is left
    as it was. On the CPU the stream is not used (the copy is done at once)."""
    from engine.gpu import ArenaBlocks
    from tests.conftest import BB, SMALL_NS, chain_for, payload

    s = make_store()
    chain = chain_for(13, 5)
    s.put(SMALL_NS, chain, [payload(h) for h in chain])
    blocks = ArenaBlocks(s, s.acquire(SMALL_NS, chain))
    dst = torch.zeros(5, BB, dtype=torch.uint8, device=device)
    if device == "cuda":
        side, before = torch.cuda.Stream(), torch.cuda.current_stream()
        blocks.copy_into(dst[1:], 0, BB, first=1, stream=side)
        assert torch.cuda.current_stream() == before
        ev = torch.cuda.Event()
        ev.record(side)
        ev.synchronize()
    else:
        blocks.copy_into(dst[1:], 0, BB, first=1, stream=None)
    got = dst.cpu()
    assert int(got[0].count_nonzero()) == 0
    for i, h in enumerate(chain[1:], start=1):
        assert bytes(got[i].numpy()) == payload(h)
    blocks.release()


def test_arena_slots_take_rows_into_a_reservation(make_store) -> None:
    """A save's device-to-host copy straight into a reservation's slots (here from host rows,
    in two ranges): after the commit the blocks load with those bytes; an abort leaves none."""
    from engine.gpu import ArenaSlots
    from tests.conftest import BB, SMALL_NS, chain_for, payload

    s = make_store()
    chain = chain_for(13, 6)
    src = torch.stack([torch.frombuffer(bytearray(payload(h)), dtype=torch.uint8) for h in chain])
    slots = ArenaSlots(s.reserve(SMALL_NS, chain))
    assert (slots.num_blocks, slots.first) == (6, 0)
    assert slots.copy_from(src[2:], first=2) >= 1
    slots.copy_from(src[:2])
    assert s.lookup(SMALL_NS, chain).num_blocks == 0  # nothing before the commit
    assert slots.commit() == 6
    got = torch.zeros(6, BB, dtype=torch.uint8)
    assert s.get_into(SMALL_NS, chain, got.numpy()) == 6
    assert torch.equal(got, src)
    other = chain_for(14, 3)
    aborted = ArenaSlots(s.reserve(SMALL_NS, other))
    aborted.copy_from(src[:3])
    aborted.abort()
    assert s.lookup(SMALL_NS, other).num_blocks == 0


def test_host_ring_hands_out_space_in_order_and_reuses_it() -> None:
    ring = HostRing(100, pin=False)
    a, ta = ring.take(40)
    b, tb = ring.take(40)
    assert a.data_ptr() == ring.buf.data_ptr() and b.data_ptr() == ring.buf.data_ptr() + 40
    assert ring.take(30, timeout=0) is None  # 20 bytes left at the end, none at the start
    assert ring.take(101) is None and ring.take(0) is None
    ring.give(tb)  # out of order: frees nothing while the older ticket is out
    assert ring.in_use == 2 and ring.take(30, timeout=0) is None
    ring.give(ta)
    assert ring.in_use == 0
    c, tc = ring.take(60)  # empty again: from the start
    assert c.data_ptr() == ring.buf.data_ptr()
    d, td = ring.take(40)
    assert d.data_ptr() == ring.buf.data_ptr() + 60
    ring.give(tc)  # [0, 60) free, [60, 100) in use: the next take wraps to the start
    e, te = ring.take(50)
    assert e.data_ptr() == ring.buf.data_ptr()
    assert ring.take(20, timeout=0) is None  # wrapped: only [50, 60) is free
    f, tf = ring.take(10)
    assert f.data_ptr() == ring.buf.data_ptr() + 50
    for t in (td, te, tf):
        ring.give(t)
    assert ring.in_use == 0 and ring.waits == 3  # the three takes that found no room


def test_host_ring_take_waits_for_a_give_on_another_thread() -> None:
    ring = HostRing(64, pin=False)
    _, t0 = ring.take(64)
    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append(ring.take(32)))
    waiter.start()
    ring.give(t0)
    waiter.join(timeout=60)
    assert not waiter.is_alive()
    view, _ = got[0]  # type: ignore[misc]
    assert view.numel() == 32 and view.data_ptr() == ring.buf.data_ptr()
