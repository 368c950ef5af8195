"""Bad input: the control plane fuzzed from its own OpenAPI document, the data plane fuzzed
with frames on a live socket, and the classic mistakes by hand (wrong namespaces, huge or
negative sizes, invalid UTF-8, missing or wrong auth).

Whatever arrives, the answer is a clear 4xx with a ``detail`` (HTTP) or an ERROR frame (data
plane), never a 5xx, a crash or a hang; and the daemon keeps serving well-formed clients.
"""

from __future__ import annotations

import json
import socket
import struct
import zlib
from collections import Counter
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.client import connect
from kvstore.errors import UsageError
from kvstore.server.daemon import ThreadedDaemon
from kvstore.wire import protocol as P
from tests.conftest import BB, SMALL_NS, chain_for, payload
from tests.kvstore.conftest import TENANTS, TOKEN_A, TOKEN_B, TOKEN_OPS
from tests.reliability.harness import pick

EXAMPLES = pick(250, 3000)
NS_HEX = SMALL_NS.root.hex()
HEX = st.one_of(st.just(NS_HEX), st.binary(min_size=16, max_size=16).map(bytes.hex),
                st.text("0123456789abcdefABCDEFxyz", max_size=40))
NUMBERS = st.one_of(st.integers(-(2**70), 2**70), st.sampled_from([0, -1, 2**31, 2**63, 2**64]),
                    st.floats(allow_nan=True, allow_infinity=True))
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, st.text(max_size=30), HEX)
JSON = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=5),
                                                     st.dictionaries(st.text(max_size=10), inner, max_size=5)),
                    max_leaves=20)
FIELDS = {
    "ns": HEX, "hashes": st.lists(HEX, max_size=300), "tokens": st.lists(NUMBERS, max_size=50),
    "ttl_s": NUMBERS, "block": HEX, "blocks": st.lists(HEX, max_size=5), "namespace": JSON,
}


def _mutated_namespace(draw: Any) -> dict[str, Any]:
    """A real namespace descriptor with one field, anywhere in it, replaced by any JSON."""
    d = SMALL_NS.to_dict()
    d.pop("tenant_salt", None)
    paths: list[tuple[Any, Any]] = []

    def walk(node: Any) -> None:
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for k, v in items:
            paths.append((node, k))
            if isinstance(v, dict | list):
                walk(v)

    walk(d)
    node, key = draw(st.sampled_from(paths))
    node[key] = draw(JSON)
    return {"namespace": d, "ttl_s": draw(st.one_of(st.none(), NUMBERS))}


@st.composite
def bodies(draw: Any) -> bytes:
    kind = draw(st.sampled_from(["fields", "fields", "namespace", "json", "bytes"]))
    if kind == "bytes":  # anything, invalid UTF-8 included
        return draw(st.binary(max_size=200))
    if kind == "json":
        obj = draw(JSON)
    elif kind == "namespace":
        obj = _mutated_namespace(draw)
    else:
        keys = draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=3, unique=True))
        obj = {k: draw(FIELDS[k]) for k in keys}
    return json.dumps(obj).encode()  # NaN and Infinity too, as Python clients send them


AUTH = st.sampled_from([  # mostly a valid admin token, so that bodies reach the handlers
    *[{"Authorization": f"Bearer {TOKEN_OPS}"}] * 6,
    {"Authorization": f"Bearer {TOKEN_A}"}, {}, {"Authorization": "Bearer wrong-token-0123456789"},
    {"Authorization": "Basic dXNlcjpwYXNz"}, {"Authorization": b"Bearer \xff\xfe"}, {"Authorization": "Bearer"},
])


def _http(d: ThreadedDaemon, token: str | None = None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=d.url, headers=headers, timeout=30)


def test_fuzz_the_control_plane_from_its_openapi(start_daemon: Callable[..., ThreadedDaemon], figures) -> None:
    d = start_daemon(TENANTS)
    statuses: Counter[int] = Counter()
    with _http(d) as h:
        spec = h.get("/openapi.json").json()
        ops = sorted((path, method.upper()) for path, item in spec["paths"].items() for method in item)
        for tok in (TOKEN_OPS, TOKEN_A):
            assert h.post("/v1/namespaces", json={"namespace": SMALL_NS.to_dict()},
                          headers={"Authorization": f"Bearer {tok}"}).status_code == 200

        @settings(max_examples=EXAMPLES, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(op=st.sampled_from(ops), body=bodies(), auth=AUTH, arg=st.text(max_size=40),
               query=st.dictionaries(st.sampled_from(["n", "ns", "by", "x"]), st.one_of(NUMBERS, st.text(max_size=10)), max_size=3))
        def one(op: tuple[str, str], body: bytes, auth: dict[str, Any], arg: str, query: dict[str, Any]) -> None:
            path, method = op
            url = path.replace("{block}", quote(arg, safe="") or "x")
            content = body if method in ("POST", "PUT", "PATCH") else None
            r = h.request(method, url, content=content, headers={"content-type": "application/json", **auth},
                          params={k: str(v) for k, v in query.items()})
            statuses[r.status_code] += 1
            assert r.status_code < 500, f"{method} {url} {body[:300]!r} -> {r.status_code} {r.text[:500]}"
            if r.status_code >= 400:
                assert r.json().get("detail"), r.text

        one()
        assert h.get("/healthz").json() == {"status": "ok"}
    _still_serves(d, TOKEN_A)
    figures(examples=EXAMPLES, operations=len(ops), statuses=dict(sorted(statuses.items())))


# ---- the data plane ---------------------------------------------------------------------------------


def _frame(op: int, meta: bytes, payload_len: int, good_crc: bool = True) -> bytes:
    """A frame header with any op and length (the protocol's encoder allows only real ones)."""
    head = struct.pack("<4sBBHIIQ", P.MAGIC, P.VERSION, op, 0, 1, len(meta), payload_len)
    c = zlib.crc32(meta, zlib.crc32(head)) if good_crc else 0xDEADBEEF
    return head + struct.pack("<I", c) + meta


HASHES = st.lists(st.binary(min_size=16, max_size=16), max_size=8)
NS_IDS = st.one_of(st.just(SMALL_NS.root), st.binary(min_size=16, max_size=16))
U64 = st.one_of(st.integers(0, 2**64 - 1), st.sampled_from([0, 1, 4096, 2**63, 2**64 - 1]))


@st.composite
def frames(draw: Any) -> bytes:
    op = draw(st.one_of(st.sampled_from([int(o) for o in P.Op]), st.integers(0, 255)))
    kind = draw(st.sampled_from(["blocks", "put", "put_shm", "u64", "raw"]))
    ns, hashes = draw(NS_IDS), draw(HASHES)
    if kind == "blocks":
        meta = P.encode_blocks(ns, hashes)
    elif kind in ("put", "put_shm"):
        start = draw(st.integers(0, len(hashes) + 2))
        off = draw(U64) if kind == "put_shm" else None
        fixed = struct.pack("<IIB", min(start, 2**32 - 1), len(hashes), draw(st.integers(0, 3)))
        meta = ns + fixed + (struct.pack("<Q", off) if off is not None else b"") + b"".join(hashes)
    elif kind == "u64":
        meta = struct.pack("<Q", draw(U64))
    else:
        meta = draw(st.binary(max_size=64))
    body = draw(st.one_of(st.just(b""), st.binary(max_size=64), st.just(bytes(BB)), st.just(bytes(2 * BB))))
    announced = draw(st.one_of(st.just(len(body)), st.integers(0, 1 << 20), st.sampled_from([2**63, 2**64 - 1])))
    return _frame(op, meta, announced, draw(st.booleans()) or draw(st.booleans())) + body


def _exchange(port: int, data: bytes) -> list[tuple[P.Header, bytes]]:
    """Send ``data``, close our side, read every reply until the daemon closes (bounded)."""
    with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the daemon may close first (after a fatal frame): fine
        got = bytearray()
        while True:
            try:
                chunk = s.recv(1 << 16)  # socket.timeout here is a hang: the test fails
            except ConnectionResetError:
                break
            if not chunk:
                break
            got += chunk
    replies, off = [], 0
    limits = P.WireLimits(1 << 24, 1 << 30)
    while off < len(got):
        hdr = P.parse_header(got[off : off + P.HEADER_BYTES], limits, reply=True)
        meta = bytes(got[off + P.HEADER_BYTES : off + P.HEADER_BYTES + hdr.meta_len])
        P.check_crc(got[off : off + P.HEADER_BYTES], meta, hdr.crc)
        replies.append((hdr, meta))
        off += P.HEADER_BYTES + hdr.meta_len + hdr.payload_len
    assert off == len(got), "a reply frame was cut short"
    return replies


def test_fuzz_data_plane_frames_on_a_live_socket(start_daemon: Callable[..., ThreadedDaemon], figures) -> None:
    d = start_daemon(TENANTS)
    port = d.info["data_port"]
    with connect(d.url, token=TOKEN_A, plane="tcp") as c:
        c.register_namespace(SMALL_NS)  # so that some frames name a registered namespace
    outcomes: Counter[str] = Counter()

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(hello=st.sampled_from([None, TOKEN_A.encode(), TOKEN_B.encode(), b"", b"\xff\xfe\xfd", b"wrong" * 5]),
           body=st.lists(frames(), min_size=1, max_size=3))
    def one(hello: bytes | None, body: list[bytes]) -> None:
        first = _frame(P.Op.HELLO, hello, 0) if hello is not None else b""
        for hdr, meta in _exchange(port, first + b"".join(body)):
            if hdr.op is P.Op.ERROR:
                code, msg = P.parse_error(meta)
                assert code is not P.ErrorCode.INTERNAL, msg
                outcomes[code.name] += 1
            else:
                outcomes["REPLY"] += 1

    one()
    _still_serves(d, TOKEN_A)
    figures(examples=EXAMPLES, replies=dict(sorted(outcomes.items())))


# ---- the classic mistakes, by hand ---------------------------------------------------------------


def test_wrong_namespaces_sizes_encodings_and_auth_get_clear_errors(start_daemon: Callable[..., ThreadedDaemon]) -> None:
    d = start_daemon(TENANTS)
    ns = SMALL_NS.to_dict()
    huge = {**ns, "layout": {**ns["layout"], "block_tokens": 10**12}}
    cases: list[tuple[str, str, Any, int, str]] = [
        (TOKEN_A, "/v1/lookup", {"ns": "ab" * 16, "hashes": []}, 404, "not registered"),
        (TOKEN_A, "/v1/namespaces", {"namespace": {**ns, "model_id": ""}}, 400, "model_id"),
        (TOKEN_A, "/v1/namespaces", {"namespace": ns, "ttl_s": -5}, 422, "greater than 0"),
        (TOKEN_A, "/v1/namespaces", {"namespace": huge}, 400, "block"),
        (TOKEN_A, "/v1/namespaces", {"namespace": {**ns, "model_id": {"a": 1}}}, 400, "must be a string"),
        (TOKEN_A, "/v1/namespaces", {"namespace": {**ns, "lora_id": []}}, 400, "must be a string"),
        (TOKEN_A, "/v1/namespaces", {"namespace": {**ns, "layout": [["a", "b", "c"]]}}, 400, "descriptor"),
        (TOKEN_A, "/v1/lookup", {"ns": NS_HEX, "tokens": [-(2**40)]}, 422, "greater than or equal"),
        (TOKEN_A, "/v1/lookup", {"ns": NS_HEX, "hashes": ["00" * 16] * 257}, 400, "limit of 256"),
        (TOKEN_B, "/v1/admin/top", None, 403, "not an admin"),
        ("", "/v1/stats", None, 401, "bearer token"),
        ("wrong-token-wrong-token", "/v1/stats", None, 401, "unknown bearer token"),
    ]
    with _http(d, TOKEN_A) as h:
        h.post("/v1/namespaces", json={"namespace": ns})
    for token, path, body, status, words in cases:
        with _http(d, token or None) as h:
            r = h.post(path, json=body) if body is not None else h.get(path)
            assert (r.status_code, words in r.text) == (status, True), (path, body, r.text)
    with _http(d, TOKEN_A) as h:
        r = h.post("/v1/lookup", content=b'{"ns": "\xff\xfe", "hashes": []}', headers={"content-type": "application/json"})
        assert r.status_code in (400, 422) and r.json()["detail"]
        # A 422 that would echo Infinity back (FastAPI's own handler: a 500).
        r = h.post("/v1/lookup", content=b'{"ns": "zz", "tokens": [Infinity, NaN]}', headers={"content-type": "application/json"})
        assert r.status_code == 422 and "pattern" in r.text
        r = h.post("/v1/lookup", content=b"[" * 100_000, headers={"content-type": "application/json"})
        assert r.status_code in (413, 422)
    # The same mistakes on the data plane: error frames, the connection kept where it can be.
    replies = _exchange(d.info["data_port"], _frame(P.Op.HELLO, b"\xff\xfe", 0))
    assert P.parse_error(replies[0][1])[0] is P.ErrorCode.BAD_FRAME
    replies = _exchange(d.info["data_port"], _frame(P.Op.HELLO, b"", 0))
    assert P.parse_error(replies[0][1])[0] is P.ErrorCode.UNAUTHENTICATED
    frames_ = _frame(P.Op.HELLO, TOKEN_A.encode(), 0) + _frame(P.Op.GET, P.encode_blocks(b"\1" * 16, []), 0) \
        + _frame(P.Op.STAGING, P.encode_u64(2**64 - 1), 0) + _frame(P.Op.STAGING, P.encode_u64(0), 0)
    codes = [P.parse_error(m)[0] for h, m in _exchange(d.info["data_port"], frames_) if h.op is P.Op.ERROR]
    assert codes == [P.ErrorCode.NOT_FOUND, P.ErrorCode.BAD_REQUEST, P.ErrorCode.BAD_REQUEST]
    _still_serves(d, TOKEN_A)


def _still_serves(d: ThreadedDaemon, token: str) -> None:
    chain = chain_for(77, 3)
    with connect(d.url, token=token, plane="tcp") as c:
        c.put(SMALL_NS, chain, [payload(x) for x in chain])
        out = np.zeros(3 * BB, np.uint8)
        assert c.get_into(SMALL_NS, chain, out) == 3
        assert bytes(out[BB : 2 * BB]) == payload(chain[1])


@pytest.mark.parametrize("plane", ["tcp", "shm"])
def test_a_chain_whose_block_hangs_under_another_parent_is_a_bad_request(
    start_daemon: Callable[..., ThreadedDaemon], plane: str
) -> None:
    """Issue 33: a chain [c, q] whose q is cached under another parent answered INTERNAL
    ("inserted twice") and closed the connection. It is a malformed chain: BAD_REQUEST (a
    UsageError at the client), and the same connection carries on."""
    d = start_daemon(TENANTS)
    c_, q, x = b"c" * 16, b"q" * 16, b"x" * 16
    with connect(d.url, token=TOKEN_A, plane=plane) as c:
        c.register_namespace(SMALL_NS)
        assert c.put(SMALL_NS, [x, q], [payload(x), payload(q)]) == 2
        with pytest.raises(UsageError, match="cached at another place"):
            c.put(SMALL_NS, [c_, q], [payload(c_), payload(q)])
        out = np.zeros(2 * BB, np.uint8)
        assert c.get_into(SMALL_NS, [x, q], out) == 2  # the same connection serves on
        assert c.lookup(SMALL_NS, [c_]).num_blocks == 0  # nothing of the refused chain stored


def test_boolean_token_ids_are_refused(start_daemon: Callable[..., ThreadedDaemon]) -> None:
    """Issue 33: ``tokens: [true, false]`` was read as the token ids 1 and 0."""
    d = start_daemon(TENANTS)
    with connect(d.url, token=TOKEN_A, plane="tcp") as c:
        c.register_namespace(SMALL_NS)
    r = httpx.post(f"{d.url}/v1/lookup", headers={"Authorization": f"Bearer {TOKEN_A}"},
                   json={"ns": bytes(SMALL_NS.root).hex(), "tokens": [True, False]})
    assert r.status_code == 422 and r.json()["kind"] == "UsageError", r.text
