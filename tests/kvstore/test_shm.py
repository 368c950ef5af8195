"""kvstore.shm's prefault: every page of a mapping faulted in by a background thread, no byte
changed, stoppable before the mapping closes; the page-touching fallback of old kernels."""

from __future__ import annotations

import sys

import numpy as np
import pytest

import kvstore.shm as shm
from kvstore.shm import Prefault, Segment, memfd_segment, reopen_readonly

MiB = 1024 * 1024
WAIT_S = 600  # a bound for a wedged thread only: a loaded 2-core box may take seconds

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and smaps are Linux's")


def resident_bytes(buf: memoryview) -> int:
    """Rss of the mapping that holds ``buf`` (from /proc/self/smaps)."""
    addr = np.frombuffer(buf, np.uint8).ctypes.data
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError("the mapping is not in /proc/self/smaps")


def test_prefault_maps_every_page_and_changes_no_byte() -> None:
    seg = memfd_segment(16 * MiB, "test-prefault")
    try:
        arr = np.frombuffer(seg.buf, np.uint8)
        arr[: 4 * MiB] = 7  # a writer already at work when the prefault starts
        before = resident_bytes(seg.buf)
        p = Prefault(seg.buf, write=True)
        assert p.done.wait(WAIT_S)
        assert p.faulted_bytes == seg.size
        assert before < seg.size <= resident_bytes(seg.buf)
        assert (arr[: 4 * MiB] == 7).all() and not arr[4 * MiB :].any()
        del arr
    finally:
        seg.close()


def test_a_read_only_mapping_is_faulted_in_for_reading(monkeypatch: pytest.MonkeyPatch) -> None:
    seg = memfd_segment(8 * MiB, "test-prefault-ro")
    np.frombuffer(seg.buf, np.uint8)[:] = 3
    ro = Segment(reopen_readonly(seg.fileno()), writable=False)
    try:
        p = Prefault(ro.buf, write=False)
        assert p.done.wait(WAIT_S)
        assert resident_bytes(ro.buf) >= ro.size
    finally:
        ro.close()
        seg.close()


def test_without_the_madvise_advice_the_pages_are_touched(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm, "_madvise", lambda: None)  # a kernel before 5.14, or not Linux
    seg = memfd_segment(8 * MiB, "test-prefault-touch")
    try:
        p = Prefault(seg.buf, write=True)
        assert p.done.wait(WAIT_S)
        assert p.faulted_bytes == seg.size and resident_bytes(seg.buf) >= seg.size
    finally:
        seg.close()


def test_stop_lets_the_mapping_close() -> None:
    seg = memfd_segment(64 * MiB, "test-prefault-stop")
    p = Prefault(seg.buf, write=True)
    p.stop()
    assert p.done.is_set() and p.faulted_bytes <= seg.size
    seg.close()  # no view of the mapping is left: BufferError otherwise
    p.stop()  # idempotent
