"""ControlClient against a real daemon: every control-plane endpoint a tool, the router or an
adapter calls (the admin API included) and the one mapping of refusals to kvstore.errors."""

from __future__ import annotations

import socket
from collections.abc import Callable

import numpy as np
import pytest

from kvstore.client import connect
from kvstore.client.control import ControlClient, control, daemon_error
from kvstore.errors import (
    AuthError,
    BlockNotFound,
    DaemonUnavailableError,
    ForbiddenError,
    KVStoreError,
    LayoutMismatchError,
    QuotaExceededError,
    RetentionError,
    UnknownNamespaceError,
    UsageError,
)
from kvstore.server.daemon import ThreadedDaemon
from tests.conftest import SMALL_NS, chain_for, payload
from tests.kvstore.conftest import TENANTS, TOKEN_B, TOKEN_OPS


def _blocks(chain: list[bytes]) -> np.ndarray:
    return np.frombuffer(b"".join(payload(x) for x in chain), np.uint8)


def test_a_tenants_endpoints(start_daemon: Callable[..., ThreadedDaemon]) -> None:
    d = start_daemon(TENANTS)
    with ControlClient(d.url, token=TOKEN_B) as c:
        assert c.health() == {"status": "ok"}
        assert c.info()["tenant"] == "b"
        reg = c.register_namespace(SMALL_NS, ttl_s=60.0)
        ns = reg["ns"]
        assert reg["block_tokens"] == SMALL_NS.block_tokens and reg["layout_conflicts"] == []
        assert [r["ns"] for r in c.namespaces()] == [ns]
        assert "usage" in c.stats() and "store" not in c.stats()  # not an admin
        assert c.pins()["pins"] == [] and c.pins(ns)["pins"] == []
        with pytest.raises(ForbiddenError, match="HTTP 403"):
            c.maintain()
        with pytest.raises(UsageError, match="publishes no KV events"):
            c.events()


def test_the_admin_api(start_daemon: Callable[..., ThreadedDaemon]) -> None:
    d = start_daemon()  # no tenants: the anonymous tenant is an admin, and stores client hashes
    chain = chain_for(5, 4)
    with connect(d.url) as client:
        client.put(SMALL_NS, chain, _blocks(chain))
        assert client.get_into(SMALL_NS, chain, np.zeros(4 * SMALL_NS.block_bytes, np.uint8)) == 4  # hits
    ns, hashes = SMALL_NS.root.hex(), [h.hex() for h in chain]
    with ControlClient(d.url) as c:
        assert [r["ns"] for r in c.admin_namespaces()["namespaces"]] == [ns]
        assert c.admin_lookup(ns, hashes + ["ab" * 16])["num_blocks"] == 4
        assert c.admin_lookup(ns, tokens=list(range(2 * SMALL_NS.block_tokens)))["blocks"] == 2
        assert c.admin_block(hashes[1])["depth"] == 1
        assert c.admin_top(5, ns)[0]["hits"] >= 1
        prefix = {"ns": ns, "hashes": hashes[:2]}
        assert c.admin_pin(prefix)["blocks"] == 2
        assert c.admin_pins(ns)["summary"]["pins"] == 1 and c.admin_pins()["summary"]["pins"] == 1
        assert c.admin_unpin(prefix)["blocks"] == 2
        assert c.admin_ttl(ns, 120.0) == {"ns": ns, "ttl_s": 120.0}
        assert c.admin_evict([hashes[2]])["blocks"] == 2  # and the block that extends it
        assert c.maintain() is not None and "store" in c.stats()


def test_refusals_raise_the_class_the_daemon_names_with_its_message(
    start_daemon: Callable[..., ThreadedDaemon],
) -> None:
    d = start_daemon(TENANTS)
    with pytest.raises(AuthError, match=f"daemon at {d.url}: HTTP 401: "):
        ControlClient(d.url, token="not-a-token-of-anyone-0123").info()
    with ControlClient(d.url, token=TOKEN_B) as b, pytest.raises(ForbiddenError, match="HTTP 403"):
        b.admin_namespaces()
    with ControlClient(d.url, token=TOKEN_OPS) as ops:
        with pytest.raises(BlockNotFound, match=f"HTTP 404: block {'0' * 32} is not cached"):
            ops.admin_block("0" * 32)
        with pytest.raises(UnknownNamespaceError, match="is not registered"):
            ops.admin_lookup("ab" * 16, ["cd" * 16])
        with pytest.raises(UsageError, match="HTTP 422"):
            ops.admin_top(0)
    assert control(d.url, "GET", "/healthz") == {"status": "ok"}


def test_an_unreachable_daemon() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens on it once closed
    with pytest.raises(DaemonUnavailableError, match=f"127.0.0.1:{port} is unreachable"):
        ControlClient(f"http://127.0.0.1:{port}", timeout=2.0).health()
    with pytest.raises(UsageError, match="http://host:port"):
        ControlClient("tcp://127.0.0.1:1")


@pytest.mark.parametrize(
    ("status", "body", "cls"),
    [(409, b'{"detail": "x"}', LayoutMismatchError), (507, b'{"detail": "x"}', QuotaExceededError),
     (409, b'{"detail": "x", "kind": "RetentionError"}', RetentionError), (500, b"oops", KVStoreError),
     (404, b'{"detail": "x", "kind": "NoSuchErrorYet"}', UnknownNamespaceError)],
)
def test_without_a_known_kind_the_status_decides(status: int, body: bytes, cls: type[KVStoreError]) -> None:
    e = daemon_error(status, body, "http://h:1")
    assert isinstance(e, cls) and str(e).startswith(f"daemon at http://h:1: HTTP {status}: ")
