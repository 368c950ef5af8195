"""Daemons for tests: on a background thread of the test process, on free loopback ports."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvstore.clock import Clock, system_clock
from kvstore.config import StoreConfig, TierSpec
from kvstore.server.config import Limits, ServerConfig, TenantSpec
from kvstore.server.daemon import ThreadedDaemon
from tests.conftest import small_tiers

TOKEN_A = "token-of-tenant-a-0123456789"
TOKEN_B = "token-of-tenant-b-0123456789"
TOKEN_OPS = "token-of-the-operators-01234"
TENANTS = (
    TenantSpec("a", TOKEN_A, quota_bytes=64 * 4096, allow_shm=True),
    TenantSpec("b", TOKEN_B),
    TenantSpec("ops", TOKEN_OPS, admin=True),
)


def eventually(check: Callable[[], bool], timeout: float = 30.0) -> bool:
    """Poll ``check`` until true (bounded): for what the daemon does on its own loop, like
    noticing that a client's connection closed. Not a way to make time pass."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.fixture
def start_daemon(tmp_path: Path) -> Iterator[Callable[..., ThreadedDaemon]]:
    """``start_daemon(tenants=..., root=..., tiers=..., clock=..., **server_config)``; every
    daemon started is stopped."""
    started: list[ThreadedDaemon] = []

    def start(tenants: tuple[TenantSpec, ...] = (), root: Path | None = None, *,
              tiers: tuple[TierSpec, ...] | None = None, clock: Clock = system_clock, **kw: object) -> ThreadedDaemon:
        store_cfg = StoreConfig(root=root or tmp_path / f"store{len(started)}", tiers=tiers or small_tiers())
        kw.setdefault("limits", Limits(max_body_bytes=64 * 1024, max_blocks=256, max_payload_bytes=64 * 4096))
        cfg = ServerConfig(http_port=0, data_port=0, ucx_port=0, tenants=tenants, **kw)  # type: ignore[arg-type]
        d = ThreadedDaemon(store_cfg, cfg, clock=clock)
        started.append(d)
        return d

    yield start
    for d in started:
        d.stop()
