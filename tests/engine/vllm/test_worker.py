"""The connector's worker side against a real daemon, driven as vLLM drives it (bind the step's
metadata, ``start_load_kv``, ``wait_for_layer_load`` per attention layer, ``wait_for_save``) on
CPU page tensors, outside vLLM's processes so each property is checked on its own:

- a layer-wise load lets layer i run as soon as layer i is written (the loader is held before
  layer 1: layer 0's wait returns, its pages hold the blocks, layer 1's are untouched);
- the forward pass never waits for the daemon: with the daemon frozen (SIGSTOP), a step's
  saves are handed to the saver thread and ``wait_for_save`` returns, and a load fails after
  its timeout and is reported (``take_errors``, vLLM's ``get_block_ids_with_load_errors``)
  instead of raising; once the daemon runs again, the save lands and loads succeed.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engine.vllm.config import ConnectorConfig
from engine.vllm.harness import small_daemon
from engine.vllm.pages import PagedKV, PageSpec
from engine.vllm.worker import LoadSpec, ReqInfo, SaveSpec, Worker
from engine.vllm.worker import StepPlan as KVStoreMetadata
from kvstore.client.spawn import LocalDaemon
from tests.kvstore.conftest import eventually

BT = 32
SPEC = PageSpec(("model.layers.0.attn", "model.layers.1.attn", "model.layers.2.attn"), BT, 2, 64, torch.float32, "LBHNC")
VLLM_CONFIG = SimpleNamespace(model_config=SimpleNamespace(model="org/tiny", revision="main", quantization=None))
A = np.arange(3, 3 + 4 * BT, dtype=np.int32)  # a request of 4 full blocks
B = np.arange(1000, 1000 + 2 * BT, dtype=np.int32)
# Generous timeouts where the daemon is healthy: a loaded 2-core box can take seconds to answer.
ROBUST = {"lookup_timeout_s": 60.0, "load_timeout_s": 60.0, "save_timeout_s": 60.0}


class GatedKV(PagedKV):
    """vLLM's pages; the loader waits at layer ``gate_layer`` and after until ``gate`` is set."""

    def __init__(self, spec: PageSpec, caches: dict[str, torch.Tensor], gate_layer: int) -> None:
        super().__init__(spec, caches)
        self.gate = threading.Event()
        self.gate_layer = gate_layer

    def scatter_layer(self, layer: int, block_ids: torch.Tensor, src: torch.Tensor) -> None:
        if layer >= self.gate_layer and not self.gate.wait(300):
            raise AssertionError("the test never let the loader past its gate")
        super().scatter_layer(layer, block_ids, src)


def _caches(seed: int | None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed or 0)
    shape = (10, SPEC.num_kv_heads, BT, SPEC.content)
    return {n: torch.randn(shape, generator=g) if seed is not None else torch.zeros(shape) for n in SPEC.layer_names}


def _worker(url: str, fenced: bool = False, **extra: float | str) -> Worker:
    return Worker(VLLM_CONFIG, ConnectorConfig(url=url, **{**ROBUST, **extra}), SPEC, tp=(0, 1),  # type: ignore[arg-type]
                  fenced=fenced)


def _step(w: Worker, meta: KVStoreMetadata) -> None:
    w.bind(meta)
    w.start_load_kv()
    for name in SPEC.layer_names:
        w.wait_for_layer_load(name)
    w.wait_for_save()


@pytest.fixture
def stored(tmp_path: Path) -> Iterator[tuple[LocalDaemon, dict[str, torch.Tensor]]]:
    """A daemon holding request A's 4 blocks, saved from pages 1-4 of ``src``."""
    with small_daemon(tmp_path, dram="32MiB") as d:
        src = _caches(seed=1)
        saver = _worker(d.url)
        saver.register_kv_caches(src)
        _step(saver, KVStoreMetadata(infos={"a": ReqInfo(A, "", b"")}, saves=[SaveSpec("a", 0, [1, 2, 3, 4])]))
        saver.flush()
        assert saver.counters.saved_blocks == 4 and saver.counters.saves_dropped == 0
        saver.close()
        yield d, src


def test_each_layer_waits_for_its_own_layer_only(stored: tuple[LocalDaemon, dict[str, torch.Tensor]]) -> None:
    d, src = stored
    dst = _caches(seed=None)
    w = _worker(d.url)
    w.register_kv_caches(dst)
    kv = w.kv = GatedKV(SPEC, dst, gate_layer=1)
    l0, l1, l2 = SPEC.layer_names
    w.bind(KVStoreMetadata(infos={"a": ReqInfo(A, "", b"")}, loads=[LoadSpec("a", 0, [5, 6, 7, 8], False)]))
    w.start_load_kv()
    w.wait_for_layer_load(l0)  # returns with the loader held before layer 1
    assert torch.equal(dst[l0][5:9], src[l0][1:5])
    assert not dst[l1].any() and not dst[l2].any()
    kv.gate.set()
    w.wait_for_layer_load(l1)
    w.wait_for_layer_load(l2)
    w.wait_for_save()
    for name in SPEC.layer_names:
        assert torch.equal(dst[name][5:9], src[name][1:5])
        assert not dst[name][:5].any() and not dst[name][9:].any()  # no other page written
    assert w.take_errors() == set() and w.counters.loaded_blocks == 4
    w.close()


def test_a_frozen_daemon_never_blocks_the_step(stored: tuple[LocalDaemon, dict[str, torch.Tensor]]) -> None:
    d, src = stored
    dst = _caches(seed=None)
    w = _worker(d.url, load_timeout_s=1.0, backoff_s=0.2, max_backoff_s=0.5)
    w.register_kv_caches(dst)
    load_a = KVStoreMetadata(infos={"a": ReqInfo(A, "", b"")}, loads=[LoadSpec("a", 0, [5, 6, 7, 8], False)])
    os.kill(d.proc.pid, signal.SIGSTOP)
    try:
        # The saver thread takes the put (it hangs on the frozen daemon); the step goes on.
        dst_b = {n: t.clone() for n, t in _caches(seed=2).items()}
        w.kv = PagedKV(SPEC, dst_b)
        _step(w, KVStoreMetadata(infos={"b": ReqInfo(B, "", b"")}, saves=[SaveSpec("b", 0, [1, 2])]))
        assert w.counters.saves_submitted == 1 and w.counters.saved_blocks == w.counters.saves_dropped == 0
        # A load from the frozen daemon times out (1 s) and is reported, not raised: vLLM
        # recomputes these pages.
        w.kv = PagedKV(SPEC, dst)
        _step(w, load_a)
        assert w.take_errors() == {5, 6, 7, 8} and w.counters.failed_blocks == 4
    finally:
        os.kill(d.proc.pid, signal.SIGCONT)
    w.flush()  # the put that waited on the frozen daemon has now run
    assert w.counters.saved_blocks == 2
    for _ in range(100):  # the breaker reconnects (a probe per call here; its thread also does)
        if w.load_link.probe():
            break
    _step(w, load_a)
    assert w.take_errors() == set()
    for name in SPEC.layer_names:
        assert torch.equal(dst[name][5:9], src[name][1:5])
    w.close()


class OomKV(PagedKV):
    """vLLM's pages whose gather runs out of memory ``fails`` times (a save's staging that does
    not fit), then works."""

    def __init__(self, spec: PageSpec, caches: dict[str, torch.Tensor], fails: int) -> None:
        super().__init__(spec, caches)
        self.fails = fails

    def gather(self, block_ids: Sequence[int], out: torch.Tensor) -> None:
        if self.fails > 0:
            self.fails -= 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 128.00 MiB")
        super().gather(block_ids, out)


@pytest.mark.parametrize("fenced", [False, True])
def test_a_save_that_runs_out_of_memory_is_dropped_not_raised(tmp_path: Path, fenced: bool) -> None:
    """An out-of-memory error while a save gathers its pages reaches vLLM's step as a dropped save,
    never as an exception, and gives its save slot back: more failures than there are slots, then
    a save that fits lands. ``fenced``: the gather runs on the saver thread (the CPU build under a
    vLLM that calls ``handle_preemptions``), and the drop is counted there."""
    with small_daemon(tmp_path, dram="32MiB") as d:
        w = _worker(d.url, fenced=fenced)
        src = _caches(seed=3)
        w.register_kv_caches(src)
        fails = w.cfg.max_pending_saves + 1
        w.kv = OomKV(SPEC, src, fails=fails)
        for _ in range(fails):
            _step(w, KVStoreMetadata(infos={"a": ReqInfo(A, "", b"")}, saves=[SaveSpec("a", 0, [1, 2, 3, 4])]))
            w.handle_preemptions()
            w.flush()
        assert w.counters.saves_dropped == fails and w.counters.saved_blocks == 0
        assert w.counters.saves_submitted == (fails if fenced else 0)
        _step(w, KVStoreMetadata(infos={"a": ReqInfo(A, "", b"")}, saves=[SaveSpec("a", 0, [1, 2, 3, 4])]))
        w.flush()
        assert w.counters.saved_blocks == 4
        w.close()


class WhereKV(PagedKV):
    """vLLM's pages; records which thread gathered each save."""

    def __init__(self, spec: PageSpec, caches: dict[str, torch.Tensor]) -> None:
        super().__init__(spec, caches)
        self.gathered_on: list[str] = []

    def gather(self, block_ids: Sequence[int], out: torch.Tensor) -> None:
        self.gathered_on.append(threading.current_thread().name)
        super().gather(block_ids, out)


def test_a_fenced_cpu_save_gathers_off_the_step_and_before_the_next_step_writes(tmp_path: Path) -> None:
    """Where vLLM calls ``handle_preemptions`` before it writes pages, ``wait_for_save`` on the
    CPU gathers nothing: the saver thread gathers, or the next ``handle_preemptions`` does if the
    saver has not begun (here it waits on a frozen daemon with an earlier save). What is stored is
    the pages as the step left them, though the next step then overwrites them all."""
    with small_daemon(tmp_path, dram="32MiB") as d:
        src = _caches(seed=4)
        kept = {n: t.clone() for n, t in src.items()}
        w = _worker(d.url, fenced=True)
        w.register_kv_caches(src)
        kv = w.kv = WhereKV(SPEC, src)
        os.kill(d.proc.pid, signal.SIGSTOP)
        try:
            _step(w, KVStoreMetadata(infos={"b": ReqInfo(B, "", b"")}, saves=[SaveSpec("b", 0, [5, 6])]))
            assert eventually(lambda: kv.gathered_on == ["kvstore-save"])  # its put now waits on the daemon
            _step(w, KVStoreMetadata(infos={"a": ReqInfo(A, "", b"")}, saves=[SaveSpec("a", 0, [1, 2, 3, 4])]))
            assert kv.gathered_on == ["kvstore-save"]  # the step returned with a's pages not gathered
            w.handle_preemptions()  # the next step: the saver is still on b, so a is gathered here
            assert kv.gathered_on == ["kvstore-save", threading.current_thread().name]
            for t in src.values():  # the next step writes every page
                t.normal_()
        finally:
            os.kill(d.proc.pid, signal.SIGCONT)
        w.flush()
        assert w.counters.saved_blocks == 6 and w.counters.saves_dropped == 0
        w.close()
        dst = _caches(seed=None)
        r = _worker(d.url)
        r.register_kv_caches(dst)
        _step(r, KVStoreMetadata(infos={"a": ReqInfo(A, "", b""), "b": ReqInfo(B, "", b"")},
                                 loads=[LoadSpec("a", 0, [1, 2, 3, 4], False), LoadSpec("b", 0, [7, 8], False)]))
        assert r.take_errors() == set()
        for name in SPEC.layer_names:
            assert torch.equal(dst[name][1:5], kept[name][1:5])
            assert torch.equal(dst[name][7:9], kept[name][5:7])
        r.close()


@pytest.mark.parametrize("mode", ["async", "layerwise"])
def test_a_remote_plane_loads_two_requests_of_one_step(stored: tuple[LocalDaemon, dict[str, torch.Tensor]],
                                                       mode: str) -> None:
    """Over TCP (a daemon on another node) the blocks land in the worker's host buffer and take
    the same load path; two requests of one step are one load, each into its own pages, and a
    request whose blocks are not all cached reports the missing pages for recompute."""
    d, src = stored
    dst = _caches(seed=None)
    w = _worker(d.url, plane="tcp", load_mode=mode)  # type: ignore[arg-type]
    w.register_kv_caches(dst)
    assert w.load_link.client is not None and w.load_link.client.plane == "tcp"
    infos = {"a": ReqInfo(A, "", b""), "b": ReqInfo(A[: 2 * BT], "", b""), "c": ReqInfo(B, "", b"")}
    is_async = mode == "async"
    loads = [LoadSpec("a", 2, [7, 8], is_async), LoadSpec("b", 0, [0, 9], is_async), LoadSpec("c", 0, [5, 6], is_async)]
    _step(w, KVStoreMetadata(infos=infos, loads=loads))
    for _ in range(2000):
        if not is_async or w.get_finished() >= {"a", "b", "c"}:
            break
        threading.Event().wait(0.01)
    for name in SPEC.layer_names:
        assert torch.equal(dst[name][[7, 8]], src[name][[3, 4]])
        assert torch.equal(dst[name][[0, 9]], src[name][[1, 2]])
        assert not dst[name][[5, 6]].any()
    if not is_async:
        w.wait_for_save()
    assert w.take_errors() == {5, 6} and w.counters.loaded_blocks == 4
    w.close()


@pytest.mark.parametrize("head_blocks", [0, 1])
def test_an_async_load_takes_its_lease_in_growing_chunks(stored: tuple[LocalDaemon, dict[str, torch.Tensor]],
                                                        head_blocks: int) -> None:
    """Over shared memory an async load leases ``lease_head_bytes`` first, then chunks four
    times larger, all asked for at once and each loaded as its lease comes back (0: one lease a
    request); every page lands, a request whose blocks are not cached reports its pages for
    recompute, and the leases asked past a short one are given back."""
    d, src = stored
    dst = _caches(seed=None)
    w = _worker(d.url, lease_head_bytes=head_blocks * SPEC.block_bytes)
    w.register_kv_caches(dst)
    client = w.load_link.client
    assert client is not None and client.plane == "shm"
    leases: list[list[int]] = []
    fetch, each = w._fetch, client.acquire_each

    def counted(ns: object, hashes: list[bytes], held: list[object]) -> tuple[int, object]:
        leases.append([len(hashes)])
        return fetch(ns, hashes, held)  # type: ignore[arg-type]

    def counted_each(ns: object, chunks: Iterable[list[bytes]]) -> object:
        asked = list(chunks)  # (a lazy iterable: the head is hashed first)
        leases.append([len(c) for c in asked])
        return each(ns, asked)  # type: ignore[arg-type]

    w._fetch = counted  # type: ignore[method-assign]
    client.acquire_each = counted_each  # type: ignore[method-assign,assignment]
    infos = {"a": ReqInfo(A, "", b""), "b": ReqInfo(A[: 2 * BT], "", b""), "c": ReqInfo(B, "", b"")}
    loads = [LoadSpec("a", 0, [5, 6, 7, 8], True), LoadSpec("b", 0, [0, 9], True), LoadSpec("c", 0, [1, 2], True)]
    _step(w, KVStoreMetadata(infos=infos, loads=loads))
    for _ in range(2000):
        if w.get_finished() >= {"a", "b", "c"}:
            break
        threading.Event().wait(0.01)
    for name in SPEC.layer_names:
        assert torch.equal(dst[name][5:9], src[name][1:5])
        assert torch.equal(dst[name][[0, 9]], src[name][[1, 2]])
        assert not dst[name][[1, 2]].any()
    assert w.take_errors() == {1, 2} and w.counters.loaded_blocks == 6
    # a: 1 block, then the 3 left (a chunk of 4); b: 1 and 1; c: 1 and 1 asked, none cached
    assert leases == ([[1, 3], [1, 1], [1, 1]] if head_blocks else [[4], [2], [2]])

    def leased() -> int:
        client._settle()  # noqa: SLF001 - the daemon has read the releases sent so far
        return int(client.stats()["usage"]["leased_bytes"])

    assert eventually(lambda: leased() == 0)  # (the loader gives them back after the copies)
    w.close()


def test_a_load_hashes_its_blocks_on_the_loader_thread_head_first(stored: tuple[LocalDaemon, dict[str, torch.Tensor]],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's step does not hash a load's blocks (start_load_kv returns at once); the loader
    hashes the head, sends its lease, then hashes the rest on from it: the same chain, kept for
    the request's saves."""
    from engine.vllm import worker as worker_module
    from engine.vllm.link import chain_namespace

    d, src = stored
    w = _worker(d.url, lease_head_bytes=SPEC.block_bytes)
    w.register_kv_caches(_caches(seed=None))
    real = worker_module.hash_blocks
    calls: list[tuple[str, int, bool]] = []

    def hashed(ns: object, tokens: np.ndarray, extra: object = None, *, parent: bytes | None = None) -> list[bytes]:
        calls.append((threading.current_thread().name, len(tokens) // BT, parent is not None))
        return real(ns, tokens, extra, parent=parent)  # type: ignore[arg-type]

    monkeypatch.setattr(worker_module, "hash_blocks", hashed)
    _step(w, KVStoreMetadata(infos={"a": ReqInfo(A, "", b"")}, loads=[LoadSpec("a", 1, [5, 6, 7], True)]))
    assert all(name != threading.main_thread().name for name, _, _ in calls)
    assert eventually(lambda: "a" in w.get_finished())
    # the head (the block before the load and its first) first, then the rest from its last hash
    assert [(n, p) for _, n, p in calls] == [(2, False), (2, True)]
    assert w.chains["a"] == real(chain_namespace(w.ns_for("")), A)
    assert w.counters.loaded_blocks == 3 and not w.take_errors()
    w.close()


class _FakeEvent:
    def __init__(self) -> None:
        self.synced = 0

    def ipc_handle(self) -> bytes:
        return b"e" * 64

    def synchronize(self) -> None:
        self.synced += 1


class _FakeDeviceClient:
    """A same-node client whose daemon takes PUT_DEVICE; ``refuse_events``: it cannot wait for one."""

    def __init__(self, refuse_events: bool) -> None:
        self.info = {"put_device": True, "put_device_event": True}
        self.refuse_events = refuse_events
        self.calls: list[bytes | None] = []

    def put_device(self, ns: object, chain: list[bytes], *, after: bytes | None = None, **kw: object) -> int:
        from kvstore.errors import UsageError

        self.calls.append(after)
        if after is not None and self.refuse_events:
            raise UsageError("PUT_DEVICE failed, nothing stored: cudaIpcOpenEventHandle failed")
        return len(chain)


@pytest.mark.parametrize("refuse_events", [False, True])
def test_a_device_save_goes_out_with_its_gathers_event_or_after_it(tmp_path: Path, refuse_events: bool) -> None:
    """With a daemon that waits for CUDA events the save is sent at once with the gather's event
    (no host wait); a daemon that refuses the event gets the same save after a host wait, and
    no event from then on."""
    from engine.transfer import StagedSave

    w = _worker("http://127.0.0.1:9")
    c = _FakeDeviceClient(refuse_events)
    for _ in range(2):
        ev = _FakeEvent()
        staged = StagedSave(torch.zeros((2, 8), dtype=torch.uint8), ev)
        assert w._put_device(c, SPEC, [b"a", b"b"], 0, staged, 0, bytes(64), 0, 16) == 2  # type: ignore[arg-type]
        assert ev.synced == (1 if refuse_events else 0)
    assert c.calls == ([b"e" * 64, None, None] if refuse_events else [b"e" * 64, b"e" * 64])
    w.close()


@pytest.mark.parametrize(("mode", "head_blocks"), [("async", 1), ("async", 0), ("layerwise", 0)])
def test_a_load_copies_from_the_schedulers_lease_without_an_acquire(
        stored: tuple[LocalDaemon, dict[str, torch.Tensor]], mode: str, head_blocks: int) -> None:
    """The scheduler's lookup leased the blocks (``Client.lookup_lease``): the worker copies
    from the lease's locations without an ACQUIRE of its own, every page lands, it reports the
    request once the copies have landed (``take_landed``), and the lease goes back then. A
    lease covering only the head of a load: the chunked load acquires the rest, a plain one
    acquires all of it. A lease on another arena (a restarted daemon) is not used."""
    from engine.vllm.leases import LeaseBook, PreLease
    from engine.vllm.link import chain_namespace
    from kvstore.client import connect
    from kvstore.keys import hash_blocks

    d, src = stored
    dst = _caches(seed=None)
    w = _worker(d.url, load_mode=mode, lease_head_bytes=head_blocks * SPEC.block_bytes)
    w.register_kv_caches(dst)
    client = w.load_link.client
    assert client is not None and client.plane == "shm"
    asked: list[int] = []
    fetch, each = w._fetch, client.acquire_each

    def counted(ns: object, hashes: list[bytes], held: list[object]) -> tuple[int, object]:
        asked.append(len(hashes))
        return fetch(ns, hashes, held)  # type: ignore[arg-type]

    def counted_each(ns: object, chunks: Iterable[list[bytes]]) -> object:
        got = list(chunks)
        asked.extend(len(c) for c in got)
        return each(ns, got)  # type: ignore[arg-type]

    w._fetch = counted  # type: ignore[method-assign]
    client.acquire_each = counted_each  # type: ignore[method-assign,assignment]
    ns = w.ns_for("")
    book = LeaseBook()
    is_async = mode == "async"

    def run(loads: list[LoadSpec]) -> None:
        _step(w, KVStoreMetadata(infos={"a": ReqInfo(A, "", b"")}, loads=loads))
        for _ in range(2000):
            if not is_async or w.get_finished() >= {ld.req_id for ld in loads}:
                break
            threading.Event().wait(0.01)

    with connect(d.url, plane="shm") as sched:
        sched.register_namespace(ns)
        r, lease = sched.lookup_lease(ns, hash_blocks(chain_namespace(ns), A))
        assert r.num_blocks == 4 and lease is not None and lease.num_blocks == 4
        book.take("a", lease)
        pre = book.lend("a", 1, 3)
        assert pre is not None and pre.locations == lease.locations[1:]
        run([LoadSpec("a", 1, [6, 7, 8], is_async, pre)])
        for name in SPEC.layer_names:
            assert torch.equal(dst[name][6:9], src[name][2:5])
        assert asked == [] and w.counters.preleased_blocks == 3 and w.take_errors() == set()
        assert w.take_landed() == {"a"} and w.take_landed() == set()
        assert sched.stats()["usage"]["leased_bytes"] > 0  # the scheduler's, until it lets go
        book.landed({"a"})
        assert eventually(lambda: int(sched.stats()["usage"]["leased_bytes"]) == 0)

        r, lease = sched.lookup_lease(ns, hash_blocks(chain_namespace(ns), A))
        assert lease is not None
        for name in SPEC.layer_names:
            dst[name].zero_()
        head = PreLease(lease.arena, lease.locations[:2])  # the head of the load only
        run([LoadSpec("a", 0, [5, 6, 7, 8], is_async, head)])
        for name in SPEC.layer_names:
            assert torch.equal(dst[name][5:9], src[name][1:5])
        chunked = is_async and head_blocks > 0
        assert asked == ([1, 1] if chunked else [4])  # the rest (1, then 4x: 1 left), or all of it
        assert w.counters.preleased_blocks == (5 if chunked else 3)
        asked.clear()
        other = PreLease("not-this-daemons-arena", lease.locations)
        run([LoadSpec("a", 0, [5, 6, 7, 8], is_async, other)])
        assert asked == ([1, 3] if chunked else [4]) and w.take_errors() == set()
        lease.release()
    w.close()
