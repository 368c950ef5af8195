"""The client's control-plane connection: one keep-alive HTTP/1.1 connection on a plain socket.

An engine asks the daemon for a lookup before every prefill, so this is the hot path of the
control plane. Client CPU per lookup request, measured here (docs/benchmarks.md, rpc): httpx
~0.45 ms, ``http.client`` ~0.12 ms, this ~0.04 ms. Both libraries also write the headers and the
body of a request in two sends, which costs the daemon a second wake-up per request; this writes
a request in one. It speaks the HTTP/1.1 the daemon (uvicorn) does: Content-Length or chunked
replies, keep-alive unless ``Connection: close``. One request at a time: the client's lock
serialises calls.

A connection the daemon closed while it sat idle (uvicorn drops idle keep-alive connections
after 5 s; a daemon restart drops them all) is noticed before the next request is sent, by a
zero-timeout poll, and replaced: a request is never written into a socket known to be dead.
Any failure on the wire raises :class:`ConnectionLost` and drops the connection; the client
reconnects and retries idempotent calls.
"""

from __future__ import annotations

import select
import socket
import ssl
from urllib.parse import urlsplit

from kvstore.client._conn import ConnectionLost, lost
from kvstore.errors import UsageError

DAEMON_HEADER = b"x-kvstore-daemon"
"""Every reply of a kvstore daemon carries it (kvstore.server.app)."""


class NotADaemonError(UsageError):
    """Something answered on the URL, but not a kvstore daemon (a web server, another service)."""

MAX_HEAD = 64 * 1024
"""Status line and headers of a reply, at most (the daemon sends a few hundred bytes)."""


class _Reply:
    """Reads one reply from the socket into ``buf`` (bytes past the reply stay there: the
    connection is then dropped, as nothing should follow a reply)."""

    def __init__(self, sock: socket.socket, buf: bytearray) -> None:
        self.sock = sock
        self.buf = buf

    def _fill(self) -> None:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise ConnectionLost("the daemon closed the control connection mid-reply")
        self.buf += chunk

    def _line(self) -> bytes:
        while (i := self.buf.find(b"\r\n")) < 0:
            if len(self.buf) > MAX_HEAD:
                raise ConnectionLost("malformed reply from the daemon: a line without an end")
            self._fill()
        line = bytes(self.buf[:i])
        del self.buf[: i + 2]
        return line

    def _take(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._fill()
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    def head(self) -> tuple[int, bool, dict[bytes, bytes]]:
        """Status, whether the reply is HTTP/1.1, and the headers (names in lower case)."""
        while (end := self.buf.find(b"\r\n\r\n")) < 0:
            if len(self.buf) > MAX_HEAD:
                raise ConnectionLost(f"malformed reply from the daemon: headers over {MAX_HEAD} bytes")
            self._fill()
        lines = bytes(self.buf[:end]).split(b"\r\n")
        del self.buf[: end + 4]
        version, _, rest = lines[0].partition(b" ")
        code = rest[:3]
        if not version.startswith(b"HTTP/1.") or len(code) != 3 or not code.isdigit():
            raise ConnectionLost(f"malformed reply from the daemon: {lines[0][:100]!r}")
        headers: dict[bytes, bytes] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep:
                raise ConnectionLost(f"malformed header from the daemon: {line[:100]!r}")
            name = name.strip().lower()
            value = value.strip()
            headers[name] = headers[name] + b", " + value if name in headers else value
        return int(code), version == b"HTTP/1.1", headers

    def body(self, headers: dict[bytes, bytes]) -> tuple[bytes, bool]:
        """The body, and whether it ran to the end of the connection."""
        if b"chunked" in headers.get(b"transfer-encoding", b"").lower():
            parts: list[bytes] = []
            while True:
                size = int(self._line().split(b";", 1)[0].strip(), 16)
                if size < 0:
                    raise ValueError(f"chunk size {size}")
                if size == 0:
                    while self._line():  # trailers, up to the empty line
                        pass
                    return b"".join(parts), False
                parts.append(self._take(size))
                if self._take(2) != b"\r\n":
                    raise ConnectionLost("malformed chunk from the daemon")
        length = headers.get(b"content-length")
        if length is not None:
            n = int(length)
            if n < 0:
                raise ValueError(f"Content-Length {n}")
            return self._take(n), False
        while True:  # neither: the body runs to the end of the connection
            chunk = self.sock.recv(65536)
            if not chunk:
                out = bytes(self.buf)
                self.buf.clear()
                return out, True
            self.buf += chunk


class HttpConn:
    def __init__(self, url: str, headers: dict[str, str], timeout: float) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise UsageError(f"the daemon's URL must be http://host:port, got {url!r}")
        self._tls = ssl.create_default_context() if parts.scheme == "https" else None
        self._host = parts.hostname
        self._port = parts.port or (443 if self._tls else 80)
        self._prefix = parts.path.rstrip("/")
        self.url = url
        host = f"[{self._host}]" if ":" in self._host else self._host
        if parts.port:
            host += f":{parts.port}"
        fixed = {"Host": host, "Accept": "application/json", **headers}
        for k, v in fixed.items():
            if not (k + v).isascii() or not (k + v).isprintable():
                raise UsageError(f"the {k} header must be printable ASCII (a token with a newline or non-ASCII?)")
        self._fixed = "".join(f"{k}: {v}\r\n" for k, v in fixed.items()).encode("ascii")
        self.timeout = timeout
        self._sock: socket.socket | None = None
        self._buf = bytearray()

    def _open(self) -> socket.socket:
        try:
            sock = socket.create_connection((self._host, self._port), timeout=self.timeout)
        except OSError as e:
            raise lost(f"cannot reach the control plane at {self._host}:{self._port}", e) from e
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is not None:
                sock = self._tls.wrap_socket(sock, server_hostname=self._host)
        except OSError as e:
            sock.close()
            raise ConnectionLost(f"cannot set up the control connection to {self._host}:{self._port}: {e}") from e
        return sock

    def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        """Status and body of one request; raises :class:`ConnectionLost` if it did not complete."""
        sock = self._sock
        if sock is not None and _closed_by_peer(sock):
            self.close()
            sock = None
        if sock is None:
            sock = self._sock = self._open()
            self._buf.clear()
        head = b"%s %s HTTP/1.1\r\n" % (method.encode("ascii"), (self._prefix + path).encode("ascii"))
        if body is not None:
            head += b"%sContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % (self._fixed, len(body))
        elif method in ("POST", "PUT", "PATCH"):
            head += b"%sContent-Length: 0\r\n\r\n" % self._fixed
        else:
            head += self._fixed + b"\r\n"
        try:
            sock.sendall(head + body if body else head)  # one write: headers and body together
            reply = _Reply(sock, self._buf)
            status, http11, headers = reply.head()
            while 100 <= status < 200:  # interim replies (100 Continue): the real one follows
                status, http11, headers = reply.head()
            if method == "HEAD" or status in (204, 304):
                data, to_eof = b"", False
            else:
                data, to_eof = reply.body(headers)
        except ConnectionLost:
            self.close()
            raise
        except (OSError, ValueError) as e:
            self.close()
            raise ConnectionLost(f"control plane {method} {path} failed: {e!r}") from e
        conn = headers.get(b"connection", b"").lower()
        if to_eof or self._buf or b"close" in conn or (not http11 and b"keep-alive" not in conn):
            self.close()
        ctype = headers.get(b"content-type", b"").lower()
        if DAEMON_HEADER not in headers and b"json" not in ctype and (status >= 300 or b"html" in ctype):
            # Neither the daemon's mark nor JSON (a daemon older than the mark, or a proxy in
            # front of one, still answers JSON), but an error or a page: an HTML 404 must not
            # read as "unknown namespace".
            self.close()
            kind = headers.get(b"content-type", b"no content type").decode("latin-1")[:60]
            raise NotADaemonError(
                f"not a kvstore daemon at {self.url}: {method} {path} was answered HTTP {status} "
                f"({kind}); check the URL and port (the daemon prints its URL when it starts)"
            )
        return status, data

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._buf.clear()


def _closed_by_peer(sock: socket.socket) -> bool:
    """An idle keep-alive socket that is readable has been closed (or sent what nobody asked
    for): either way it cannot carry the next request."""
    p = select.poll()
    p.register(sock, select.POLLIN | select.POLLPRI)
    if not p.poll(0):
        return False
    if not isinstance(sock, ssl.SSLSocket):
        return True
    timeout = sock.gettimeout()  # TLS: the readable bytes may be a session ticket, not data
    sock.settimeout(0)
    try:
        sock.recv(1)
        return True  # data or EOF
    except ssl.SSLWantReadError:
        return False
    except OSError:
        return True
    finally:
        sock.settimeout(timeout)
