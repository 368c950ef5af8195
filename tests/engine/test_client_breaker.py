"""The cache never breaks the engine: with the store down or slow, loads answer "no hit" at once
and stores are dropped and counted, without a call while the breaker is open; reconnection runs
in the background and hits resume by themselves. Last, a real daemon is killed and restarted
under a reference-engine loop."""

from __future__ import annotations

import socket
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from engine.client import EngineCache  # noqa: E402
from engine.kvlayout import KVShape, shape_of  # noqa: E402
from engine.reference.hf import CachedLM  # noqa: E402
from kvstore.client import connect  # noqa: E402
from kvstore.client.spawn import start_daemon  # noqa: E402
from kvstore.config import StoreConfig, TierSpec  # noqa: E402
from kvstore.errors import AuthError, DaemonUnavailableError  # noqa: E402
from kvstore.store import KVStore  # noqa: E402
from tests.engine.reference.test_hf import llama  # noqa: E402

SHAPE = KVShape(num_layers=2, kv_heads=2, head_dim=8, block_tokens=4, dtype=torch.float32)
DATA_CALLS = ("acquire", "get_into", "put", "lookup")


class Flaky:
    """A store proxy that counts every call and can be made unreachable or slow."""

    def __init__(self, store: Any, url: str | None = None) -> None:
        self._store = store
        self.calls: Counter[str] = Counter()
        self.down = False
        self.hold: threading.Event | None = None  # set: calls wait for it (a hung daemon)
        if url is not None:
            self.url = url

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._store, name)
        if not callable(fn):
            return fn

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            if self.hold is not None:
                self.hold.wait(30)
            if self.down:
                raise DaemonUnavailableError("kvstore daemon at test:// is unreachable")
            return fn(*args, **kwargs)

        return call

    def data_calls(self) -> int:
        return sum(self.calls[c] for c in DATA_CALLS)


@pytest.fixture
def store(tmp_path: Path):
    bb = SHAPE.block_bytes
    s = KVStore(StoreConfig(root=tmp_path, tiers=(TierSpec("dram", "dram", {"capacity_bytes": 64 * bb, "slab_bytes": 8 * bb}),)))
    yield s
    s.close()


def _blocks(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, SHAPE.block_bytes), dtype=torch.uint8, generator=g)


def _load_n(cache: EngineCache, hashes: list[bytes], n: int) -> int:
    got = cache.load(hashes, n)
    try:
        return got.num_blocks
    finally:
        got.release()


def test_down_store_answers_no_hit_without_calls_and_comes_back(store: KVStore) -> None:
    flaky = Flaky(store)
    cache = EngineCache(flaky, SHAPE.namespace("test/breaker"), SHAPE, background=False)
    hashes = cache.hashes(torch.arange(16))
    assert cache.store_async(hashes, _blocks(4), 0) is not None
    cache.flush()
    assert _load_n(cache, hashes, 4) == 4

    flaky.down = True
    assert _load_n(cache, hashes, 4) == 0  # this call finds it down and opens the breaker
    assert not cache.available and cache.breaker.opened == 1
    before = flaky.data_calls()
    for i in range(10):
        assert _load_n(cache, hashes, 4) == 0
        assert cache.store_async(hashes, _blocks(4, i), 0) is None
    cache.flush()
    assert flaky.data_calls() == before  # open: not one call reached the store
    assert cache.counters.lookups_skipped == 10 and cache.counters.stores_skipped == 10
    assert cache.counters.load_errors == 1

    assert not cache.breaker.probe_now()  # still down: stays open
    flaky.down = False
    assert cache.breaker.probe_now() and cache.available
    assert _load_n(cache, hashes, 4) == 4
    cache.close()


def _wait_for(cond: Any, what: str, limit_s: float = 30.0) -> None:
    """Wait (bounded) for the reconnect thread, which runs on real time."""
    end = time.monotonic() + limit_s
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"{what} did not happen within {limit_s} s")
        time.sleep(0.005)


def test_background_prober_closes_it_again_and_again(store: KVStore) -> None:
    flaky = Flaky(store)
    cache = EngineCache(flaky, SHAPE.namespace("test/breaker"), SHAPE, backoff_s=0.001, max_backoff_s=0.01)
    hashes = cache.hashes(torch.arange(16))
    cache.store_async(hashes, _blocks(4), 0)
    cache.flush()
    for outage in (1, 2, 3):  # each outage gets a prober of its own
        flaky.down = True
        assert _load_n(cache, hashes, 4) == 0 and cache.breaker.opened == outage
        flaky.down = False
        _wait_for(lambda: cache.available, f"recovery from outage {outage}")
        assert _load_n(cache, hashes, 4) == 4
    cache.close()


def test_store_that_fails_in_the_background_opens_the_breaker(store: KVStore) -> None:
    flaky = Flaky(store)
    cache = EngineCache(flaky, SHAPE.namespace("test/breaker"), SHAPE, background=False)
    hashes = cache.hashes(torch.arange(16))
    flaky.down = True
    fut = cache.store_async(hashes, _blocks(4), 0)
    assert fut is not None and fut.result() == 0
    assert cache.counters.store_errors == 1 and not cache.available
    cache.close()


def test_refusals_are_misses_not_outages(store: KVStore) -> None:
    cache = EngineCache(store, SHAPE.namespace("test/breaker"), SHAPE, background=False)
    hashes = cache.hashes(torch.arange(16))
    fut = cache.store_async(hashes, _blocks(2), 2)  # blocks 0-1 are not cached: a refusal
    assert fut is not None and fut.result() == 0
    assert cache.counters.store_errors == 1 and cache.available
    cache.close()


def test_slow_store_is_given_up_and_a_late_lease_given_back(store: KVStore) -> None:
    flaky = Flaky(store)
    cache = EngineCache(flaky, SHAPE.namespace("test/breaker"), SHAPE, timeout_s=0.05, background=False)
    hashes = cache.hashes(torch.arange(16))
    cache.store_async(hashes, _blocks(4), 0)
    cache.flush()
    flaky.hold = threading.Event()  # the store hangs
    assert _load_n(cache, hashes, 4) == 0
    assert not cache.available and "took longer than 0.05" in cache.breaker.last_error
    flaky.hold.set()  # the hung call finishes: its lease must not leak
    assert cache._io is not None
    cache._io.submit(lambda: None).result()
    assert flaky.calls["acquire"] == 1 and flaky.calls["release"] == 1
    flaky.hold = None
    cache._timeout = 60.0  # a healthy load on a loaded machine may take longer than 0.05 s
    assert cache.breaker.probe_now()
    assert _load_n(cache, hashes, 4) == 4
    cache.close()


def test_engine_may_start_before_its_store(store: KVStore) -> None:
    attempts = []

    def connect_() -> Any:
        attempts.append(1)
        if len(attempts) == 1:
            raise DaemonUnavailableError("not up yet")
        return store

    cache = EngineCache(None, SHAPE.namespace("test/breaker"), SHAPE, connect=connect_, background=False)
    hashes = cache.hashes(torch.arange(16))
    assert _load_n(cache, hashes, 4) == 0 and cache.store_async(hashes, _blocks(4), 0) is None
    assert not cache.breaker.probe_now() and cache.breaker.probe_now()
    cache.store_async(hashes, _blocks(4), 0)
    cache.flush()
    assert _load_n(cache, hashes, 4) == 4
    cache.close()


def test_a_deployment_mistake_is_still_raised_at_start(store: KVStore) -> None:
    class BadToken(Flaky):
        def register_namespace(self, *args: Any) -> None:
            raise AuthError("daemon: HTTP 401: unknown token")

    with pytest.raises(AuthError):  # not an outage: said once, at start, not hidden as misses
        EngineCache(BadToken(store), SHAPE.namespace("test/breaker"), SHAPE, background=False)


# ---- a real daemon killed and restarted under the reference engine -------------------------------


def _until_hit(engine: CachedLM, prompt: torch.Tensor, want: int, deadline_s: float = 60.0) -> int:
    """Prefill ``prompt`` until it hits ``want`` tokens; returns the prefills it took (bounded:
    reconnection runs on real processes)."""
    assert engine.cache is not None
    end = time.monotonic() + deadline_s
    n = 0
    while time.monotonic() < end:
        n += 1
        if engine.prefill(prompt).hit_tokens == want:
            return n
        engine.cache.flush()
        engine.cache.breaker._wake.wait(0.05)  # let the reconnect thread run between prefills
    raise AssertionError(f"no hit of {want} tokens within {deadline_s} s: {engine.cache.breaker.last_error}")


def test_daemon_killed_and_restarted_under_an_engine_loop(tmp_path: Path) -> None:
    """The extra latency while the daemon is down: ``python -m tools.bench outage``."""
    model = llama()
    shape = shape_of(model.config, torch.float32, 16)
    ns = shape.namespace("test/outage")
    prompt = torch.randint(0, 256, (70,), generator=torch.Generator().manual_seed(3))
    d = start_daemon(tmp_path / "store")
    ports = ["--http-port", str(d.info["http_port"]), "--data-port", str(d.info["data_port"])]
    client = connect(d.url, timeout=5.0)
    flaky = Flaky(client, d.url)
    # A long timeout: a slow healthy load on a loaded machine must not count as an outage, and a
    # dead daemon is found by its refused connection, not by a timeout.
    cache = EngineCache(flaky, ns, shape, timeout_s=60.0, backoff_s=0.05, max_backoff_s=0.5)
    engine = CachedLM(model, cache)
    try:
        _until_hit(engine, prompt, 64)
        cache.flush()
        d.kill()  # SIGKILL: what the DRAM tier held is gone with it
        assert engine.prefill(prompt).hit_tokens == 0  # finds it down: its connection is refused
        assert not cache.available
        calls = flaky.data_calls()
        for _ in range(20):
            assert engine.prefill(prompt).hit_tokens == 0
        assert flaky.data_calls() == calls  # open: every load and store skipped the network
        assert cache.counters.lookups_skipped >= 20 and cache.counters.stores_skipped >= 20

        d = start_daemon(tmp_path / "store", args=ports)  # same ports: the client's URL
        _until_hit(engine, prompt, 64)  # reconnects, stores again, then hits: by itself
        assert cache.breaker.opened == 1 and cache.breaker.probes >= 1
    finally:
        cache.close()
        client.close()
        d.stop()


def test_a_dead_daemon_costs_one_refused_connect_and_no_retries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The call that first meets a SIGKILLed daemon makes one connection attempt, which is
    refused, and opens the breaker (the client's retries and their back-off are for dropped
    connections, not for a daemon that is not there); while it is open no call connects; each
    probe is one attempt. The latency this buys: ``python -m tools.bench outage``
    (``first_call_after_kill``)."""
    model = llama()
    shape = shape_of(model.config, torch.float32, 16)
    prompt = torch.randint(0, 256, (70,), generator=torch.Generator().manual_seed(5))
    d = start_daemon(tmp_path / "store")
    ports = ["--http-port", str(d.info["http_port"]), "--data-port", str(d.info["data_port"])]
    client = connect(d.url)  # the default retries: a refusal must not use them
    flaky = Flaky(client, d.url)
    cache = EngineCache(flaky, shape.namespace("test/refused"), shape, timeout_s=60.0, background=False)
    engine = CachedLM(model, cache)
    connects: list[tuple[str, int]] = []
    real = socket.create_connection

    def counting(address: tuple[str, int], *args: Any, **kwargs: Any) -> socket.socket:
        connects.append(address)
        return real(address, *args, **kwargs)

    try:
        engine.prefill(prompt)
        cache.flush()
        assert engine.prefill(prompt).hit_tokens == 64
        d.kill()
        monkeypatch.setattr(socket, "create_connection", counting)
        assert engine.prefill(prompt).hit_tokens == 0  # no raise: a miss
        assert not cache.available and cache.breaker.opened == 1
        assert connects == [("127.0.0.1", d.info["http_port"])]  # one attempt, refused
        assert "refused" in cache.breaker.last_error
        calls = flaky.data_calls()
        for _ in range(10):
            assert engine.prefill(prompt).hit_tokens == 0
        assert len(connects) == 1 and flaky.data_calls() == calls  # open: no socket touched
        assert not cache.breaker.probe_now() and len(connects) == 2  # a probe: one attempt

        d = start_daemon(tmp_path / "store", args=ports)
        assert cache.breaker.probe_now() and cache.available
        engine.prefill(prompt)  # the restarted daemon lost its DRAM copy: stored again
        cache.flush()
        assert engine.prefill(prompt).hit_tokens == 64
        assert cache.counters.load_errors == 1 and cache.breaker.opened == 1
    finally:
        monkeypatch.undo()
        cache.close()
        client.close()
        d.stop()
