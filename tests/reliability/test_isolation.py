"""Isolation: a tenant that knows another tenant's namespace and block hashes tries to hit,
probe (by error and by timing) and evict them, on both planes. It cannot: its hashes are keyed
apart by the server (docs/daemon.md, tenants), so the store is never even asked about the
other tenant's blocks, and every answer it gets is the answer for blocks nobody has.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np
import pytest

from kvstore.client import connect
from kvstore.errors import QuotaExceededError
from kvstore.server import daemon as daemon_module
from kvstore.server.config import TenantSpec
from kvstore.server.daemon import ThreadedDaemon
from kvstore.store import KVStore
from tests.conftest import BB, SMALL_NS, chain_for, payload
from tests.kvstore.conftest import TOKEN_A, TOKEN_B, TOKEN_OPS
from tests.reliability.harness import percentiles, pick

TENANTS = (
    TenantSpec("a", TOKEN_A, quota_bytes=64 * BB, allow_shm=True),
    TenantSpec("b", TOKEN_B, quota_bytes=64 * BB),
    TenantSpec("ops", TOKEN_OPS, admin=True),
)
PROBES = pick(40, 400)


def _blocks(chain: list[bytes]) -> np.ndarray:
    return np.frombuffer(b"".join(payload(x) for x in chain), np.uint8)


def _spy(store: Any) -> list[bytes]:
    """Every key the store is asked about by lookups, loads, leases, pins and deletes."""
    seen: list[bytes] = []
    for name in ("lookup", "get_into", "acquire", "pin", "unpin", "delete"):
        orig = getattr(store, name)

        def spy(ns: Any, hashes: Any, *a: Any, _orig: Any = orig, **kw: Any) -> Any:
            seen.extend(bytes(h) for h in hashes)
            return _orig(ns, hashes, *a, **kw)

        setattr(store, name, spy)
    return seen


def test_a_tenant_cannot_hit_probe_or_evict_another_tenants_prefixes(
    start_daemon: Callable[..., ThreadedDaemon], monkeypatch: pytest.MonkeyPatch, figures
) -> None:
    stores: list[KVStore] = []

    def capture(cfg: Any, **kw: Any) -> KVStore:
        stores.append(KVStore(cfg, **kw))
        return stores[-1]

    monkeypatch.setattr(daemon_module, "KVStore", capture)
    d = start_daemon(TENANTS)
    secret = [chain_for(100 + i, 4) for i in range(8)]
    nobody = [chain_for(900 + i, 4) for i in range(8)]
    with connect(d.url, token=TOKEN_A, plane="shm") as a:
        for c in secret:
            assert a.put(SMALL_NS, c, _blocks(c)) == 4
    a_keys = {bytes.fromhex(r["hash"]) for r in stores[0].iter_blocks()}
    asked = _spy(stores[0])
    timings: dict[str, list[float]] = {"a's hashes": [], "nobody's hashes": []}
    with httpx.Client(base_url=d.url, headers={"Authorization": f"Bearer {TOKEN_B}"}, timeout=10) as hb:
        # Probing by error: a's namespace id (b has not registered it) answers exactly as an id
        # nobody ever registered, but for the id itself.
        ns_a, other = SMALL_NS.root.hex(), "ab" * 16
        ra = hb.post("/v1/lookup", json={"ns": ns_a, "hashes": [secret[0][0].hex()]})
        rb = hb.post("/v1/lookup", json={"ns": other, "hashes": [secret[0][0].hex()]})
        assert ra.status_code == rb.status_code == 404
        assert ra.json()["detail"].replace(ns_a, "X") == rb.json()["detail"].replace(other, "X")
        # Operator views are not for tenants.
        for path in ("/metrics", "/v1/admin/namespaces", "/v1/admin/top"):
            assert hb.get(path).status_code == 403
        assert hb.post("/v1/admin/evict", json={"blocks": [k.hex() for k in a_keys][:4]}).status_code == 403
        assert "store" not in hb.get("/v1/stats").json()
    with connect(d.url, token=TOKEN_B, plane="tcp") as b:
        out = np.zeros(4 * BB, np.uint8)
        for _ in range(max(1, PROBES // 8)):
            for label, chains in (("a's hashes", secret), ("nobody's hashes", nobody)):
                for c in chains:
                    t0 = time.perf_counter()
                    assert b.lookup(SMALL_NS, c).num_blocks == 0
                    timings[label].append(time.perf_counter() - t0)
                    assert b.get_into(SMALL_NS, c, out) == 0
        for c in secret:
            assert b.pin(SMALL_NS, c) == 0 and b.unpin(SMALL_NS, c) == 0
            assert b.delete(SMALL_NS, c) == 0
        # Filling its own quota cannot push a's blocks out: b is stopped at its quota first.
        filled = 0
        with pytest.raises(QuotaExceededError):
            for i in range(200):
                c = chain_for(5000 + i, 4)
                b.put(SMALL_NS, c, _blocks(c))
                filled += 4
        assert filled <= 64
    # The store was never asked about any of a's blocks on b's behalf: no hit, no timing and no
    # error can tell b anything about them.
    assert asked and not a_keys & set(asked)
    with connect(d.url, token=TOKEN_A, plane="tcp") as a:
        out = np.zeros(4 * BB, np.uint8)
        for c in secret:
            assert a.get_into(SMALL_NS, c, out) == 4 and np.array_equal(out, _blocks(c))
    figures(
        probes=sum(len(v) for v in timings.values()), keys_of_a_asked_on_bs_behalf=0,
        blocks_b_put_before_its_quota=filled,
        lookup_latency_of_b={k: percentiles(v) for k, v in timings.items()},
    )
