"""The control plane: health, auth, tenant isolation, quotas, limits, bad input, metrics."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import numpy as np
import pytest

from kvstore.client import connect
from kvstore.errors import QuotaExceededError
from kvstore.server.daemon import ThreadedDaemon
from tests.conftest import SMALL_NS, chain_for, payload, tokens_for
from tests.kvstore.conftest import TENANTS, TOKEN_A, TOKEN_B, TOKEN_OPS

NS_BODY = {"namespace": SMALL_NS.to_dict()}


def _http(d: ThreadedDaemon, token: str | None = None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=d.url, headers=headers, timeout=10)


def _hex(hashes: list[bytes]) -> list[str]:
    return [h.hex() for h in hashes]


def test_health_readiness_and_openapi(start_daemon: Callable[..., ThreadedDaemon]) -> None:
    d = start_daemon()
    with _http(d) as h:
        assert h.get("/healthz").json() == {"status": "ok"}
        assert h.get("/readyz").json() == {"ready": True}
        paths = h.get("/openapi.json").json()["paths"]
        assert {"/v1/lookup", "/v1/pin", "/v1/unpin", "/v1/evict", "/v1/stats", "/metrics"} <= set(paths)


def test_anonymous_lookup_by_hashes_and_by_tokens(start_daemon: Callable[..., ThreadedDaemon]) -> None:
    d = start_daemon()
    chain = chain_for(1, 4)
    with connect(d.url) as c:
        c.put(SMALL_NS, chain[:3], [payload(x) for x in chain[:3]])
    with _http(d) as h:
        ns = h.post("/v1/namespaces", json=NS_BODY).json()["ns"]
        assert ns == SMALL_NS.root.hex()
        r = h.post("/v1/lookup", json={"ns": ns, "hashes": _hex(chain)}).json()
        assert r == {"num_blocks": 3, "num_tokens": 48, "tiers": ["dram"] * 3, "unavailable": []}
        toks = tokens_for(1, 4).tolist()
        assert h.post("/v1/lookup", json={"ns": ns, "tokens": toks}).json()["num_blocks"] == 3


def test_tokens_are_required_and_checked(start_daemon: Callable[..., ThreadedDaemon]) -> None:
    d = start_daemon(TENANTS)
    with _http(d) as h:
        r = h.post("/v1/namespaces", json=NS_BODY)
        assert r.status_code == 401 and "bearer token" in r.json()["detail"]
    with _http(d, "not-a-known-token-at-all") as h:
        assert h.get("/v1/info").status_code == 401
    with _http(d, TOKEN_A) as h:
        assert h.get("/v1/info").json()["tenant"] == "a"
        assert h.get("/healthz").status_code == 200  # probes need no token
    r = httpx.get(f"{d.url}/v1/info", headers={"Authorization": "Basic abc"})
    assert r.status_code == 401


def test_admin_only_endpoints(start_daemon: Callable[..., ThreadedDaemon]) -> None:
    d = start_daemon(TENANTS)
    with _http(d, TOKEN_B) as h:
        assert h.get("/metrics").status_code == 403
        assert h.post("/v1/maintain").status_code == 403
        assert "store" not in h.get("/v1/stats").json()
    with _http(d, TOKEN_OPS) as h:
        assert h.get("/metrics").status_code == 200
        assert h.post("/v1/maintain").status_code == 200
        assert {t["tenant"] for t in h.get("/v1/stats").json()["tenants"]} == {"a", "b", "ops"}


def test_tenants_cannot_see_each_others_blocks(start_daemon: Callable[..., ThreadedDaemon]) -> None:
    d = start_daemon(TENANTS)
    chain = chain_for(2, 4)
    blocks = np.frombuffer(b"".join(payload(x) for x in chain), np.uint8)
    with connect(d.url, token=TOKEN_A, plane="tcp") as a, connect(d.url, token=TOKEN_B, plane="tcp") as b:
        assert a.put(SMALL_NS, chain, blocks) == 4
        assert a.lookup(SMALL_NS, chain).num_blocks == 4
        # Same namespace, same hashes, another tenant: nothing to see, nothing to load or evict.
        assert b.lookup(SMALL_NS, chain).num_blocks == 0
        assert b.get_into(SMALL_NS, chain, np.zeros_like(blocks)) == 0
        assert b.delete(SMALL_NS, chain) == 0
        assert a.lookup(SMALL_NS, chain).num_blocks == 4
        # b stores the same prompt: its own copy, a's is untouched.
        assert b.put(SMALL_NS, chain, blocks) == 4
    with _http(d, TOKEN_B) as h:
        r = h.post("/v1/namespaces", json={"namespace": {**SMALL_NS.to_dict(), "tenant_salt": "guess"}})
        assert r.status_code == 400 and "chosen by the server" in r.json()["detail"]


def test_quota_refuses_puts_past_it(start_daemon: Callable[..., ThreadedDaemon]) -> None:
    d = start_daemon(TENANTS)  # tenant a: 64 blocks of 4 KiB
    with connect(d.url, token=TOKEN_A, plane="tcp") as a:
        chain = chain_for(3, 60)
        assert a.put(SMALL_NS, chain, [payload(x) for x in chain]) == 60
        more = chain_for(4, 8)
        with pytest.raises(QuotaExceededError, match="quota"):
            a.put(SMALL_NS, more, [payload(x) for x in more])
        assert a.delete(SMALL_NS, chain[40:41]) == 20  # evicting frees quota
        assert a.put(SMALL_NS, more, [payload(x) for x in more]) == 8


@pytest.mark.parametrize(
    ("path", "body", "status", "words"),
    [
        ("/v1/lookup", b"{not json", 422, "JSON"),
        ("/v1/lookup", b'{"ns": "zz", "hashes": []}', 422, "pattern"),
        ("/v1/lookup", b'{"ns": "' + b"0" * 32 + b'", "hashes": ["00"]}', 422, "pattern"),
        ("/v1/lookup", b'{"ns": "' + b"0" * 32 + b'", "hashes": []}', 404, "not registered"),
        ("/v1/lookup", b'{"ns": "' + b"0" * 32 + b'"}', 400, "exactly one"),
        ("/v1/pin", b'{"ns": "' + b"0" * 32 + b'", "hashes": [], "extra": 1}', 422, "extra"),
        ("/v1/namespaces", b'{"namespace": {"model_id": "x"}}', 400, "namespace descriptor"),
    ],
)
def test_malformed_bodies_get_4xx_with_a_message(
    start_daemon: Callable[..., ThreadedDaemon], path: str, body: bytes, status: int, words: str
) -> None:
    d = start_daemon()
    with _http(d) as h:
        r = h.post(path, content=body, headers={"content-type": "application/json"})
        assert r.status_code == status
        assert words in r.text


def test_size_limits(start_daemon: Callable[..., ThreadedDaemon]) -> None:
    d = start_daemon()  # 64 KiB bodies, 256 blocks per request
    with _http(d) as h:
        ns = h.post("/v1/namespaces", json=NS_BODY).json()["ns"]
        r = h.post("/v1/lookup", json={"ns": ns, "hashes": ["0" * 32] * 3000})
        assert r.status_code == 413 and "exceeds" in r.json()["detail"]
        r = h.post("/v1/lookup", json={"ns": ns, "hashes": ["0" * 32] * 300})
        assert r.status_code == 400 and "limit of 256" in r.json()["detail"]

        def chunks():  # type: ignore[no-untyped-def]  # no Content-Length: counted as it arrives
            yield b'{"ns": "' + ns.encode() + b'", "hashes": ['
            for _ in range(3000):
                yield b'"' + b"0" * 32 + b'",'
            yield b'"' + b"0" * 32 + b'"]}'

        r = h.post("/v1/lookup", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413
        assert h.get("/healthz").status_code == 200


def test_metrics_report_hits_tiers_and_latencies(start_daemon: Callable[..., ThreadedDaemon]) -> None:
    d = start_daemon()
    chain = chain_for(5, 3)
    with connect(d.url, plane="tcp") as c:
        c.put(SMALL_NS, chain, [payload(x) for x in chain])
        c.get_into(SMALL_NS, chain, [bytearray(4096) for _ in chain])
    with _http(d) as h:
        text = h.get("/metrics").text
    assert 'kvstore_hit_blocks_total{tier="dram"} 3.0' in text
    assert 'kvstore_tier_capacity_bytes{tier="nvme"}' in text
    assert 'kvstore_evictions_total{reason="expiry"}' in text
    assert "kvstore_skipped_writes_total 0.0" in text  # nothing for admission to skip yet
    assert 'kvstore_request_seconds_count{op="get",plane="tcp"} 1.0' in text
    assert 'kvstore_bytes_total{direction="out",plane="tcp"} 12288.0' in text


@pytest.mark.parametrize(
    ("body", "where"),
    [
        (b"", "body"),  # no body at all
        (b"\xff\xfe{", "body"),  # not UTF-8
        (b"[1, 2]", "body"),  # JSON, not an object
        (b'{"ns": "' + b"0" * 32 + b'", "hashes": [1]}', "hashes"),
        (b'{"ns": "' + b"0" * 32 + b'", "tokens": [NaN]}', "tokens"),
        (b'{"ns": "' + b"0" * 32 + b'", "hashes": [], "more": 1}', "more"),
    ],
)
def test_lookup_parses_its_own_body_and_answers_4xx_with_where(
    start_daemon: Callable[..., ThreadedDaemon], body: bytes, where: str
) -> None:
    """The lookup endpoint reads its raw body (the hot path skips FastAPI's body handling):
    bad input still gets 422 with the place and the reason, as every other endpoint gives."""
    d = start_daemon()
    with _http(d) as h:
        r = h.post("/v1/lookup", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 422, r.text
        detail = r.json()["detail"]
        assert detail and all(e["loc"][0] == "body" and e["msg"] for e in detail)
        assert where in str([e["loc"] for e in detail]) or where == "body"


def test_openapi_documents_the_lookup_body_and_reply(start_daemon: Callable[..., ThreadedDaemon]) -> None:
    d = start_daemon()
    with _http(d) as h:
        spec = h.get("/openapi.json").json()
    op = spec["paths"]["/v1/lookup"]["post"]
    schema = op["requestBody"]["content"]["application/json"]["schema"]
    assert set(schema["properties"]) == {"ns", "hashes", "tokens"} and schema["required"] == ["ns"]
    assert schema["additionalProperties"] is False
    assert "authorization" in [p["name"] for p in op["parameters"]]
    reply = op["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[-1]
    assert set(spec["components"]["schemas"][reply]["properties"]) == {"num_blocks", "num_tokens", "tiers", "unavailable"}


def test_lookup_needs_the_tenants_token_and_is_timed_by_route(start_daemon: Callable[..., ThreadedDaemon]) -> None:
    d = start_daemon(TENANTS)
    body = {"ns": SMALL_NS.root.hex(), "hashes": _hex(chain_for(7, 2))}
    with _http(d) as h:
        r = h.post("/v1/lookup", json=body)
        assert r.status_code == 401 and "bearer token" in r.json()["detail"]
        r = h.post("/v1/lookup", json=body, headers={"Authorization": "Basic abc"})
        assert r.status_code == 401 and "Bearer <token>" in r.json()["detail"]
    with _http(d, TOKEN_A) as h:
        assert h.post("/v1/namespaces", json=NS_BODY).status_code == 200
        assert h.post("/v1/lookup", json=body).json() == {"num_blocks": 0, "num_tokens": 0, "tiers": [], "unavailable": []}
    with _http(d, TOKEN_OPS) as h:
        text = h.get("/metrics").text
    assert 'kvstore_requests_total{op="/v1/lookup",outcome="200",plane="http"} 1.0' in text
    assert 'kvstore_requests_total{op="/v1/lookup",outcome="401",plane="http"} 2.0' in text
    assert 'kvstore_request_seconds_count{op="/v1/lookup",plane="http"} 3.0' in text
