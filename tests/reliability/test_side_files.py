"""Bad input and damaged or exposed side files (issue 14, items 9, 11, 12, 13; issue 15, items 3
and 5): what the daemon writes is its user's alone; a namespace that cannot be written back is
refused before anything is stored; damage is moved aside or refused with what to do; a full
disk does not turn a shutdown into a failure; start-up refuses before it creates anything."""

from __future__ import annotations

import http.server
import json
import os
import socket
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from kvstore.client import connect
from kvstore.client.spawn import start_daemon as spawn_daemon
from kvstore.config import StoreConfig, TierSpec
from kvstore.errors import ConfigError, KVStoreError, UsageError
from kvstore.keys import Namespace
from kvstore.retention import PINS_FILE
from kvstore.server.config import Limits, ServerConfig, TenantSpec
from kvstore.server.daemon import ThreadedDaemon
from kvstore.server.service import SECRET_FILE
from kvstore.store import KVStore
from tests.conftest import BB, SMALL_NS, chain_for, payload, small_tiers
from tests.reliability.harness import crash_tiers, write_config

TOKEN_A = "token-of-tenant-a-0123456789"


def _blocks(chain: list[bytes]) -> np.ndarray:
    return np.frombuffer(b"".join(payload(x) for x in chain), np.uint8)


def test_the_data_directory_is_the_daemons_users_alone(tmp_path: Path) -> None:
    """Item 9: slab, objects, namespaces.json (tenant salts), the event log and pins.json were
    0644 in 0755 directories."""
    cfg = write_config(tmp_path / "kvstore.toml", crash_tiers(), tenants=[{"name": "a", "token": TOKEN_A}])
    root = tmp_path / "store"
    with spawn_daemon(root, cfg) as d, connect(d.url, token=TOKEN_A, plane="tcp") as c:
        c.register_namespace(SMALL_NS)
        chain = chain_for(1, 4)
        c.put(SMALL_NS, chain, _blocks(chain), durable=True)
        c.pin(SMALL_NS, chain)
        c.close()
        assert d.stop() == 0
    seen = {p.name for p in root.rglob("*")}
    assert {"namespaces.json", PINS_FILE, SECRET_FILE} <= seen
    exposed = [f"{p.relative_to(root)} {stat.filemode(p.stat().st_mode)}"
               for p in [root, *root.rglob("*")] if not p.is_symlink() and p.stat().st_mode & 0o077]
    assert not exposed, f"readable by others: {exposed[:10]}"


def _post_namespace(url: str, raw: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/namespaces", content=raw.encode(), headers={"Content-Type": "application/json"})


def test_a_namespace_that_cannot_be_written_back_is_refused_and_never_stored(
    start_daemon: Callable[..., ThreadedDaemon], tmp_path: Path
) -> None:
    """Item 11: a lone-surrogate model_id was accepted, then GET /v1/namespaces and the admin
    listing answered 500 for good; ttl_s = Infinity was accepted; a 70 KB model_id was refused
    (400) but written to namespaces.json anyway."""
    root = tmp_path / "store"
    d = start_daemon(root=root, limits=Limits(max_body_bytes=1 << 20))
    good = SMALL_NS.to_dict()
    assert httpx.post(f"{d.url}/v1/namespaces", json={"namespace": good}).status_code == 200
    lone = json.dumps({"namespace": {**good, "model_id": "\ud800x"}})  # JSON escapes it: valid JSON
    r = _post_namespace(d.url, lone)
    assert r.status_code == 400 and "surrogate" in r.json()["detail"], r.text
    r = _post_namespace(d.url, json.dumps({"namespace": good, "ttl_s": float("inf")}))
    assert r.status_code == 422, r.text
    r = _post_namespace(d.url, json.dumps({"namespace": {**good, "model_id": "m" * 70_000}}))
    assert r.status_code == 400, r.text
    with pytest.raises(UsageError, match="control characters"):
        Namespace("a\nb", SMALL_NS.layout)
    assert httpx.get(f"{d.url}/v1/namespaces").status_code == 200
    assert httpx.get(f"{d.url}/v1/admin/namespaces").status_code == 200
    d.stop()
    stored = json.loads((root / "namespaces.json").read_text())
    assert [e["namespace"]["model_id"] for e in stored] == [SMALL_NS.model_id]
    assert all(e["ttl_s"] < float("inf") for e in stored)


def test_a_damaged_pins_json_is_moved_aside_and_the_daemon_starts(
    start_daemon: Callable[..., ThreadedDaemon], tmp_path: Path
) -> None:
    """Item 12: ``[{"namespace": 5}]`` in pins.json stopped the daemon with a bare TypeError."""
    root = tmp_path / "store"
    chain = chain_for(2, 3)
    with KVStore(StoreConfig(root=root, tiers=small_tiers())) as s:
        s.register_namespace(SMALL_NS)
        s.put(SMALL_NS, chain, _blocks(chain), durable=True)
        s.pin(SMALL_NS, chain)
    good = json.loads((root / PINS_FILE).read_text())
    (root / PINS_FILE).write_text(json.dumps([{"namespace": 5}, *good, "junk"]))
    d = start_daemon(root=root)
    assert httpx.get(f"{d.url}/healthz").status_code == 200
    aside = list(root.glob(f"{PINS_FILE}.corrupt-*"))
    assert len(aside) == 1 and "namespace" in aside[0].read_text()
    rows = httpx.get(f"{d.url}/v1/admin/pins").json()
    assert sum(len(r.get("hashes", ())) or r.get("blocks", 0) for r in rows["pins"]) == 3, rows  # the good record kept
    d.stop()
    (root / PINS_FILE).write_text("{not json")
    d = start_daemon(root=root)
    assert httpx.get(f"{d.url}/healthz").status_code == 200
    assert len(list(root.glob(f"{PINS_FILE}.corrupt-*"))) >= 1


@pytest.mark.parametrize("content", [b"", b"\x00" * 7, os.urandom(33)], ids=["empty", "short", "long"])
def test_a_damaged_server_secret_is_refused_with_what_to_do(tmp_path: Path, content: bytes) -> None:
    """Item 12: an empty or damaged server-secret was used silently, re-keying every tenant (all
    their cached blocks unreachable)."""
    root = tmp_path / "store"
    root.mkdir()
    (root / SECRET_FILE).write_bytes(content)
    cfg = ServerConfig(http_port=0, data_port=0, ucx_port=0, tenants=(TenantSpec("a", TOKEN_A),))
    with pytest.raises(ConfigError, match="server-secret.*damaged.*Restore it"):
        ThreadedDaemon(StoreConfig(root=root, tiers=small_tiers()), cfg)
    assert (root / SECRET_FILE).read_bytes() == content  # never replaced


def test_sigterm_and_a_restart_on_a_full_disk(tiny_fs: Path, tmp_path: Path) -> None:
    """Item 13: on a full disk SIGTERM exited 1 (RocksDB could not take the volatile blocks on
    close), and a restart failed at RocksDB's open. Now the shutdown ends cleanly and says what
    was not persisted, and the daemon starts again with the NVMe metadata opened read-only.
    (Re-registering a namespace without a file write is the store's part of item 13.)"""
    tiers = [("dram", "dram", {"capacity_bytes": 64 * BB, "slab_bytes": 4 * BB}),
             ("nvme", "nvme", {"capacity_bytes": 64 * BB, "slab_bytes": 4 * BB})]
    cfg = write_config(tmp_path / "kvstore.toml", tiers, events=False)
    root = tiny_fs / "store"
    with spawn_daemon(root, cfg) as d, connect(d.url, plane="tcp") as c:
        c.register_namespace(SMALL_NS)
        for i in range(12):
            chain = chain_for(10 + i, 4)
            c.put(SMALL_NS, chain, _blocks(chain))  # volatile: only in DRAM
        with open(tiny_fs / "filler", "wb") as f, pytest.raises(OSError):
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        c.close()
        code = d.stop()
        log = d.log()
    assert code == 0, log
    assert "did not persist everything" in log
    with spawn_daemon(root, cfg) as d:
        assert httpx.get(f"{d.url}/healthz").status_code == 200
        assert httpx.get(f"{d.url}/v1/stats").status_code == 200
        assert d.stop() == 0
        assert "opened its metadata DB read-only" in d.log()


def _busy_port() -> tuple[socket.socket, int]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s, s.getsockname()[1]


@pytest.mark.parametrize("plane", ["HTTP", "data"])
def test_a_port_in_use_is_named_before_the_store_is_made(tmp_path: Path, plane: str) -> None:
    """Issue 15 item 3: a port conflict was found after a 1 GiB slab and the arena were made,
    and the message named the data port even when the HTTP port was the one taken."""
    busy, port = _busy_port()
    root = tmp_path / "store"
    ports = {"http_port": port if plane == "HTTP" else 0, "data_port": port if plane == "data" else 0}
    tiers = (TierSpec("dram", "dram", {"capacity_bytes": 16 * BB, "slab_bytes": 4 * BB}),
             TierSpec("nvme", "nvme", {"capacity_bytes": 64 * BB, "slab_bytes": 4 * BB}))
    try:
        with pytest.raises(OSError, match=f"the {plane} port 127.0.0.1:{port}"):
            ThreadedDaemon(StoreConfig(root=root, tiers=tiers), ServerConfig(ucx_port=0, **ports))
    finally:
        busy.close()
    assert not list(root.rglob("*.slab")), "a slab was made before the port was known to be free"


def test_a_second_daemon_on_a_directory_names_the_holders_pid(tmp_path: Path) -> None:
    """Issue 15 item 3: a second daemon got RocksDB's lock error, not who holds the directory."""
    cfg = write_config(tmp_path / "kvstore.toml", crash_tiers(), events=False)
    with spawn_daemon(tmp_path / "store", cfg) as first, \
            pytest.raises(KVStoreError, match=f"in use by process {first.pid}"):
        spawn_daemon(tmp_path / "store", cfg)


@pytest.fixture
def not_a_daemon() -> Iterator[str]:
    """A plain web server answering HTML 404s, as a misconfigured URL would find."""
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_client_pointed_at_something_else_is_told_so(not_a_daemon: str) -> None:
    """Issue 15 item 5: this was 'UnknownNamespaceError: HTTP 404: <!DOCTYPE HTML>'."""
    with pytest.raises(UsageError, match=f"not a kvstore daemon at {not_a_daemon}"):
        connect(not_a_daemon, retries=0)
