"""Error kinds: the daemon's HTTP error bodies name the kvstore.errors class (``kind``) and the
client raises that class, so a 409 from a pin (RetentionError) and one from a registration
(LayoutMismatchError) are told apart; without a known kind the client falls back to the status."""

from __future__ import annotations

import errno
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from kvstore.client import Client, connect
from kvstore.clock import FakeClock
from kvstore.config import StoreConfig
from kvstore.errors import (
    KINDS,
    AuthError,
    BlockNotFound,
    BufferSizeError,
    ConfigError,
    DaemonUnavailableError,
    ForbiddenError,
    KVStoreError,
    LayoutMismatchError,
    QuotaExceededError,
    RetentionError,
    TierFullError,
    TierIOError,
    TierUnavailableError,
    UnknownNamespaceError,
    UsageError,
    error_class,
    error_kind,
)
from kvstore.registry import make_tier
from kvstore.server import daemon as daemon_module
from kvstore.server.config import TenantSpec
from kvstore.server.daemon import ThreadedDaemon
from kvstore.server.service import _ERRORS, Service, classify
from kvstore.store import KVStore
from tests.conftest import BB, SMALL_NS, chain_for, payload, small_tiers
from tests.kvstore.conftest import TENANTS, TOKEN_A, TOKEN_B, TOKEN_OPS
from tiers.faulty import FaultyTier

H = 3600.0
TIERS = small_tiers(dram_blocks=4, nvme_blocks=8, object_blocks=8)  # guarantees: 4 blocks at most


def _blocks(chain: list[bytes]) -> np.ndarray:
    return np.frombuffer(b"".join(payload(x) for x in chain), np.uint8)


@dataclass
class World:
    d: ThreadedDaemon
    clock: FakeClock
    nvme: FaultyTier
    a: Client
    b: Client
    ops: Client


@pytest.fixture
def world(start_daemon: Callable[..., ThreadedDaemon], monkeypatch: pytest.MonkeyPatch) -> Iterator[World]:
    """A daemon with tenants a, b and ops on a fake clock; its NVMe tier (the first persistent
    one, where a guarantee is written) can be made to fail."""
    faulty: list[FaultyTier] = []

    def store(cfg: StoreConfig, clock: Any) -> KVStore:
        built = [make_tier(s.kind, s.name, dict(s.options), cfg.root, clock) for s in cfg.tiers]
        built[1] = FaultyTier(built[1])
        faulty.append(built[1])
        return KVStore(cfg, clock=clock, tiers=built)

    monkeypatch.setattr(daemon_module, "KVStore", store)
    clock = FakeClock()
    d = start_daemon(TENANTS, tiers=TIERS, clock=clock)
    with connect(d.url, token=TOKEN_A) as a, connect(d.url, token=TOKEN_B) as b, \
            connect(d.url, token=TOKEN_OPS) as ops:
        yield World(d, clock, faulty[0], a, b, ops)


def test_every_error_the_daemon_maps_has_a_kind_the_client_knows() -> None:
    for cls, _, _ in _ERRORS:
        kind = error_kind(cls("x"))
        assert kind == cls.__name__ and error_class(kind) is cls
    assert error_kind(TierUnavailableError("down")) == "TierUnavailableError"  # the most specific
    assert error_kind(type("Local", (RetentionError,), {})("x")) == "RetentionError"  # a subclass elsewhere
    assert error_kind(ValueError("x")) is None
    assert error_class("NoSuchError") is None and error_class(409) is None and error_class(None) is None
    assert set(KINDS) >= {c.__name__ for c, _, _ in _ERRORS}


MAPPED = [cls for cls, _, _ in _ERRORS] + [TierUnavailableError, ConfigError, BufferSizeError]


@pytest.mark.parametrize("cls", MAPPED, ids=[c.__name__ for c in MAPPED])
def test_every_mapped_error_round_trips_through_a_daemon(
    start_daemon: Callable[..., ThreadedDaemon], monkeypatch: pytest.MonkeyPatch, cls: type[KVStoreError]
) -> None:
    """Whatever a request raises in the service reaches the client as the same class, with the
    status the service maps it to (some, like LayoutMismatchError, no tenant call raises today:
    the service resolves a namespace by id before the store sees it)."""
    d = start_daemon()
    _, status = classify(cls("x"))

    def refuse(*args: object) -> None:
        raise cls("refused for the test")

    with connect(d.url, retries=0) as c:
        c.register_namespace(SMALL_NS)
        monkeypatch.setattr(Service, "lookup_nowait", refuse)
        with pytest.raises(KVStoreError, match=f"refused for the test \\({cls.__name__}, status {status}\\)") as e:
            c.lookup(SMALL_NS, chain_for(7, 2))  # a LOOKUP frame on the data connection
        assert type(e.value) is cls
        c.info["lookup"] = False  # as a daemon without LOOKUP frames: POST /v1/lookup
        with pytest.raises(KVStoreError, match=f"HTTP {status}: refused for the test") as e:
            c.lookup(SMALL_NS, chain_for(7, 2))
        assert type(e.value) is cls


def _put(w: World, seed: int, n: int) -> list[bytes]:
    chain = chain_for(seed, n)
    w.a.put(SMALL_NS, chain, _blocks(chain))
    return chain


# (case, exception, HTTP status, action): each refusal the control plane maps, through a real daemon.
CASES: list[tuple[str, type[KVStoreError], int, Callable[[World], object]]] = [
    ("unknown token", AuthError, 401, lambda w: connect(w.d.url, token="not-a-token-of-anyone-0123")),
    ("admin only", ForbiddenError, 403, lambda w: w.b._json("POST", "/v1/maintain")),
    ("unknown namespace", UnknownNamespaceError, 404,
     lambda w: w.b._json("POST", "/v1/pin", {"ns": "ab" * 16, "hashes": []})),
    ("block not cached", BlockNotFound, 404, lambda w: w.ops._json("GET", f"/v1/admin/blocks/{'0' * 32}")),
    ("guarantee refused", RetentionError, 409, lambda w: w.a.pin(SMALL_NS, _put(w, 1, 5), until=w.clock() + H)),
    ("deadline passed", UsageError, 400, lambda w: w.a.pin(SMALL_NS, _put(w, 2, 2), until=w.clock() - 1)),
    ("bad body", UsageError, 422, lambda w: w.a._json("POST", "/v1/pin", {"ns": "not hex"})),
    ("body too large", UsageError, 413,
     lambda w: w.a._json("POST", "/v1/lookup", {"ns": "ab" * 16, "hashes": ["0" * 32] * 3000})),
]


@pytest.mark.parametrize(("case", "exc", "status", "action"), CASES, ids=[c[0] for c in CASES])
def test_each_error_kind_reaches_the_client_as_its_own_type(
    world: World, case: str, exc: type[KVStoreError], status: int, action: Callable[[World], object]
) -> None:
    with pytest.raises(KVStoreError) as e:
        action(world)
    assert type(e.value) is exc, f"{case}: {e.value!r}"
    assert f"HTTP {status}" in str(e.value)


@pytest.mark.parametrize(
    ("fault", "exc"),
    [(TierIOError(errno.ENOSPC, "No space left on device"), TierIOError),
     (TierUnavailableError("the object store is down"), TierUnavailableError)],
)
def test_a_device_failure_is_raised_as_the_tiers_error_not_retried_as_a_lost_daemon(
    world: World, fault: TierIOError, exc: type[TierIOError]
) -> None:
    chain = _put(world, 3, 2)  # in DRAM only: a guarantee must write it to NVMe
    world.nvme.inject("write", fault, times=None)
    with pytest.raises(TierIOError) as e:
        world.a.pin(SMALL_NS, chain, until=world.clock() + H)
    assert type(e.value) is exc and "HTTP 503" in str(e.value)
    assert not isinstance(e.value, DaemonUnavailableError)
    world.nvme.clear()
    assert world.a.lookup(SMALL_NS, chain).num_blocks == 2  # the same client carries on
    assert world.a.pin(SMALL_NS, chain, until=world.clock() + H) == 2


def test_a_tenant_over_its_quota_gets_quota_exceeded_by_kind(
    start_daemon: Callable[..., ThreadedDaemon], tmp_path: Path
) -> None:
    root = tmp_path / "quota"
    d = start_daemon(TENANTS, root=root)
    chain = chain_for(4, 4)
    with connect(d.url, token=TOKEN_A) as a:
        a.put(SMALL_NS, chain, _blocks(chain))
    d.stop()
    lowered = tuple(TenantSpec("a", TOKEN_A, quota_bytes=2 * BB) if t.name == "a" else t for t in TENANTS)
    d = start_daemon(lowered, root=root)
    with connect(d.url, token=TOKEN_A) as a, pytest.raises(QuotaExceededError, match="HTTP 507"):
        a.pin(SMALL_NS, chain)


def test_the_error_body_names_its_kind(world: World) -> None:
    chain = _put(world, 5, 5)
    world.a.register_namespace(SMALL_NS)
    with httpx.Client(base_url=world.d.url, headers={"Authorization": f"Bearer {TOKEN_A}"}) as h:
        r = h.post("/v1/pin", json={"ns": SMALL_NS.root.hex(), "hashes": [x.hex() for x in chain],
                                    "until": world.clock() + H})
        assert r.status_code == 409 and r.json()["kind"] == "RetentionError"
        assert "pin_limit_fraction" in r.json()["detail"]
        r = h.post("/v1/pin", json={"ns": SMALL_NS.root.hex(), "hashes": ["zz"]})
        assert r.status_code == 422 and r.json()["kind"] == "UsageError" and r.json()["detail"][0]["loc"]
    with httpx.Client(base_url=world.d.url) as h:
        assert h.get("/v1/info").json() == {
            "detail": "this daemon requires a bearer token: pass token=... to kvstore.client.connect",
            "kind": "AuthError",
        }


@pytest.mark.parametrize(
    ("status", "body", "exc"),
    [
        (409, b'{"detail": "no kind: an older daemon"}', LayoutMismatchError),
        (409, b'{"detail": "a kind from a newer daemon", "kind": "SomethingNew"}', LayoutMismatchError),
        (409, b'{"detail": "x", "kind": ["not", "a", "name"]}', LayoutMismatchError),
        (507, b'{"detail": "x"}', QuotaExceededError),
        (503, b'{"detail": "x"}', KVStoreError),
        (502, b"<html>Bad Gateway</html>", KVStoreError),
        (409, b'{"detail": "x", "kind": "RetentionError"}', RetentionError),
        (400, b'{"detail": "x", "kind": "ConfigError"}', UsageError),  # a subclass: still a UsageError
    ],
)
def test_without_a_known_kind_the_status_decides(
    start_daemon: Callable[..., ThreadedDaemon], monkeypatch: pytest.MonkeyPatch,
    status: int, body: bytes, exc: type[KVStoreError],
) -> None:
    d = start_daemon()
    with connect(d.url) as c:
        c.register_namespace(SMALL_NS)
        monkeypatch.setattr(c._control._http, "request", lambda *a, **k: (status, body))
        with pytest.raises(exc, match=f"HTTP {status}") as e:
            c.pin(SMALL_NS, chain_for(6, 1), until=1e12)
        if exc is KVStoreError:
            assert type(e.value) is KVStoreError


@pytest.mark.parametrize(
    ("fault", "exc"),
    [(TierIOError(errno.EIO, "Input/output error"), TierIOError),
     (TierFullError("the nvme tier has no free slot"), TierFullError)],
)
def test_a_data_plane_disk_error_is_a_tier_io_error_and_a_full_tier_a_tier_full_error(
    world: World, fault: KVStoreError, exc: type[KVStoreError]
) -> None:
    """Both used to arrive as UNAVAILABLE frames that the client raised as TierFullError: a
    failing disk looked like a full one (issue 14, item 14)."""
    world.nvme.inject("write", fault, times=None)
    chain = chain_for(11, 2)
    with pytest.raises(KVStoreError) as e:
        world.a.put(SMALL_NS, chain, _blocks(chain), durable=True)  # durable: NVMe must take it
    assert type(e.value) is exc, repr(e.value)
    assert "Input/output error" in str(e.value) if exc is TierIOError else "no room" in str(e.value)
    world.nvme.clear()
    fresh = chain_for(12, 2)
    assert world.a.put(SMALL_NS, fresh, _blocks(fresh), durable=True) == 2  # the connection stays
