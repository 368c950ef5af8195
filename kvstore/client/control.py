"""A daemon's control plane (HTTP): every endpoint a tool, a router or an engine adapter calls,
the admin API (``/v1/admin``) included, and the one mapping of the daemon's refusals to
kvstore.errors.

:class:`ControlClient` holds one keep-alive connection (``_http.HttpConn``) and is what
:class:`kvstore.client.Client` speaks HTTP through, what ``kvctl`` calls for ``--url``, and
what :mod:`kvstore.route` asks for event endpoints and handoffs. Replies are the daemon's JSON
as it sent it (``docs/daemon.md`` documents the shapes).

Errors, one mapping for every caller: a refusal raises the kvstore.errors class its body names
(``{"detail": message, "kind": class name}``), or for a daemon that names none the class its
HTTP status maps to (:data:`STATUS_ERRORS`), with the daemon's message; a daemon that cannot be
reached raises :class:`DaemonUnavailableError`; something that answers but is not a daemon,
:class:`NotADaemonError` (a :class:`UsageError`).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlencode

from kvstore.client._conn import ConnectionLost
from kvstore.client._http import HttpConn, NotADaemonError
from kvstore.errors import (
    AuthError,
    DaemonUnavailableError,
    ForbiddenError,
    KVStoreError,
    LayoutMismatchError,
    QuotaExceededError,
    UnknownNamespaceError,
    UsageError,
    error_class,
)
from kvstore.keys import Namespace

__all__ = ["STATUS_ERRORS", "ControlClient", "NotADaemonError", "control", "daemon_error"]

STATUS_ERRORS: dict[int, type[KVStoreError]] = {
    400: UsageError, 401: AuthError, 403: ForbiddenError, 404: UnknownNamespaceError,
    409: LayoutMismatchError, 413: UsageError, 422: UsageError, 507: QuotaExceededError,
}
"""The class of a refusal whose body names no kind this version knows (an older daemon's)."""


def daemon_error(status: int, data: bytes, url: str) -> KVStoreError:
    """The exception for the daemon's error reply ``status``/``data`` from ``url``."""
    text = data.decode(errors="replace")
    try:
        body = json.loads(data)
        detail, kind = body.get("detail", text), body.get("kind")
    except (ValueError, AttributeError):
        detail, kind = text, None
    cls = error_class(kind) or STATUS_ERRORS.get(status, KVStoreError)
    return cls(f"daemon at {url}: HTTP {status}: {detail}")


class ControlClient:
    """One daemon's control plane. Thread-safe (one request at a time on the connection)."""

    def __init__(self, url: str = "http://127.0.0.1:7070", *, token: str | None = None,
                 timeout: float = 30.0) -> None:
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = HttpConn(self.url, headers, timeout)
        self._lock = threading.Lock()

    def request(self, method: str, path: str, body: Any = None) -> Any:
        """The JSON reply of ``method path``; a refusal raises :func:`daemon_error`'s class. A
        failure on the wire raises ``ConnectionLost`` (a ``ConnectionError``), for a caller that
        reconnects and retries (:class:`kvstore.client.Client`); :meth:`call` raises
        :class:`DaemonUnavailableError` instead."""
        with self._lock:
            status, data = self._http.request(method, path, None if body is None else json.dumps(body).encode())
        if status >= 400:
            raise daemon_error(status, data, self.url)
        try:
            return json.loads(data)
        except ValueError as e:  # not the daemon (a proxy's page, say)
            raise KVStoreError(f"daemon at {self.url}: HTTP {status} with a body that is not JSON: {data[:200]!r}") from e

    def call(self, method: str, path: str, body: Any = None, *, params: dict[str, Any] | None = None) -> Any:
        """:meth:`request`, with ``params`` as the query string and a daemon that cannot be
        reached as :class:`DaemonUnavailableError`."""
        if params:
            path += "?" + urlencode({k: v for k, v in params.items() if v is not None})
        try:
            return self.request(method, path, body)
        except ConnectionLost as e:
            raise DaemonUnavailableError(
                f"kvstore daemon at {self.url} is unreachable ({method} {path}: {e}); is it running? (`kvstore serve`)"
            ) from e

    def close(self) -> None:
        with self._lock:
            self._http.close()

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- a tenant's endpoints ---------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        """``GET /healthz``: ``{"status": "ok"}``."""
        return dict(self.call("GET", "/healthz"))

    def info(self) -> dict[str, Any]:
        """``GET /v1/info``: where the data plane listens and what this tenant may use."""
        return dict(self.call("GET", "/v1/info"))

    def register_namespace(self, ns: Namespace, ttl_s: float | None = None) -> dict[str, Any]:
        """``POST /v1/namespaces``: the namespace's id (``ns``), sizes and ``layout_conflicts``."""
        return dict(self.call("POST", "/v1/namespaces", {"namespace": ns.to_dict(), "ttl_s": ttl_s}))

    def namespaces(self) -> list[dict[str, Any]]:
        """``GET /v1/namespaces``: this tenant's namespaces."""
        return list(self.call("GET", "/v1/namespaces"))

    def stats(self) -> dict[str, Any]:
        """``GET /v1/stats``: this tenant's ``usage``; for an admin also ``store`` and ``tenants``."""
        return dict(self.call("GET", "/v1/stats"))

    def pins(self, ns: str | None = None) -> dict[str, Any]:
        """``GET /v1/pins``: this tenant's pins (of namespace id ``ns``, hex), summary and budget."""
        return dict(self.call("GET", "/v1/pins", params={"ns": ns}))

    def maintain(self) -> dict[str, Any]:
        """``POST /v1/maintain`` (admin): run expiry now."""
        return dict(self.call("POST", "/v1/maintain"))

    def events(self, all_tenants: bool = False) -> dict[str, Any]:
        """``GET /v1/events``: where this tenant's KV events are published (``all_tenants``:
        every tenant's, an admin's)."""
        return dict(self.call("GET", "/v1/events", params={"all": "true"} if all_tenants else None))

    def offer_handoff(self, ns: str, hashes: Sequence[str], request_id: str, *, ttl_s: float = 30.0,
                      durable: bool = False) -> dict[str, Any]:
        """``POST /v1/handoffs``: hold a stored chain (namespace id and hashes, hex) for a decode node."""
        body = {"ns": ns, "hashes": list(hashes), "request_id": request_id, "ttl_s": ttl_s, "durable": durable}
        return dict(self.call("POST", "/v1/handoffs", body))

    def handoff(self, request_id: str) -> dict[str, Any]:
        """``GET /v1/handoffs/{request_id}``: its ``state`` (and ``reason``)."""
        return dict(self.call("GET", f"/v1/handoffs/{request_id}"))

    def confirm_handoff(self, request_id: str) -> dict[str, Any]:
        """``POST /v1/handoffs/{request_id}/confirm``: the decode side has the KV."""
        return dict(self.call("POST", f"/v1/handoffs/{request_id}/confirm"))

    # ---- the admin API (/v1/admin: an admin tenant's token, or the anonymous tenant) --------

    def admin_namespaces(self) -> dict[str, Any]:
        """Every namespace of the store, with usage and layout warnings."""
        return dict(self.call("GET", "/v1/admin/namespaces"))

    def admin_lookup(self, ns: str, hashes: Sequence[str] | None = None,
                     tokens: Sequence[int] | None = None) -> dict[str, Any]:
        """The cached prefix of ``hashes`` (hex) or ``tokens`` in namespace ``ns``, per block."""
        body: dict[str, Any] = {"ns": ns}
        if tokens is not None:
            body["tokens"] = list(tokens)
        else:
            body["hashes"] = list(hashes or [])
        return dict(self.call("POST", "/v1/admin/lookup", body))

    def admin_top(self, n: int, ns: str | None = None, by: str = "hits") -> list[dict[str, Any]]:
        """The ``n`` hottest cached prefixes (of ``ns``), ordered ``by``."""
        return list(self.call("GET", "/v1/admin/top", params={"n": n, "by": by, "ns": ns or None}))

    def admin_block(self, block: str) -> dict[str, Any]:
        """One cached block (hash, hex): its tiers, depth, hits, times."""
        return dict(self.call("GET", f"/v1/admin/blocks/{block}"))

    def admin_pins(self, ns: str | None = None) -> dict[str, Any]:
        """Every tenant's pins (of ``ns``) and a summary."""
        return dict(self.call("GET", "/v1/admin/pins", params={"ns": ns or None}))

    def admin_pin(self, prefix: dict[str, Any], until: float | None = None) -> dict[str, Any]:
        """Pin a prefix (``{"block": hex}`` or ``{"ns": ..., "hashes"/"tokens": ...}``), with a
        deadline ``until`` a retention guarantee."""
        return dict(self.call("POST", "/v1/admin/pin", {**prefix, **({"until": until} if until is not None else {})}))

    def admin_unpin(self, prefix: dict[str, Any]) -> dict[str, Any]:
        """Undo a pin of the prefix (as :meth:`admin_pin` names it)."""
        return dict(self.call("POST", "/v1/admin/unpin", prefix))

    def admin_evict(self, blocks: Sequence[str]) -> dict[str, Any]:
        """Evict these blocks (hex) and the cached blocks that extend them, unless pinned or in use."""
        return dict(self.call("POST", "/v1/admin/evict", {"blocks": list(blocks)}))

    def admin_ttl(self, ns: str, ttl_s: float) -> dict[str, Any]:
        """Set namespace ``ns``'s TTL."""
        return dict(self.call("POST", "/v1/admin/ttl", {"ns": ns, "ttl_s": ttl_s}))


def control(url: str, method: str, path: str, body: Any = None, *, token: str | None = None,
            timeout: float = 5.0) -> Any:
    """One call on a connection of its own (:meth:`ControlClient.call`): for a one-off request
    to a daemon, or to a router process (``python -m kvstore.route``), which answers the same way."""
    with ControlClient(url, token=token, timeout=timeout) as c:
        return c.call(method, path, body)
