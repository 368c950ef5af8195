"""Tenants and their pins through a real daemon: ``GET /v1/pins`` / ``Client.pin_report()`` shows a
tenant its own pins only, and ``pin_quota`` bounds the bytes a tenant's retention guarantees hold
(overlapping guarantees count a block once)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from kvstore.client import connect
from kvstore.clock import FakeClock
from kvstore.errors import RetentionError
from kvstore.server.config import TenantSpec
from kvstore.server.daemon import ThreadedDaemon
from tests.conftest import BB, SMALL_NS, chain_for, payload, tokens_for
from tests.kvstore.conftest import TENANTS, TOKEN_A, TOKEN_B, TOKEN_OPS

H = 3600.0
OTHER_NS = replace(SMALL_NS, model_id="test/other")
TOKEN_C = "token-of-tenant-c-0123456789"


def _blocks(chain: list[bytes]) -> np.ndarray:
    return np.frombuffer(b"".join(payload(x) for x in chain), np.uint8)


def _http(d: ThreadedDaemon, token: str) -> httpx.Client:
    return httpx.Client(base_url=d.url, headers={"Authorization": f"Bearer {token}"}, timeout=10)


def _rows(report: dict[str, Any]) -> list[tuple[int, float | None, bool]]:
    return sorted(((r["blocks"], r["until"], r["active"]) for r in report["pins"]), key=str)


def test_a_tenant_lists_its_own_pins_and_never_anothers(
    start_daemon: Callable[..., ThreadedDaemon], tmp_path: Path
) -> None:
    clock = FakeClock()
    root = tmp_path / "pins"
    d = start_daemon(TENANTS, root=root, clock=clock)
    chain = chain_for(1, 4)  # both tenants cache the same prompt: two sets of blocks
    t_a, t_b = clock() + 2 * H, clock() + 5 * H
    with connect(d.url, token=TOKEN_A) as a, connect(d.url, token=TOKEN_B) as b:
        a.put(SMALL_NS, chain, _blocks(chain))
        b.put(SMALL_NS, chain, _blocks(chain))
        b.put(OTHER_NS, chain_for(2, 2), _blocks(chain_for(2, 2)))
        assert a.pin(SMALL_NS, chain[:2]) == 2
        assert a.pin(SMALL_NS, chain[:3], until=t_a) == 3
        assert b.pin(SMALL_NS, chain[:1], until=t_b) == 1
        assert b.pin(OTHER_NS, chain_for(2, 2)) == 2

        mine = a.pin_report()
        assert _rows(mine) == [(2, None, True), (3, t_a, True)]
        assert {(r["ns"], r["model_id"], r["bytes"]) for r in mine["pins"]} == {
            (SMALL_NS.root.hex(), "test/tiny", 2 * BB), (SMALL_NS.root.hex(), "test/tiny", 3 * BB)}
        assert mine["guaranteed_bytes"] == 3 * BB and mine["pin_quota_bytes"] is None
        assert mine["summary"] | {"next_until": None} == {
            "pins": 2, "timed": 1, "untimed": 1, "pinned_blocks": 3, "next_until": None, "ended": 0}
        assert mine["summary"]["next_until"] == t_a

        theirs = b.pin_report()
        assert _rows(theirs) == [(1, t_b, True), (2, None, True)]
        assert theirs["guaranteed_bytes"] == BB
        assert _rows(b.pin_report(SMALL_NS)) == [(1, t_b, True)]
        assert _rows(b.pin_report(OTHER_NS)) == [(2, None, True)]
        assert a.pin_report(OTHER_NS)["pins"] == []  # a's own namespace id, b's pins: nothing

    with _http(d, TOKEN_OPS) as h:  # the admin still sees every pin, by stored keys
        every = h.get("/v1/admin/pins").json()["pins"]
        assert sorted(r["blocks"] for r in every) == [1, 2, 2, 3]
        stored = {r["block"] for r in every} | {r["first"] for r in every} | {r["ns"] for r in every}
        assert h.get("/v1/pins").json()["pins"] == []  # as a tenant, ops has none
    with _http(d, TOKEN_B) as h:
        body = h.get("/v1/pins").text
        assert not any(k in body for k in stored - {SMALL_NS.root.hex(), OTHER_NS.root.hex()})
        assert h.get("/v1/admin/pins").status_code == 403
        assert h.get("/v1/pins", params={"ns": "not-hex"}).status_code == 422
    with httpx.Client(base_url=d.url) as h:
        r = h.get("/v1/pins")
        assert r.status_code == 401 and r.json()["kind"] == "AuthError"

    d.stop()
    clock.set(t_a + 1)  # while down: a's guarantee ends (dropped at open), b's holds
    d = start_daemon(TENANTS, root=root, clock=clock)
    with connect(d.url, token=TOKEN_A) as a, connect(d.url, token=TOKEN_B) as b:
        # Before either registers a namespace again: its pins are found by its salt.
        assert _rows(a.pin_report()) == [(2, None, True)] and a.pin_report()["guaranteed_bytes"] == 0
        assert _rows(b.pin_report()) == [(1, t_b, True), (2, None, True)]
        clock.set(t_b + 1)
        assert _rows(b.pin_report(SMALL_NS)) == [(1, t_b, False)]  # ended, until the next expiry pass
        assert b.pin_report()["guaranteed_bytes"] == 0
        with _http(d, TOKEN_OPS) as h:
            assert h.post("/v1/maintain").status_code == 200
        assert b.pin_report(SMALL_NS)["pins"] == []


def test_pin_quota_bounds_a_tenants_guarantees(start_daemon: Callable[..., ThreadedDaemon]) -> None:
    clock = FakeClock()
    tenants = (
        TenantSpec("a", TOKEN_A, pin_quota_bytes=4 * BB),
        TenantSpec("b", TOKEN_B),  # no per-tenant limit: only the store's pin_limit_fraction
        TenantSpec("c", TOKEN_C, pin_quota_bytes=0),  # no guarantees at all
        TenantSpec("ops", TOKEN_OPS, admin=True),
    )
    d = start_daemon(tenants, clock=clock)
    until = clock() + H
    chain, other = chain_for(3, 6), chain_for(4, 2)
    with connect(d.url, token=TOKEN_A) as a, connect(d.url, token=TOKEN_B) as b, \
            connect(d.url, token=TOKEN_C) as c:
        for t in (a, b, c):
            t.put(SMALL_NS, chain, _blocks(chain))
        a.put(SMALL_NS, other, _blocks(other))

        assert a.pin(SMALL_NS, chain[:3], until=until) == 3
        assert a.pin(SMALL_NS, chain[:4], until=until + H) == 4  # overlaps: 1 block more, 4 in all
        assert a.pin(SMALL_NS, chain[:2], until=until) == 2  # all held already: adds nothing
        assert a.pin_report()["guaranteed_bytes"] == 4 * BB
        with pytest.raises(RetentionError) as e:
            a.pin(SMALL_NS, chain[:5], until=until)
        msg = str(e.value)
        assert "HTTP 409" in msg and f"holds {4 * BB} bytes" in msg and f"would add {BB}" in msg
        assert f"pin_quota of {4 * BB} bytes" in msg and "unpin" in msg and "raise pin_quota" in msg
        with pytest.raises(RetentionError, match="pin_quota"):
            a.pin(SMALL_NS, other, until=until)
        assert len(a.pin_report()["pins"]) == 3  # the refusals pinned nothing
        assert a.pin(SMALL_NS, chain) == 6  # an untimed pin is no guarantee: not counted
        assert a.pin_report()["guaranteed_bytes"] == 4 * BB

        # Only what is cached counts (and is pinned): 2 of these 5 hashes.
        longer = chain_for(5, 5)
        b.put(SMALL_NS, longer[:2], _blocks(longer[:2]))
        assert b.pin(SMALL_NS, longer, until=until) == 2
        assert b.pin(SMALL_NS, chain, until=until) == 6  # b: bounded by the store alone
        assert b.pin_report()["guaranteed_bytes"] == 8 * BB and b.pin_report()["pin_quota_bytes"] is None

        with pytest.raises(RetentionError, match="pin_quota of 0 bytes"):
            c.pin(SMALL_NS, chain[:1], until=until)
        assert c.pin(SMALL_NS, chain[:1]) == 1

        assert a.unpin(SMALL_NS, chain[:4]) == 4  # a guarantee undone: its room comes back
        assert a.pin_report()["guaranteed_bytes"] == 3 * BB
        assert a.pin(SMALL_NS, chain[:4], until=until) == 4
        clock.set(until + 1)  # these ended (before any expiry pass): they count no more
        assert a.pin_report()["guaranteed_bytes"] == 0
        assert a.pin(SMALL_NS, other, until=clock() + H) == 2
        assert a.stats()["usage"]["pin_quota_bytes"] == 4 * BB

    with _http(d, TOKEN_OPS) as h:
        (ns_a,) = [r["ns"] for r in h.get("/v1/admin/namespaces").json()["namespaces"]
                   if r["tenant"] == "a" and r["model_id"] == "test/tiny"]
        # An operator's guarantee is not refused by the tenant's pin_quota, but counts in it.
        body = {"ns": ns_a, "tokens": tokens_for(3, 6).tolist(), "until": clock() + 2 * H}
        assert h.post("/v1/admin/pin", json=body).json()["blocks"] == 6
    with connect(d.url, token=TOKEN_A) as a:
        assert a.pin_report()["guaranteed_bytes"] == 8 * BB  # 6 of the operator's, 2 of a's own
        with _http(d, TOKEN_A) as h:
            r = h.post("/v1/pin", json={"ns": SMALL_NS.root.hex(), "hashes": [x.hex() for x in chain[:1]],
                                        "until": clock() + H})
            assert r.status_code == 200  # held already: adds nothing, so allowed over the limit
            fresh = chain_for(6, 1)
            a.put(SMALL_NS, fresh, _blocks(fresh))
            r = h.post("/v1/pin", json={"ns": SMALL_NS.root.hex(), "hashes": [fresh[0].hex()],
                                        "until": clock() + H})
            assert r.status_code == 409 and r.json()["kind"] == "RetentionError"
            assert "pin_quota" in r.json()["detail"]
            r = h.post("/v1/pin", json={"ns": SMALL_NS.root.hex(), "hashes": [fresh[0].hex()],
                                        "until": clock() - 1})
            assert r.status_code == 400 and r.json()["kind"] == "UsageError"  # a past deadline first
