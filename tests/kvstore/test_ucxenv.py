"""kvstore.ucxenv: the UCX defaults, transfer_all, and Progress (ucxx's worker driven from an
asyncio loop without spinning), the last against a fake worker whose events the test makes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvstore.ucxenv import Progress, transfer_all


def test_transfers_start_in_order_run_at_once_and_all_end_before_a_failure() -> None:
    started: list[int] = []
    ended: list[int] = []

    async def op(i: int, total: int = 3, fail: bool = False) -> None:
        started.append(i)  # ucxx posts its request here, before the first await
        await asyncio.sleep(0)
        assert started == list(range(total)), "every transfer was posted before any completed"
        ended.append(i)
        if fail:
            raise ConnectionError(f"transfer {i} failed")

    async def main() -> None:
        await transfer_all([op(0), op(1, fail=True), op(2)])

    with pytest.raises(ConnectionError, match="transfer 1"):
        asyncio.run(main())
    assert started == [0, 1, 2] and sorted(ended) == [0, 1, 2]
    started.clear()
    ended.clear()
    asyncio.run(transfer_all([op(0, total=1)]))
    assert ended == [0]
    asyncio.run(transfer_all([]))


def test_ucx_defaults_fill_only_what_the_operator_left_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvstore.ucxenv import UCX_ENV_DEFAULTS, apply_ucx_env

    for key in UCX_ENV_DEFAULTS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("UCX_RNDV_SCHEME", "get_zcopy")  # the operator's choice wins
    apply_ucx_env()
    assert os.environ["UCX_RNDV_SCHEME"] == "get_zcopy"
    assert os.environ["UCX_RNDV_THRESH"] == "64K"
    assert os.environ["UCX_TCP_RX_SEG_SIZE"] == os.environ["UCX_TCP_TX_SEG_SIZE"] == "64K"
    assert os.environ["UCXPY_PROGRESS_MODE"] == "blocking"


class FakeRequest:
    def __init__(self, error: str | None = None) -> None:
        self.completed = False
        self.error = error

    def check_error(self) -> None:
        if self.error:
            raise ConnectionResetError(self.error)


class FakeWorker:
    """A worker whose ``progress()`` completes what the test queued for it and whose ``arm()``
    answers BUSY (False) as many times as the test says; its fd is one end of a socket pair."""

    def __init__(self) -> None:
        self._r, self._w = socket.socketpair()
        self.epoll_file_descriptor = self._r.fileno()
        self.due: list[FakeRequest] = []
        self.busy = 0
        self.progressed = self.armed = 0
        self.lock = threading.Lock()

    def progress(self) -> None:
        with self.lock:
            self.progressed += 1
            for r in self.due:
                r.completed = True
            self.due.clear()

    def arm(self) -> bool:
        with self.lock:
            if self.busy:
                self.busy -= 1
                return False
            self.armed += 1
            with contextlib.suppress(BlockingIOError):  # arming consumes the wake-up, as
                self._r.recv(64, socket.MSG_DONTWAIT)  # ucp_worker_arm drains its eventfd
            return True

    def event(self, *done: FakeRequest) -> None:
        """Complete ``done`` at the next progress and make the fd readable (an event)."""
        with self.lock:
            self.due.extend(done)
        self._w.send(b"x")

    def close(self) -> None:
        self._r.close()
        self._w.close()


@pytest.fixture
def worker(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeWorker]:
    monkeypatch.setattr(Progress, "TICK_S", 3600.0)  # no tick: only events and posting progress
    w = FakeWorker()
    yield w
    w.close()
    assert not Progress._all, "every Progress was closed"


def test_a_wait_ends_when_an_event_completes_its_requests_and_the_loop_then_stops_watching(worker: FakeWorker) -> None:
    async def main() -> None:
        p = Progress(asyncio.get_running_loop(), worker)
        assert not p.watching  # nothing waits: an idle loop does not wake at the worker's events
        reqs = [FakeRequest(), FakeRequest()]
        fut = p.wait(reqs)
        assert p.watching and not fut.done() and worker.progressed == 1  # progressed once at posting
        asyncio.get_running_loop().call_later(0.01, worker.event, *reqs)
        await asyncio.wait_for(fut, 30)
        assert not p.watching and worker.armed >= 2  # re-armed after every progress
        p.close()

    asyncio.run(main())


def test_a_busy_arm_means_progress_again_before_sleeping(worker: FakeWorker) -> None:
    async def main() -> None:
        p = Progress(asyncio.get_running_loop(), worker)
        r = FakeRequest()
        worker.busy = 2
        worker.due.append(r)  # completes at the first progress
        await asyncio.wait_for(p.wait([r]), 30)
        assert worker.progressed == 3 and worker.armed == 1
        p.close()

    asyncio.run(main())


def test_an_error_fails_the_wait_once_all_its_requests_ended_and_a_cancelled_wait_is_dropped(worker: FakeWorker) -> None:
    async def main() -> None:
        p = Progress(asyncio.get_running_loop(), worker)
        ok, bad = FakeRequest(), FakeRequest("peer went away")
        fut = p.wait([ok, bad])
        worker.event(bad)  # the second completes first: not done until both are
        await asyncio.sleep(0.01)
        assert not fut.done()
        worker.event(ok)
        with pytest.raises(ConnectionResetError, match="peer went away"):
            await asyncio.wait_for(fut, 30)
        gone = p.wait([FakeRequest()])
        gone.cancel()  # a caller's timeout: the wait leaves, the loop stops watching for it
        worker.event()
        await asyncio.sleep(0.01)
        assert not p.watching
        held = p.wait([FakeRequest()])
        p.close()  # a loop that stops fails what still waits on it
        with pytest.raises(ConnectionError, match="stopped"):
            await held

    asyncio.run(main())


def test_a_hold_watches_without_a_wait(worker: FakeWorker) -> None:
    async def main() -> None:
        p = Progress(asyncio.get_running_loop(), worker)
        with p.held():
            assert p.watching
            before = worker.progressed
            worker.event()
            for _ in range(100):
                if worker.progressed > before:
                    break
                await asyncio.sleep(0.01)
            assert worker.progressed > before  # an event progresses the worker while held
        assert not p.watching
        p.close()

    asyncio.run(main())


def test_a_request_completed_by_another_loops_progress_ends_this_loops_wait(worker: FakeWorker) -> None:
    """Two loops, one worker: loop A's progress completes loop B's request, with no event on
    the fd for B to wake at; B must learn of it from A."""
    loops = [asyncio.new_event_loop() for _ in range(2)]
    threads = [threading.Thread(target=lp.run_forever, daemon=True) for lp in loops]
    for t in threads:
        t.start()

    def on(lp: asyncio.AbstractEventLoop, fn: Callable[[], Any]) -> Any:
        async def call() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(call(), lp).result(30)

    try:
        a, b = (on(lp, lambda: Progress(asyncio.get_running_loop(), worker)) for lp in loops)
        r = FakeRequest()
        fut = on(b.loop, lambda: b.wait([r]))
        assert b.watching and not fut.done()
        worker.due.append(r)
        on(a.loop, a._progress)  # A progresses (its own event, say): r completes there
        assert r.completed

        async def result() -> None:
            await asyncio.wait_for(fut, 30)

        asyncio.run_coroutine_threadsafe(result(), b.loop).result(30)
        on(a.loop, a.close)
        on(b.loop, b.close)
    finally:
        for lp in loops:
            lp.call_soon_threadsafe(lp.stop)
        for t in threads:
            t.join(30)
        for lp in loops:
            lp.close()


def test_ucxx_keeps_its_own_waiting_in_another_progress_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UCXPY_PROGRESS_MODE", "thread")

    async def main() -> Progress | None:
        return Progress.of_running_loop()

    assert asyncio.run(main()) is None
