"""The client's control-plane HTTP connection (``kvstore.client._http``) against scripted servers
(what the daemon may do: keep-alive, close, chunked replies, die mid-reply) and a real daemon
that restarts under it."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvstore.client import connect
from kvstore.client._conn import ConnectionLost
from kvstore.client._http import HttpConn, _closed_by_peer
from kvstore.client.spawn import start_daemon as spawn_daemon
from kvstore.errors import UsageError
from tests.conftest import SMALL_NS, chain_for, payload
from tests.kvstore.conftest import eventually

Reply = Callable[[int], tuple[bytes, bool]]
"""request number (from 1) -> what the server writes back, and whether it closes afterwards."""


def _read_request(conn: socket.socket, buf: bytearray) -> bytes | None:
    while b"\r\n\r\n" not in buf:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        buf += chunk
    head = bytes(buf).partition(b"\r\n\r\n")[0]
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    total = len(head) + 4 + length
    while len(buf) < total:
        buf += conn.recv(65536)
    req = bytes(buf[:total])
    del buf[:total]
    return req


class Server:
    """Answers each request with ``reply``; counts connections and keeps the requests."""

    def __init__(self, reply: Reply) -> None:
        self.reply = reply
        self.requests: list[bytes] = []
        self.connections = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            with conn:
                buf = bytearray()
                while (req := _read_request(conn, buf)) is not None:
                    self.requests.append(req)
                    out, close = self.reply(len(self.requests))
                    conn.sendall(out)
                    if close:
                        break

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def serve() -> Iterator[Callable[[Reply], Server]]:
    servers: list[Server] = []

    def start(reply: Reply) -> Server:
        servers.append(Server(reply))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def _ok(body: bytes = b'{"ok":true}', extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s" % (
        len(body), extra, body)


def test_one_keep_alive_connection_and_whole_requests(serve: Callable[[Reply], Server]) -> None:
    s = serve(lambda i: (_ok(b'{"n":%d}' % i), False))
    h = HttpConn(s.url + "/", {"Authorization": "Bearer tok"}, timeout=5)
    assert h.request("POST", "/v1/lookup", b'{"ns":"x"}') == (200, b'{"n":1}')
    assert h.request("GET", "/healthz") == (200, b'{"n":2}')
    assert s.connections == 1
    post, get = s.requests
    assert post.startswith(b"POST /v1/lookup HTTP/1.1\r\n") and post.endswith(b'\r\n\r\n{"ns":"x"}')
    assert b"Authorization: Bearer tok\r\n" in post and b"Content-Length: 10\r\n" in post
    assert get.startswith(b"GET /healthz HTTP/1.1\r\n") and b"Content-Length" not in get
    h.close()


def test_a_connection_the_server_closed_while_idle_is_replaced_before_sending(
    serve: Callable[[Reply], Server],
) -> None:
    # The server closes after each reply without saying so, as uvicorn's idle timeout and a
    # daemon restart do: the next request must go on a new connection, not into the dead one
    # (which would fail it, and a pin is never retried).
    s = serve(lambda i: (_ok(b'{"n":%d}' % i), True))
    h = HttpConn(s.url, {}, timeout=5)
    assert h.request("POST", "/v1/pin", b"{}") == (200, b'{"n":1}')
    assert h._sock is not None
    assert eventually(lambda: _closed_by_peer(h._sock))  # type: ignore[arg-type]
    assert h.request("POST", "/v1/pin", b"{}") == (200, b'{"n":2}')
    assert s.connections == 2


def test_connection_close_and_chunked_replies(serve: Callable[[Reply], Server]) -> None:
    chunked = (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
               b'4\r\n{"a"\r\n5;ext=1\r\n:1234\r\n1\r\n}\r\n0\r\nx-trailer: y\r\n\r\n')
    s = serve(lambda i: (chunked, False) if i == 1 else (_ok(extra=b"connection: close\r\n"), True))
    h = HttpConn(s.url, {}, timeout=5)
    assert h.request("GET", "/x") == (200, b'{"a":1234}')
    assert h.request("GET", "/y") == (200, b'{"ok":true}')
    assert h._sock is None  # "connection: close": dropped at once
    assert h.request("GET", "/z")[0] == 200
    assert s.connections == 2


@pytest.mark.parametrize(
    "reply",
    [
        b'HTTP/1.1 200 OK\r\ncontent-length: 50\r\n\r\n{"cut',  # the daemon died mid-body
        b"garbage\r\n\r\n",
        b"HTTP/1.1 2x0 OK\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: -3\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
        b"",  # closed without a word
    ],
)
def test_a_broken_reply_is_a_lost_connection(serve: Callable[[Reply], Server], reply: bytes) -> None:
    s = serve(lambda i: (reply, True) if i == 1 else (_ok(), False))
    h = HttpConn(s.url, {}, timeout=5)
    with pytest.raises(ConnectionLost):
        h.request("GET", "/v1/stats")
    assert h._sock is None  # dropped: the next request starts afresh
    assert h.request("GET", "/v1/stats") == (200, b'{"ok":true}')


def test_unreachable_and_bad_urls_and_headers() -> None:
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]
    with pytest.raises(ConnectionLost, match="cannot reach"):
        HttpConn(f"http://127.0.0.1:{port}", {}, timeout=2).request("GET", "/healthz")
    with pytest.raises(UsageError, match="http://host:port"):
        HttpConn("ftp://127.0.0.1:1", {}, timeout=2)
    with pytest.raises(UsageError, match="printable ASCII"):
        HttpConn("http://127.0.0.1:1", {"Authorization": "Bearer a\r\nX-Evil: 1"}, timeout=2)


def test_client_calls_after_a_daemon_restart_use_a_fresh_connection(tmp_path: Path) -> None:
    """A restarted daemon has closed the client's keep-alive connection and forgotten the
    client's namespaces: a pin (never retried on a lost connection: it counts) goes on a new
    connection, meets 404, and the client registers its namespaces again and pins once."""
    chain = chain_for(8, 3)
    d = spawn_daemon(tmp_path / "store")
    try:
        c = connect(d.url, plane="tcp", retries=40)
        c.put(SMALL_NS, chain, [payload(x) for x in chain])
        assert c.lookup(SMALL_NS, chain).num_blocks == 3
        assert d.stop() == 0
        d = spawn_daemon(tmp_path / "store", args=["--http-port", str(d.info["http_port"]),
                                                    "--data-port", str(d.info["data_port"])])
        assert c.pin(SMALL_NS, chain) == 3
        assert c.unpin(SMALL_NS, chain) == 3
        assert c.unpin(SMALL_NS, chain) == 0  # pinned once, not twice
        assert c.lookup(SMALL_NS, chain).num_blocks == 3
        assert c.health() == {"status": "ok"}
        c.close()
    finally:
        d.stop()
