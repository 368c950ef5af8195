"""Retention guarantees through the daemon: ``Client.pin(ns, hashes, until=T)`` on a daemon
whose store runs on a fake clock; refusals, quotas, unpin, and a restart."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import pytest

from kvstore.client import connect
from kvstore.clock import FakeClock
from kvstore.errors import QuotaExceededError, RetentionError, UsageError
from kvstore.server.config import TenantSpec
from kvstore.server.daemon import ThreadedDaemon
from tests.conftest import BB, SMALL_NS, chain_for, payload, small_tiers
from tests.kvstore.conftest import TENANTS, TOKEN_A

H = 3600.0
# The last tier holds 8 blocks: guarantees may take 4 of them (pin_limit_fraction 0.5).
TIERS = small_tiers(dram_blocks=4, nvme_blocks=8, object_blocks=8)


def _blocks(chain: list[bytes]) -> np.ndarray:
    return np.frombuffer(b"".join(payload(x) for x in chain), np.uint8)


def test_a_guarantee_through_the_client_holds_past_the_ttl_and_a_restart(
    start_daemon: Callable[..., ThreadedDaemon], tmp_path: Path
) -> None:
    clock = FakeClock()
    root = tmp_path / "data"
    d = start_daemon(root=root, tiers=TIERS, clock=clock)
    keep, other = chain_for(1, 3), chain_for(2, 2)
    until = clock() + 100 * H  # past the 72 h TTL
    with connect(d.url) as c:
        c.put(SMALL_NS, keep, _blocks(keep))
        c.put(SMALL_NS, other, _blocks(other))
        assert c.pin(SMALL_NS, keep, until=until) == 3
        with pytest.raises(RetentionError, match="cannot guarantee 2 blocks") as e:
            c.pin(SMALL_NS, other, until=until)  # 3 + 2 blocks > 4: refused whole
        assert "HTTP 409" in str(e.value) and "unpin prefixes, shorten them, or raise the limit" in str(e.value)
        assert c.unpin(SMALL_NS, other) == 0  # the refusal pinned nothing
        with pytest.raises(UsageError, match="not in the future"):
            c.pin(SMALL_NS, other, until=clock() - 1)
        assert c.unpin(SMALL_NS, keep[:1]) == 0  # a guarantee is not undone piecemeal
    d.stop()
    clock.advance(80 * H)  # while the daemon is down: past every TTL, not past the deadline
    d = start_daemon(root=root, tiers=TIERS, clock=clock)
    with connect(d.url) as c:
        assert c.lookup(SMALL_NS, keep).num_blocks == 3  # re-applied from pins.json at open
        assert c.lookup(SMALL_NS, other).num_blocks == 0  # best effort: expired
        out = np.zeros(3 * BB, np.uint8)
        assert c.get_into(SMALL_NS, keep, out) == 3 and np.array_equal(out, _blocks(keep))
        with httpx.Client(base_url=d.url) as h:
            (row,) = h.get("/v1/admin/pins").json()["pins"]
            assert row == {"ns": SMALL_NS.root.hex(), "block": keep[-1].hex(), "first": keep[0].hex(),
                           "blocks": 3, "until": until, "active": True}
            clock.set(until + 1)
            assert h.post("/v1/maintain").status_code == 200  # the first expiry pass after T ends it
            assert h.get("/v1/admin/pins").json()["pins"] == []
        assert c.unpin(SMALL_NS, keep) == 0  # already released


def test_a_whole_guarantee_can_be_unpinned(start_daemon: Callable[..., ThreadedDaemon]) -> None:
    clock = FakeClock()
    d = start_daemon(tiers=TIERS, clock=clock)
    chain = chain_for(3, 4)
    with connect(d.url) as c:
        c.put(SMALL_NS, chain, _blocks(chain))
        assert c.pin(SMALL_NS, chain[:2], until=clock() + H) == 2
        assert c.pin(SMALL_NS, chain) == 4  # an untimed pin over it
        assert c.unpin(SMALL_NS, chain[1:2]) == 1  # taken out of the untimed pin only
        assert c.unpin(SMALL_NS, chain[:2]) == 2  # the guarantee, whole
        assert c.unpin(SMALL_NS, chain) == 3  # what is left of the untimed pin


def test_the_tenant_endpoint_speaks_409_and_validates_until(start_daemon: Callable[..., ThreadedDaemon]) -> None:
    clock = FakeClock()
    d = start_daemon(tiers=TIERS, clock=clock)
    chain = chain_for(4, 5)
    with connect(d.url) as c:
        c.put(SMALL_NS, chain, _blocks(chain))
    ns, hashes = SMALL_NS.root.hex(), [h.hex() for h in chain]
    with httpx.Client(base_url=d.url) as h:
        r = h.post("/v1/pin", json={"ns": ns, "hashes": hashes, "until": clock() + H})
        assert r.status_code == 409 and "pin_limit_fraction" in r.json()["detail"]
        for bad in (-1, 0, "soon"):
            assert h.post("/v1/pin", json={"ns": ns, "hashes": hashes, "until": bad}).status_code == 422
        assert h.post("/v1/pin", json={"ns": ns, "hashes": hashes[:2], "until": clock() - 1}).status_code == 400
        r = h.post("/v1/pin", json={"ns": ns, "hashes": hashes[:2], "until": clock() + H})
        assert r.json() == {"blocks": 2, "until": clock() + H}
        assert h.post("/v1/pin", json={"ns": ns, "hashes": hashes}).json() == {"blocks": 5}
        assert h.post("/v1/unpin", json={"ns": ns, "hashes": hashes, "until": 1}).status_code == 422


def test_a_tenant_over_its_quota_may_not_pin(start_daemon: Callable[..., ThreadedDaemon], tmp_path: Path) -> None:
    clock = FakeClock()
    root = tmp_path / "tenants"
    d = start_daemon(TENANTS, root=root, clock=clock)
    chain = chain_for(5, 6)
    with connect(d.url, token=TOKEN_A) as a:
        a.put(SMALL_NS, chain, _blocks(chain))
        assert a.pin(SMALL_NS, chain[:2], until=clock() + H) == 2  # within its quota
    d.stop()
    lowered = tuple(TenantSpec("a", TOKEN_A, quota_bytes=4 * BB) if t.name == "a" else t for t in TENANTS)
    d = start_daemon(lowered, root=root, clock=clock)
    with connect(d.url, token=TOKEN_A) as a:
        with pytest.raises(QuotaExceededError, match="over its 16384-byte quota"):
            a.pin(SMALL_NS, chain, until=clock() + H)
        with pytest.raises(QuotaExceededError):
            a.pin(SMALL_NS, chain)
        assert a.unpin(SMALL_NS, chain[:2]) == 2  # unpinning is always allowed
        assert a.delete(SMALL_NS, chain[3:4]) == 3  # back under the quota: 3 blocks
        assert a.pin(SMALL_NS, chain[:3], until=clock() + H) == 3
