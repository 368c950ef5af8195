"""The /v1/admin endpoints: the whole store by stored keys, for operators (kvctl)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import httpx

from kvstore.client import connect
from kvstore.keys import KVLayout, LayerGroup
from kvstore.server.daemon import ThreadedDaemon
from tests.conftest import SMALL_NS, chain_for, payload, tokens_for
from tests.kvstore.conftest import TENANTS, TOKEN_A, TOKEN_B, TOKEN_OPS

# Tenant b's engine runs the same model with another block size: the silent-zero-hit mistake.
OTHER_LAYOUT = replace(SMALL_NS, layout=KVLayout("bfloat16", 32, (LayerGroup("full", 1, 1, 64),)))


def _http(d: ThreadedDaemon, token: str) -> httpx.Client:
    return httpx.Client(base_url=d.url, headers={"Authorization": f"Bearer {token}"}, timeout=10)


def test_admin_sees_every_tenant_and_acts_by_stored_keys(start_daemon: Callable[..., ThreadedDaemon]) -> None:
    d = start_daemon(TENANTS)
    chain = chain_for(7, 5)
    with connect(d.url, token=TOKEN_A) as a:
        a.put(SMALL_NS, chain, [payload(h) for h in chain])
        a.get_into(SMALL_NS, chain[:3], bytearray(3 * 4096))
        a.register_namespace(OTHER_LAYOUT)  # with a block: an empty namespace is no conflict
        other = chain_for(8, 1)
        a.put(OTHER_LAYOUT, other, [payload(h, OTHER_LAYOUT.block_bytes) for h in other])
    with connect(d.url, token=TOKEN_B) as b:
        b.register_namespace(SMALL_NS)  # another tenant: its own namespace, no warning
    with _http(d, TOKEN_A) as h:
        assert h.get("/v1/admin/namespaces").status_code == 403  # not an admin
    with _http(d, TOKEN_OPS) as h:
        ns = h.get("/v1/admin/namespaces").json()
        rows = {(r["tenant"], r["block_tokens"]): r for r in ns["namespaces"]}
        assert set(rows) == {("a", 16), ("a", 32), ("b", 16)}
        assert rows["a", 16]["blocks"] == 5 and rows["a", 16]["salted"]
        (w,) = ns["warnings"]
        assert {rows["a", 16]["ns"], rows["a", 32]["ns"]} == set(w["namespaces"])
        assert "layout.block_tokens: 16 vs 32" in w["message"] or "layout.block_tokens: 32 vs 16" in w["message"]
        rows = {k[0]: r for k, r in rows.items() if k[1] == 16}
        ns_a = rows["a"]["ns"]
        # Token ids are hashed as tenant a hashes them, then keyed with a's key.
        r = h.post("/v1/admin/lookup", json={"ns": ns_a, "tokens": tokens_for(7, 6).tolist()}).json()
        assert r["num_blocks"] == 5 and r["blocks"] == 6 and r["tiers"] == ["dram"] * 5
        keys = r["hashes"]
        assert h.post("/v1/admin/lookup", json={"ns": ns_a, "hashes": keys[:2]}).json()["num_blocks"] == 2
        top = h.get("/v1/admin/top", params={"n": 3}).json()
        assert top[0]["hash"] == keys[2] and top[0]["hits"] == 1 and top[0]["tokens"] == 48
        block = h.get(f"/v1/admin/blocks/{keys[4]}").json()
        assert block["depth"] == 4 and block["parent"] == keys[3] and block["namespace_info"]["tenant"] == "a"
        assert h.get(f"/v1/admin/blocks/{'0' * 32}").status_code == 404
        assert h.post("/v1/admin/pin", json={"block": keys[2]}).json() == {"blocks": 3}
        assert h.get(f"/v1/admin/blocks/{keys[0]}").json()["pins"] == 1
        assert h.post("/v1/admin/unpin", json={"block": keys[2]}).json() == {"blocks": 3}
        assert h.post("/v1/admin/ttl", json={"ns": ns_a, "ttl_s": 7 * 86400}).json()["ttl_s"] == 7 * 86400
        again = {(r["tenant"], r["block_tokens"]): r for r in h.get("/v1/admin/namespaces").json()["namespaces"]}
        assert again["a", 16]["ttl_s"] == 7 * 86400
        assert h.post("/v1/admin/evict", json={"blocks": [keys[3]]}).json() == {"blocks": 2}
        assert h.post("/v1/admin/lookup", json={"ns": ns_a, "hashes": keys}).json()["num_blocks"] == 3
        bad = h.post("/v1/admin/pin", json={"block": keys[0], "ns": ns_a})
        assert bad.status_code == 400 and "not both" in bad.json()["detail"]
    with connect(d.url, token=TOKEN_A) as a:  # a reconnecting engine keeps the operator's TTL
        a.register_namespace(SMALL_NS)
    with _http(d, TOKEN_OPS) as h:
        rows = {(r["tenant"], r["block_tokens"]): r for r in h.get("/v1/admin/namespaces").json()["namespaces"]}
        assert rows["a", 16]["ttl_s"] == 7 * 86400
