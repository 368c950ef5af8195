"""The daemon's own configuration: ``[server]`` and ``[[tenants]]`` of the store's TOML file.

Example (same file as ``[store]`` and ``[[tiers]]``)::

    [server]
    host = "127.0.0.1"          # loopback only unless tenants with tokens are configured
    http_port = 7070            # control plane (FastAPI)
    data_port = 7071            # framed TCP data plane (also carries shared-memory leases)
    ucx = false                 # UCX data plane (needs `pip install 'kvstore-llm[ucx]'`)
    ucx_port = 7072
    max_body = "4MiB"           # HTTP request bodies
    max_blocks = 65536          # blocks (hashes) per request
    max_payload = "1GiB"        # payload bytes of one data-plane frame
    max_connections = 4096      # both planes together (also kept under RLIMIT_NOFILE)
    max_connections_per_peer = 1024  # every same-node engine is 127.0.0.1: HTTP + data each
    handshake_timeout = "10s"   # a data connection's HELLO must arrive within this
    request_timeout = "30s"     # an HTTP request's head and body; the rest of a frame header
    lease_timeout = "5min"      # a shared-memory lease not released by then is taken back
    put_device_timeout = "5s"   # a save from GPU memory waits this long for the engine's CUDA event

    [[tenants]]
    name = "team-a"
    token_env = "KVSTORE_TOKEN_TEAM_A"   # or token = "..." (at least 16 characters)
    quota = "64GiB"
    pin_quota = "8GiB"          # bytes its retention guarantees (pins with a deadline) may hold
    allow_shm = true            # may map the node's shared DRAM arena (see docs/daemon.md)

    [[tenants]]
    name = "ops"
    token_env = "KVSTORE_TOKEN_OPS"
    admin = true                # global stats, /metrics, maintenance

With no ``[[tenants]]`` every request is the anonymous tenant ``default`` (admin, shared
memory allowed), and the daemon refuses to listen on anything but loopback.

Environment overrides: ``KVSTORE_SERVER_HOST``, ``KVSTORE_SERVER_HTTP_PORT``,
``KVSTORE_SERVER_DATA_PORT``, ``KVSTORE_SERVER_UCX_PORT``, ``KVSTORE_SERVER_UCX``.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from kvstore.config import read_toml
from kvstore.errors import ConfigError
from kvstore.units import parse_duration, parse_size

ANONYMOUS = "default"
MIN_TOKEN_CHARS = 16
_MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class TenantSpec:
    """A tenant: who a bearer token is. ``quota_bytes`` 0 means unlimited. ``pin_quota_bytes``:
    the bytes of blocks its retention guarantees may hold at once (None: no limit but the
    store's ``pin_limit_fraction``; 0: no guarantees)."""

    name: str
    token: str
    quota_bytes: int = 0
    admin: bool = False
    allow_shm: bool = False
    pin_quota_bytes: int | None = None

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("-", "").replace("_", "").isalnum():
            raise ConfigError(f"tenant name {self.name!r} must be a word (letters, digits, - or _)")
        if len(self.token) < MIN_TOKEN_CHARS:
            raise ConfigError(
                f"tenant {self.name!r}: token must have at least {MIN_TOKEN_CHARS} characters; "
                "generate one with `python -c 'import secrets; print(secrets.token_urlsafe(32))'`"
            )
        if self.quota_bytes < 0:
            raise ConfigError(f"tenant {self.name!r}: quota cannot be negative")
        if self.pin_quota_bytes is not None and (
            isinstance(self.pin_quota_bytes, bool) or not isinstance(self.pin_quota_bytes, int)
            or self.pin_quota_bytes < 0
        ):
            raise ConfigError(
                f"tenant {self.name!r}: pin_quota must be a size of 0 bytes or more (like '8GiB'), "
                f"got {self.pin_quota_bytes!r}; leave it out for no per-tenant limit"
            )

    def __repr__(self) -> str:  # never print a token into a log
        return (f"TenantSpec(name={self.name!r}, quota_bytes={self.quota_bytes}, "
                f"pin_quota_bytes={self.pin_quota_bytes}, admin={self.admin})")


@dataclass(frozen=True, slots=True)
class Limits:
    """Size limits on every request; larger ones are refused with a message (HTTP 413, or an
    error frame and the connection closed)."""

    max_body_bytes: int = 4 * _MiB
    """HTTP request bodies."""
    max_blocks: int = 65_536
    """Blocks (hashes) per request."""
    max_tokens: int = 1 << 22
    """Token ids per request (a lookup or pin by tokens)."""
    max_payload_bytes: int = 1 << 30
    """Payload bytes of one data-plane frame."""
    max_staging_bytes: int = 512 * _MiB
    """A client's shared-memory staging segment (the PUT_SHM path)."""
    max_leases: int = 4096
    """Leases one data-plane connection may hold at once."""
    max_connections: int = 4096
    """Open connections of both planes together; the daemon also keeps it under its
    RLIMIT_NOFILE (less room for the store's own files). A connection over a limit is closed at
    once, so the clients already connected keep being served."""
    max_connections_per_peer: int = 1024
    """Open connections from one address (every same-node engine is 127.0.0.1, and a client
    holds two: HTTP and data)."""
    handshake_timeout_s: float = 10.0
    """A data-plane connection must complete its HELLO within this, or it is closed."""
    request_timeout_s: float = 30.0
    """An HTTP request's head and body must arrive within this (from its first byte, or from
    the connection or the previous reply); so must the rest of a data-plane frame header."""
    lease_timeout_s: float = 300.0
    """A shared-memory lease (ACQUIRE) not released by then is released by the daemon."""
    put_device_timeout_s: float = 5.0
    """How long a PUT_DEVICE waits for its copies out of the engine's GPU memory (they wait for
    the engine's CUDA event first); past it the save fails, nothing stored, and its arena slots
    stay set aside until the copies are done."""
    max_lease_fraction: float = 0.5
    """Of the first tier (the arena), what one tenant's leases may hold at once (with more than
    one tenant)."""
    max_inflight_bytes_per_tenant: int = 1 << 30
    """Payload bytes of one tenant's puts being received at once (more wait: TCP backpressure);
    one put of any allowed size is always admitted when the tenant has none in flight."""
    max_pins_per_tenant: int = 1024
    """Pin records (untimed and timed) one tenant may hold."""
    max_namespaces_per_tenant: int = 1024
    """Namespaces one tenant may register (one per model deployment and layout)."""
    max_handoff_bytes_per_tenant: int = 64 * _MiB
    """Bytes of one tenant's open handoff records (about 90 bytes a block they name, 640 a
    handoff; the daemon's memory and ``handoffs.json``); an offer past it is refused (507) and
    counted (``kvstore_handoffs_refused_total``). Open handoffs also hold a pin each, under
    ``max_pins_per_tenant``."""
    handoff_history_bytes: int = 16 * _MiB
    """Bytes of finished (released, expired, lost) handoff records kept for status queries, all
    tenants together (about 700 bytes each: a finished record keeps no block keys); the oldest
    are forgotten first (counted in ``kvstore_handoffs_forgotten_total``, logged once per burst)."""

    def __post_init__(self) -> None:
        for k in ("max_body_bytes", "max_blocks", "max_tokens", "max_payload_bytes",
                  "max_staging_bytes", "max_leases", "max_connections", "max_connections_per_peer",
                  "max_inflight_bytes_per_tenant", "max_pins_per_tenant", "max_namespaces_per_tenant",
                  "max_handoff_bytes_per_tenant", "handoff_history_bytes"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ConfigError(f"[server] {k} must be a positive integer, got {v!r}")
        for k in ("handshake_timeout_s", "request_timeout_s", "lease_timeout_s", "put_device_timeout_s"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int | float) or not 0 < v < float("inf"):
                raise ConfigError(f"[server] {k.removesuffix('_s')} must be a positive duration like '10s', got {v!r}")
        if not 0 < self.max_lease_fraction <= 1:
            raise ConfigError(f"[server] max_lease_fraction must be in (0, 1], got {self.max_lease_fraction!r}")

    @property
    def max_meta_bytes(self) -> int:
        """Metadata of one frame: a namespace id, a few integers and the hashes."""
        return 64 + 16 * self.max_blocks


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    """Address both planes bind; anything but loopback needs ``[[tenants]]`` with tokens."""
    http_port: int = 7070
    """Control plane (HTTP: FastAPI, ``/metrics``, ``/docs``); 0 picks a free port."""
    data_port: int = 7071
    """Framed TCP data plane (also carries shared-memory leases); 0 picks a free port."""
    ucx: bool = False
    """Also serve the UCX data plane (needs ``pip install 'kvstore-llm[ucx]'``)."""
    ucx_port: int = 7072
    """UCX data plane's port; 0 picks a free one."""
    tenants: tuple[TenantSpec, ...] = ()
    limits: Limits = field(default_factory=Limits)
    maintain_interval_s: float = 30.0
    """How often the daemon runs store.maintain() (expiry, persisted refreshes) and refreshes
    tenant usage for quotas."""
    threads: int = 8
    """Worker threads for blocking store calls."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "tenants", tuple(self.tenants))
        for port in (self.http_port, self.data_port, self.ucx_port):
            if not 0 <= port < 65536:
                raise ConfigError(f"[server] port {port} is outside 0..65535 (0 picks a free one)")
        if self.threads < 1 or self.maintain_interval_s <= 0:
            raise ConfigError("[server] threads and maintain_interval must be positive")
        names = [t.name for t in self.tenants]
        if len(set(names)) != len(names):
            raise ConfigError(f"[[tenants]] names must be unique, got {names}")
        if ANONYMOUS in names:
            raise ConfigError(f"tenant name {ANONYMOUS!r} is reserved for the anonymous tenant")
        tokens = [t.token for t in self.tenants]
        if len(set(tokens)) != len(tokens):
            raise ConfigError("[[tenants]] tokens must be unique (a token names one tenant)")
        if self.ucx and not self.tenants:
            raise ConfigError(
                "[server] ucx = true needs [[tenants]] with tokens: a UCX listener binds every "
                "interface (ucxx takes no bind address), so its sessions must authenticate"
            )
        if not self.tenants and not is_loopback(self.host):
            raise ConfigError(
                f"[server] host {self.host!r} is not loopback, but no [[tenants]] with tokens are "
                "configured; the anonymous tenant is loopback-only: add tenants or bind 127.0.0.1"
            )


def check_exposure(config: ServerConfig, publish: str | None, replay: str | None = None) -> None:
    """ConfigError when the KV event stream (``[events] publish``/``replay``) would leave the
    machine unauthenticated: with no ``[[tenants]]`` it carries every block hash and prompt
    token with no authentication, so, like the anonymous tenant's ports, it binds loopback only."""
    if config.tenants:
        return  # every stream authenticates (ZeroMQ PLAIN with the tenants' tokens)
    for what, url in (("publish", publish), ("replay", replay)):
        m = re.match(r"^tcp://([^:/]+):\d+$", url or "")
        if m is not None and not is_loopback(m.group(1).strip("[]")):
            raise ConfigError(
                f"[events] {what} = {url!r} is not loopback, but no [[tenants]] with tokens are "
                "configured: the event stream would carry every block hash and prompt token off "
                "the machine unauthenticated. Bind it to 127.0.0.1, or configure [[tenants]] "
                "(each stream then authenticates with their tokens)"
            )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
        except OSError:
            return False


_SERVER_KEYS: dict[str, tuple[str, Any]] = {
    "host": ("host", str),
    "http_port": ("http_port", int),
    "data_port": ("data_port", int),
    "ucx": ("ucx", bool),
    "ucx_port": ("ucx_port", int),
    "maintain_interval": ("maintain_interval_s", parse_duration),
    "threads": ("threads", int),
}
_LIMIT_KEYS: dict[str, tuple[str, Any]] = {
    "max_body": ("max_body_bytes", parse_size),
    "max_blocks": ("max_blocks", int),
    "max_tokens": ("max_tokens", int),
    "max_payload": ("max_payload_bytes", parse_size),
    "max_staging": ("max_staging_bytes", parse_size),
    "max_leases": ("max_leases", int),
    "max_connections": ("max_connections", int),
    "max_connections_per_peer": ("max_connections_per_peer", int),
    "handshake_timeout": ("handshake_timeout_s", parse_duration),
    "request_timeout": ("request_timeout_s", parse_duration),
    "lease_timeout": ("lease_timeout_s", parse_duration),
    "put_device_timeout": ("put_device_timeout_s", parse_duration),
    "max_lease_fraction": ("max_lease_fraction", float),
    "max_inflight_per_tenant": ("max_inflight_bytes_per_tenant", parse_size),
    "max_pins_per_tenant": ("max_pins_per_tenant", int),
    "max_namespaces_per_tenant": ("max_namespaces_per_tenant", int),
    "max_handoff_bytes_per_tenant": ("max_handoff_bytes_per_tenant", parse_size),
    "handoff_history_bytes": ("handoff_history_bytes", parse_size),
}


def _convert(where: str, conv: Any, v: Any) -> Any:
    if conv is bool:
        if isinstance(v, bool):
            return v
        if str(v).lower() in ("1", "true", "yes", "0", "false", "no"):
            return str(v).lower() in ("1", "true", "yes")
        raise ConfigError(f"{where}: expected true or false, got {v!r}")
    try:
        return conv(v) if conv in (int, str, float) else conv(v, where)
    except (TypeError, ValueError) as e:
        if conv in (int, float):
            kind = "an integer" if conv is int else "a number"
            raise ConfigError(f"{where}: expected {kind}, got {v!r}") from e
        raise ConfigError(f"{where}: {e}") from e


def _tenant(i: int, t: Mapping[str, Any], env: Mapping[str, str]) -> TenantSpec:
    where = f"[[tenants]] #{i + 1}"
    known = {"name", "token", "token_env", "quota", "pin_quota", "admin", "allow_shm"}
    if unknown := set(t) - known:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}; known: {', '.join(sorted(known))}")
    if "name" not in t:
        raise ConfigError(f"{where} needs a name")
    token = t.get("token")
    if "token_env" in t:
        token = env.get(str(t["token_env"]))
        if not token:
            raise ConfigError(f"{where}: environment variable {t['token_env']} (token_env) is not set")
    if not token:
        raise ConfigError(f"{where} needs token = '...' or token_env = 'VARIABLE'")
    return TenantSpec(
        name=str(t["name"]),
        token=str(token),
        quota_bytes=parse_size(t.get("quota", 0), f"{where}.quota"),
        admin=_convert(f"{where}.admin", bool, t.get("admin", False)),
        allow_shm=_convert(f"{where}.allow_shm", bool, t.get("allow_shm", False)),
        pin_quota_bytes=parse_size(t["pin_quota"], f"{where}.pin_quota") if "pin_quota" in t else None,
    )


def load_server_config(
    path: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    **overrides: Any,
) -> ServerConfig:
    """``[server]`` and ``[[tenants]]`` of ``path`` (None: defaults), env overrides, validated."""
    env = os.environ if env is None else env
    data = read_toml(path)
    section = dict(data.get("server", {}))
    where = {k: f"[server].{k}" for k in section}
    for key in ("host", "http_port", "data_port", "ucx_port", "ucx"):
        if (v := env.get(var := f"KVSTORE_SERVER_{key.upper()}")) is not None:
            section[key] = v
            where[key] = f"{var} (overrides [server].{key})"  # an error names the variable
    kwargs: dict[str, Any] = {}
    limits: dict[str, Any] = {}
    for k, v in section.items():
        if k in _SERVER_KEYS:
            name, conv = _SERVER_KEYS[k]
            kwargs[name] = _convert(where[k], conv, v)
            if k.endswith("_port") and not 0 <= kwargs[name] <= 65535:
                raise ConfigError(f"{where[k]}: port {kwargs[name]} is outside 0..65535 (0 picks a free one)")
        elif k in _LIMIT_KEYS:
            name, conv = _LIMIT_KEYS[k]
            limits[name] = _convert(f"[server].{k}", conv, v)
        else:
            raise ConfigError(
                f"[server]: unknown key {k!r}; known: {', '.join([*_SERVER_KEYS, *_LIMIT_KEYS])}"
            )
    kwargs["limits"] = Limits(**limits)
    kwargs["tenants"] = tuple(_tenant(i, t, env) for i, t in enumerate(data.get("tenants", [])))
    cfg = ServerConfig(**kwargs)
    return replace(cfg, **overrides) if overrides else cfg
