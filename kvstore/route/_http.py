"""A control call to a daemon (``/v1/events``, ``/v1/handoffs``): one request, JSON in and out."""

from __future__ import annotations

import http.client
import json
from typing import Any
from urllib.parse import urlsplit

from kvstore.errors import DaemonUnavailableError, KVStoreError, error_class


def control(url: str, method: str, path: str, body: Any = None, *, token: str | None = None,
            timeout: float = 5.0) -> Any:
    """``method path`` on the daemon at ``url``; a refusal raises the kvstore.errors class its
    body names, an unreachable daemon :class:`DaemonUnavailableError`."""
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port or 80, timeout=timeout)
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    try:
        conn.request(method, path, None if body is None else json.dumps(body).encode(), headers)
        resp = conn.getresponse()
        data = resp.read()
    except OSError as e:
        raise DaemonUnavailableError(f"daemon at {url} unreachable ({method} {path}): {e}") from e
    finally:
        conn.close()
    try:
        out = json.loads(data)
    except ValueError as e:
        raise KVStoreError(f"daemon at {url}: HTTP {resp.status} with a body that is not JSON: {data[:200]!r}") from e
    if resp.status >= 400:
        detail = out.get("detail", out) if isinstance(out, dict) else out
        kind = out.get("kind") if isinstance(out, dict) else None
        raise (error_class(kind) or KVStoreError)(f"daemon at {url}: HTTP {resp.status}: {detail}")
    return out
