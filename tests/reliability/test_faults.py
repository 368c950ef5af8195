"""Faults (Jepsen-style, on one node): a full disk, a read-only directory, an S3 server down or
hung, a client that dies mid-transfer, a client that never reads. The daemon keeps serving
everyone else; the client that hit the fault gets a clear error.

Device faults are injected deterministically with ``FaultyTier`` wrapped around the daemon's
own tiers; a real full and read-only filesystem (a tmpfs mounted for the test) and a real S3
server (moto, killed and SIGSTOPped) show the same without injection.
"""

from __future__ import annotations

import errno
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.client import connect
from kvstore.config import StoreConfig, TierSpec
from kvstore.errors import KVStoreError, TierIOError
from kvstore.registry import make_tier
from kvstore.server import daemon as daemon_module
from kvstore.server.config import Limits, ServerConfig
from kvstore.server.daemon import ThreadedDaemon
from kvstore.store import KVStore
from kvstore.wire import protocol as P
from tests.conftest import BB, SMALL_NS, chain_for, payload, s3_options, small_tiers
from tests.kvstore.conftest import eventually
from tests.reliability.harness import percentiles
from tiers.faulty import FaultyTier
from tools.s3server import LocalS3

LIMITS = Limits(max_body_bytes=64 * 1024, max_blocks=256, max_payload_bytes=64 * BB)


@contextmanager
def daemon(root: Path, tiers: tuple[TierSpec, ...], wrap: Callable[[list[Any]], None] | None = None,
           monkeypatch: pytest.MonkeyPatch | None = None) -> Iterator[ThreadedDaemon]:
    """A daemon on ``tiers``; ``wrap(tiers)`` may replace the built tiers (with FaultyTier)."""
    if wrap is not None:
        assert monkeypatch is not None

        def store(cfg: StoreConfig, clock: Any = time.time) -> KVStore:
            built = [make_tier(s.kind, s.name, dict(s.options), cfg.root, clock) for s in cfg.tiers]
            wrap(built)
            return KVStore(cfg, clock=clock, tiers=built)

        monkeypatch.setattr(daemon_module, "KVStore", store)
    d = ThreadedDaemon(StoreConfig(root=root, tiers=tiers), ServerConfig(http_port=0, data_port=0, ucx_port=0, limits=LIMITS))
    try:
        yield d
    finally:
        d.stop()


def _put(c: Any, seed: int, n: int = 3, durable: bool = False) -> list[bytes]:
    chain = chain_for(seed, n)
    c.put(SMALL_NS, chain, [payload(h) for h in chain], durable=durable)
    return chain


def _served(c: Any, chain: list[bytes]) -> int:
    out = np.zeros(len(chain) * BB, np.uint8)
    n = c.get_into(SMALL_NS, chain, out)
    for i in range(n):
        assert bytes(out[i * BB : (i + 1) * BB]) == payload(chain[i])
    return n


# ---- device faults, injected ------------------------------------------------------------------------


@pytest.mark.parametrize(("fault", "words"), [
    (TierIOError(errno.ENOSPC, "No space left on device"), "No space left"),
    (TierIOError(errno.EROFS, "Read-only file system"), "Read-only"),
])
def test_device_faults_fail_only_the_requests_that_need_the_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: TierIOError, words: str
) -> None:
    faulty: list[FaultyTier] = []

    def wrap(tiers: list[Any]) -> None:
        tiers[1] = FaultyTier(tiers[1])  # NVMe: the first persistent tier
        faulty.append(tiers[1])

    with daemon(tmp_path / "s", small_tiers(), wrap, monkeypatch) as d, \
            connect(d.url, plane="tcp") as a, connect(d.url, plane="shm") as b:
        kept = _put(a, 1, durable=True)
        hot = _put(b, 2)
        faulty[0].inject("write", fault, times=None)
        faulty[0].inject("delete", fault, times=None)
        with pytest.raises(KVStoreError, match=words):
            _put(a, 3, durable=True)
        # Everyone else, and the same client, carry on: loads, lookups, volatile puts.
        assert _served(b, kept) == 3 and _served(a, hot) == 3
        assert _put(b, 4) and _served(a, chain_for(4, 3)) == 3
        assert a.lookup(SMALL_NS, kept).num_blocks == 3
        # Pressure on DRAM cannot demote into the broken tier: puts still succeed (blocks go
        # to the next tier or leave) and nothing wrong is ever served.
        for s in range(10, 30):
            _put(b, s, n=2)
        faulty[0].clear()
        assert _put(a, 5, durable=True)  # the device is back: so are durable puts
        assert _served(b, chain_for(5, 3)) == 3
        assert a.stats()["store"]["tier_errors"] >= 1


# ---- a real full and read-only filesystem -------------------------------------------------------------


def test_real_full_then_read_only_filesystem_under_the_daemon(tmp_path: Path, tiny_fs: Path, figures) -> None:
    tiers = (
        TierSpec("dram", "dram", {"capacity_bytes": 64 * BB, "slab_bytes": 4 * BB}),
        TierSpec("object", "object", {"capacity_bytes": 4096 * BB, "url": f"file://{tiny_fs}/objects"}),
    )
    with daemon(tmp_path / "s", tiers) as d, connect(d.url, plane="tcp") as a, connect(d.url, plane="shm") as b:
        acked = []
        with pytest.raises(KVStoreError, match="No space left"):
            for s in range(400):  # 1 MiB holds fewer than 256 blocks of 4 KiB with headers
                acked.append(_put(a, s, n=1, durable=True))
        full_at = len(acked)
        assert full_at > 10 and all(_served(b, c) == 1 for c in acked[-5:])
        assert _put(b, 9000) and _served(a, chain_for(9000, 3)) == 3
        r = subprocess.run(["mount", "-o", "remount,ro", str(tiny_fs)], capture_output=True)
        assert r.returncode == 0, r.stderr
        with pytest.raises(KVStoreError, match="Read-only"):
            _put(a, 9001, n=1, durable=True)
        assert _served(b, acked[0]) == 1 and _served(a, chain_for(9000, 3)) == 3
        subprocess.run(["mount", "-o", "remount,rw", str(tiny_fs)], check=True)
    figures(durable_blocks_before_full=full_at)


# ---- S3 down or hung ------------------------------------------------------------------------------


def test_s3_down_or_hung_leaves_dram_hits_and_lookups_serving(tmp_path: Path, figures) -> None:
    with LocalS3() as s3:
        obj = s3_options(s3, worker_interval_s=0.2, breaker_retry_s=0.5, read_timeout_s=2.0, connect_timeout_s=1.0)
        tiers = (
            TierSpec("dram", "dram", {"capacity_bytes": 64 * BB, "slab_bytes": 4 * BB}),
            TierSpec("object", "object", {"capacity_bytes": 1 << 30, **obj}),
        )
        lat: dict[str, list[float]] = {}
        with daemon(tmp_path / "s", tiers) as d, connect(d.url, plane="tcp") as a, connect(d.url, plane="shm") as b:
            durable = _put(a, 1, durable=True)
            hot = _put(b, 2)

            def serve(phase: str) -> None:
                for _ in range(20):
                    t0 = time.perf_counter()
                    assert _served(b, hot) == 3 and _served(a, durable) == 3  # DRAM copies
                    assert a.lookup(SMALL_NS, hot).num_blocks == 3
                    lat.setdefault(phase, []).append(time.perf_counter() - t0)

            serve("up")
            s3.kill()
            with pytest.raises(KVStoreError):
                _put(a, 3, durable=True)  # a durable copy cannot be made: said, not hidden
            assert _put(b, 4)  # volatile puts carry on (DRAM, writes queued)
            serve("down")
            s3.start()  # moto restarts empty: the durable chains made before are gone with it
            s3.make_bucket(obj["url"].split("/")[2])
            assert eventually(lambda: _try_durable(a, 5), timeout=30)
            s3.pause()  # hung: connections accepted, never answered
            try:
                t0 = time.perf_counter()
                with connect(d.url, plane="tcp", timeout=10, retries=0) as c, pytest.raises(KVStoreError):
                    _put(c, 6, durable=True)  # fails: S3's answer, or this client giving up
                hung_put_s = time.perf_counter() - t0
                serve("hung")  # meanwhile (that put may still be waiting on S3) others are served
            finally:
                s3.resume()
            assert eventually(lambda: _try_durable(a, 7), timeout=30)
    figures(hung_durable_put_failed_after_s=round(hung_put_s, 2),
            dram_hit_and_lookup=({k: percentiles(v) for k, v in lat.items()}))


def test_s3_hung_demotions_do_not_stall_dram_hits(tmp_path: Path, figures) -> None:
    """Volatile puts that push DRAM's blocks down to a hung S3: the demotions are queued
    (write-behind), so hits on DRAM, and the puts themselves, go on while S3 never answers;
    once it answers again the queue drains and every demoted block is served from S3."""
    with LocalS3() as s3:
        obj = s3_options(s3, worker_interval_s=0.2, breaker_retry_s=0.5, read_timeout_s=2.0, connect_timeout_s=1.0)
        tiers = (
            TierSpec("dram", "dram", {"capacity_bytes": 16 * BB, "slab_bytes": 4 * BB}),
            TierSpec("object", "object", {"capacity_bytes": 1 << 30, **obj}),
        )
        with daemon(tmp_path / "s", tiers) as d, connect(d.url, plane="tcp") as a, connect(d.url, plane="shm") as b:
            hot = _put(b, 1)
            s3.pause()
            try:
                done: list[list[bytes]] = []
                errors: list[BaseException] = []

                def writer() -> None:
                    try:
                        for seed in range(100, 112):  # 36 blocks through a 16-block DRAM tier
                            done.append(_put(a, seed))
                    except BaseException as e:  # reported by the main thread
                        errors.append(e)

                t = threading.Thread(target=writer)
                lat: list[float] = []
                t0 = time.perf_counter()
                t.start()
                while t.is_alive() or not lat:
                    s = time.perf_counter()
                    assert _served(b, hot) == 3
                    lat.append(time.perf_counter() - s)
                t.join()
                puts_s = time.perf_counter() - t0
                assert not errors, errors
                assert len(done) == 12
                during = [_served(a, c) for c in done]  # DRAM, or the write queue
            finally:
                s3.resume()
            assert during == [3] * 12
            assert eventually(lambda: all(_served(a, c) == 3 for c in done), timeout=30)
    figures(puts_while_hung_s=round(puts_s, 2), dram_hit_while_demoting_into_hung_s3=percentiles(lat))


def _try_durable(c: Any, seed: int) -> bool:
    try:
        _put(c, seed, durable=True)
        return True
    except KVStoreError:
        return False


# ---- clients that misbehave -------------------------------------------------------------------------


def _raw(d: ThreadedDaemon) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", d.info["data_port"]), timeout=10)
    meta = b""
    s.sendall(P.encode_header(P.Op.HELLO, 1, meta, 0))
    head = s.recv(P.HEADER_BYTES, socket.MSG_WAITALL)
    hdr = P.parse_header(head, P.WireLimits(1 << 20, 1 << 30), reply=True)
    s.recv(hdr.meta_len, socket.MSG_WAITALL)
    return s


def test_a_client_dying_mid_put_or_mid_get_costs_nothing(tmp_path: Path) -> None:
    with daemon(tmp_path / "s", small_tiers()) as d, connect(d.url, plane="tcp") as good:
        good.register_namespace(SMALL_NS)
        # Mid-put: the header announces 8 blocks, 3 and a half arrive, then the client is gone.
        chain = chain_for(1, 8)
        s = _raw(d)
        meta = P.encode_put(SMALL_NS.root, chain, 0, True)
        s.sendall(P.encode_header(P.Op.PUT, 2, meta, 8 * BB) + meta + b"".join(payload(h) for h in chain[:3]) + b"x" * (BB // 2))
        s.close()
        # Mid-get: the reply is 16 blocks; the client reads one and is gone.
        big = _put(good, 2, n=16)
        s = _raw(d)
        s.sendall(P.encode_header(P.Op.GET, 3, P.encode_blocks(SMALL_NS.root, big), 0) + P.encode_blocks(SMALL_NS.root, big))
        s.recv(BB)
        s.close()
        assert good.lookup(SMALL_NS, chain).num_blocks == 0  # nothing of the cut put was stored
        assert eventually(lambda: good.delete(SMALL_NS, big) == 16)  # the cut get's lease was given back
        assert _put(good, 3) and _served(good, chain_for(3, 3)) == 3


def test_a_client_that_never_reads_does_not_slow_the_others(tmp_path: Path, figures) -> None:
    with daemon(tmp_path / "s", small_tiers(dram_blocks=64, nvme_blocks=128)) as d, connect(d.url, plane="tcp") as good:
        # 64 KiB per GET. The session of a client that never reads holds its lease, a quarter of
        # the DRAM arena, until it is gone (or FRAME_TIMEOUT_S): docs/reliability.md, limits.
        big = _put(good, 1, n=16)
        stuck = _raw(d)
        stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        meta = P.encode_blocks(SMALL_NS.root, big)
        frame = P.encode_header(P.Op.GET, 9, meta, 0) + meta
        stuck.settimeout(0.5)
        sent = 0
        try:
            for _ in range(1600):  # pipelined GETs whose replies (100 MiB) are never read
                stuck.sendall(frame)
                sent += 1
        except TimeoutError:
            pass  # the daemon stopped reading: its session is blocked sending to this client
        lat = []
        for s in range(2, 40):
            t0 = time.perf_counter()
            assert _put(good, s) and _served(good, chain_for(s, 3)) == 3
            assert _served(good, big[:8]) == 8
            lat.append(time.perf_counter() - t0)
        stuck.close()
        assert eventually(lambda: good.delete(SMALL_NS, big) == 16)  # its lease went with it
    figures(gets_queued_by_the_stuck_client=sent, others_put_get_while_stuck=percentiles(lat))
