"""The data plane: bad frames close only their own connection; leases die with their client."""

from __future__ import annotations

import socket
from collections.abc import Callable

import numpy as np
import pytest

from kvstore.client import connect
from kvstore.errors import DaemonUnavailableError, UsageError
from kvstore.server.daemon import ThreadedDaemon
from kvstore.wire import protocol as P
from tests.conftest import BB, SMALL_NS, chain_for, payload
from tests.kvstore.conftest import TENANTS, TOKEN_A, TOKEN_B, eventually

LIMITS = P.WireLimits(1 << 20, 1 << 30)


class Raw:
    """A hand-driven data-plane connection."""

    def __init__(self, d: ThreadedDaemon) -> None:
        self.sock = socket.create_connection(("127.0.0.1", d.info["data_port"]), timeout=10)

    def send_frame(self, op: P.Op, meta: bytes, payload: bytes = b"", req_id: int = 1) -> None:
        self.sock.sendall(P.encode_header(op, req_id, meta, len(payload)) + meta + payload)

    def reply(self) -> tuple[P.Header, bytes, bytes]:
        head = self._recv(P.HEADER_BYTES)
        hdr = P.parse_header(head, LIMITS, reply=True)
        meta = self._recv(hdr.meta_len)
        P.check_crc(head, meta, hdr.crc)
        return hdr, meta, self._recv(hdr.payload_len)

    def error(self) -> tuple[P.ErrorCode, str]:
        hdr, meta, _ = self.reply()
        assert hdr.op is P.Op.ERROR
        return P.parse_error(meta)

    def closed(self) -> bool:
        return self.sock.recv(1) == b""

    def _recv(self, n: int) -> bytes:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            k = self.sock.recv_into(view[got:])
            assert k, "connection closed early"
            got += k
        return bytes(buf)


@pytest.mark.parametrize(
    ("raw_bytes", "code"),
    [
        (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", P.ErrorCode.BAD_FRAME),
        (P.encode_header(P.Op.GET, 1, b"", 0)[:24] + b"\0\0\0\0", P.ErrorCode.BAD_FRAME),  # bad crc
        (P.HEADER.pack(P.MAGIC, P.VERSION, P.Op.PUT, 0, 1, 0, 1 << 40, 0), P.ErrorCode.TOO_LARGE),
        (P.HEADER.pack(P.MAGIC, P.VERSION, P.Op.GET, 0, 1, 1 << 30, 0, 0), P.ErrorCode.TOO_LARGE),
        (P.encode_header(P.Op.GET, 1, b"", 0), P.ErrorCode.UNAUTHENTICATED),  # no HELLO first
    ],
)
def test_bad_frames_get_an_error_frame_and_a_closed_connection(
    start_daemon: Callable[..., ThreadedDaemon], raw_bytes: bytes, code: P.ErrorCode
) -> None:
    d = start_daemon()
    with connect(d.url, plane="tcp") as good:
        chain = chain_for(1, 2)
        good.put(SMALL_NS, chain, [payload(x) for x in chain])
        bad = Raw(d)
        bad.sock.sendall(raw_bytes.ljust(P.HEADER_BYTES, b"\0"))
        assert bad.error()[0] is code
        assert bad.closed()
        # The daemon and its other clients carry on.
        assert good.get_into(SMALL_NS, chain, np.zeros(2 * BB, np.uint8)) == 2


def test_request_errors_keep_the_connection(start_daemon: Callable[..., ThreadedDaemon]) -> None:
    d = start_daemon()
    raw = Raw(d)
    raw.send_frame(P.Op.HELLO, b"")
    assert raw.reply()[0].op is P.Op.REPLY
    unknown = P.encode_put(b"\1" * 16, [b"h" * 16], 0, False)
    raw.send_frame(P.Op.PUT, unknown, b"x" * BB, req_id=2)  # payload drained, then the error
    code, msg = raw.error()
    assert code is P.ErrorCode.NOT_FOUND and "not registered" in msg
    raw.send_frame(P.Op.GET, P.encode_blocks(b"\1" * 16, []), req_id=3)
    assert raw.error()[0] is P.ErrorCode.NOT_FOUND
    raw.send_frame(P.Op.STAGING, P.encode_u64(1 << 62), req_id=4)
    assert "staging size" in raw.error()[1]


def test_bad_token_on_the_data_plane(start_daemon: Callable[..., ThreadedDaemon]) -> None:
    d = start_daemon(TENANTS)
    raw = Raw(d)
    raw.send_frame(P.Op.HELLO, b"wrong-token-wrong-token")
    assert raw.error()[0] is P.ErrorCode.UNAUTHENTICATED
    assert raw.closed()


def test_shared_memory_needs_the_tenants_grant(start_daemon: Callable[..., ThreadedDaemon]) -> None:
    d = start_daemon(TENANTS)
    with connect(d.url, token=TOKEN_B) as b:
        assert b.plane == "tcp"  # auto: b has no allow_shm
    raw = Raw(d)
    raw.send_frame(P.Op.HELLO, TOKEN_B.encode())
    raw.reply()
    raw.send_frame(P.Op.STAGING, P.encode_u64(4096), req_id=2)
    assert raw.error()[0] is P.ErrorCode.FORBIDDEN
    with connect(d.url, token=TOKEN_A) as a:
        assert a.plane == "shm"


def test_a_daemon_out_of_descriptors_serves_a_shared_memory_client_over_the_socket(
    start_daemon: Callable[..., ThreadedDaemon], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The arena's descriptor cannot be copied for a client (EMFILE: the daemon is at its
    descriptor limit): HELLO still succeeds, without the arena, and the client moves its blocks
    over the socket; once descriptors are free again, a new client gets the arena."""
    import errno

    from kvstore.wire.fdpass import FdServer

    d = start_daemon(TENANTS)
    offer = FdServer.offer

    def no_descriptors(*a: object, **k: object) -> bytes:
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(FdServer, "offer", no_descriptors)
    chain = chain_for(5, 3)
    with connect(d.url, token=TOKEN_A) as a:
        assert a.plane == "tcp" and not a.info["arena"] and not a.info["put_device"]
        a.put(SMALL_NS, chain, [payload(x) for x in chain])
        out = np.zeros(3 * BB, np.uint8)
        assert a.get_into(SMALL_NS, chain, out) == 3
        assert out.tobytes() == b"".join(payload(x) for x in chain)
    monkeypatch.setattr(FdServer, "offer", offer)
    with connect(d.url, token=TOKEN_A) as a:
        assert a.plane == "shm"


def test_leases_of_a_closed_connection_are_released(start_daemon: Callable[..., ThreadedDaemon]) -> None:
    d = start_daemon()
    chain = chain_for(2, 3)
    with connect(d.url) as c:
        c.put(SMALL_NS, chain, [payload(x) for x in chain])
        lease = c.acquire(SMALL_NS, chain)
        assert [bytes(v[:16]) for v in lease.views] == chain
        assert c.delete(SMALL_NS, chain) == 0  # held: nothing leaves
        lease.release()
        lease2 = c.acquire(SMALL_NS, chain)
        assert lease2.num_blocks == 3
        # the client goes away without releasing lease2 (as a crashed engine would)
    with connect(d.url) as other:  # the daemon notices the close on its own loop
        assert eventually(lambda: other.delete(SMALL_NS, chain) == 3)


def test_a_staging_segment_still_viewed_at_session_end_is_closed_later() -> None:
    """A put in flight when its session ends still holds a view of the staging bytes: the
    segment (a memfd, which no other process can open by any name) is closed once the view is
    gone, never while it is alive."""
    from kvstore.server import dataplane
    from kvstore.shm import Segment, memfd_segment

    class Ended:
        staging: Segment | None = memfd_segment(4096, "test-staging")

    session = Ended()
    seg = session.staging
    assert seg is not None
    view = seg.buf[0:16]  # what an in-flight put holds
    dataplane.Session._close_staging(session)  # type: ignore[arg-type]
    assert session.staging is None and seg in dataplane._LINGERING
    view.release()
    dataplane.close_lingering()  # (other tests' segments may still be viewed: only this one counts)
    assert seg not in dataplane._LINGERING
    with pytest.raises(ValueError, match="closed"):
        seg.buf  # noqa: B018 (closed)


@pytest.mark.parametrize("cap_blocks", [2, 64])
def test_get_runs_sends_the_payload_in_runs_within_the_callers_runs(
    start_daemon: Callable[..., ThreadedDaemon], monkeypatch: pytest.MonkeyPatch, cap_blocks: int
) -> None:
    from kvstore.server import dataplane

    monkeypatch.setattr(dataplane, "RUN_MESSAGE_BYTES", cap_blocks * BB)
    d = start_daemon()
    chain = chain_for(4, 6)
    with connect(d.url, plane="tcp") as c:
        assert c.info["get_runs"]
        c.put(SMALL_NS, chain, [payload(x) for x in chain])
        ns_id = c._ns_id(SMALL_NS)
    raw = Raw(d)
    raw.send_frame(P.Op.HELLO, b"")
    raw.reply()
    caller = [2, 3, 1]
    raw.send_frame(P.Op.GET_RUNS, P.encode_get_runs(ns_id, chain, caller), req_id=2)
    hdr, meta, body = raw.reply()
    count, bb, msgs = P.parse_runs_meta(meta)
    assert (hdr.req_id, count, bb) == (2, 6, BB)
    assert body == b"".join(payload(x) for x in chain)
    assert max(msgs) <= cap_blocks
    ends = {sum(msgs[: i + 1]) for i in range(len(msgs))}
    assert {2, 5, 6} <= ends  # no message crosses a run of the caller's
    raw.send_frame(P.Op.GET_RUNS, P.encode_get_runs(ns_id, chain, [7]), req_id=3)
    assert raw.error()[0] is P.ErrorCode.BAD_FRAME  # runs that do not cut the blocks: refused


def test_a_staged_put_stores_what_the_caller_wrote_into_its_segment(
    start_daemon: Callable[..., ThreadedDaemon],
) -> None:
    """``Client.staging`` / ``put_staged`` (a GPU's copy straight into the daemon's staging
    segment, no client checksum): the blocks land as written, a later chain extends them, a
    range outside the segment is a usage error, a segment of an earlier connection is refused,
    and another tenant reads none of it."""
    d = start_daemon(TENANTS)
    chain = chain_for(7, 4)
    with connect(d.url, token=TOKEN_A) as c:
        c.register_namespace(SMALL_NS)
        seg = c.staging(4 * BB)
        for i, h in enumerate(chain[:2]):
            seg.buf[BB + i * BB : BB + (i + 1) * BB] = payload(h)
        assert c.put_staged(SMALL_NS, chain[:2], seg, offset=BB) == 2
        for i, h in enumerate(chain[2:]):
            seg.buf[i * BB : (i + 1) * BB] = payload(h)
        assert c.put_staged(SMALL_NS, chain, seg, start=2) == 2
        out = np.zeros(4 * BB, np.uint8)
        assert c.get_into(SMALL_NS, chain, out) == 4
        assert [bytes(out[i * BB : (i + 1) * BB]) for i in range(4)] == [payload(h) for h in chain]
        with pytest.raises(UsageError, match="outside"):
            c.put_staged(SMALL_NS, chain, seg, offset=seg.size - BB)
        c._disconnect()  # a new connection: a new segment
        with pytest.raises(DaemonUnavailableError, match="staging"):
            c.put_staged(SMALL_NS, chain, seg)
    with connect(d.url, token=TOKEN_B) as b:
        b.register_namespace(SMALL_NS)
        assert b.lookup(SMALL_NS, chain).num_blocks == 0  # per-tenant keys


def test_an_unchecked_flag_is_refused_on_a_plain_put() -> None:
    meta = bytearray(P.encode_put(b"\0" * P.NS_ID_BYTES, [b"\1" * 16], 0, False))
    meta[P.NS_ID_BYTES + 8] |= P.PUT_UNCHECKED
    with pytest.raises(P.ProtocolError, match="flags"):
        P.parse_put(bytes(meta), 16)
    shm = P.parse_put(P.encode_put(b"\0" * P.NS_ID_BYTES, [b"\1" * 16], 0, False, 0, None), 16, shm=True)
    assert shm.checksums is None


def test_put_device_round_trips_and_is_refused_where_the_daemon_has_no_gpu(
    start_daemon: Callable[..., ThreadedDaemon],
) -> None:
    """PUT_DEVICE's metadata round-trips and refuses flags; a daemon that cannot load CUDA (CI)
    says ``put_device: false`` and answers a PUT_DEVICE with a clear refusal, storing nothing."""
    handle = bytes(range(64))
    req = P.parse_put_device(P.encode_put_device(b"\2" * P.NS_ID_BYTES, [b"\1" * 16, b"\3" * 16], 1, 0, handle,
                                                 4096, 1 << 20), 16)
    assert (req.start, req.device, req.offset, req.size, req.handle) == (1, 0, 4096, 1 << 20, handle)
    bad = bytearray(P.encode_put_device(b"\2" * P.NS_ID_BYTES, [b"\1" * 16], 0, 0, handle, 0, 64))
    bad[P.NS_ID_BYTES + 8] = 2  # no such flag (a durable put goes through PUT)
    with pytest.raises(P.ProtocolError, match="flags"):
        P.parse_put_device(bytes(bad), 16)
    d = start_daemon(TENANTS)
    chain = chain_for(8, 2)
    with connect(d.url, token=TOKEN_A) as c:
        assert c.plane == "shm"
        assert c.info["put_device_event"] == c.info["put_device"]
        if c.info["put_device"]:
            pytest.skip("this machine's daemon can copy from a GPU (tests/engine/test_transfer.py covers it)")
        c.register_namespace(SMALL_NS)
        raw = Raw(d)
        raw.send_frame(P.Op.HELLO, TOKEN_A.encode())
        raw.reply()
        raw.send_frame(P.Op.PUT_DEVICE, P.encode_put_device(c._ns_id(SMALL_NS), chain, 0, 0, handle, 0, 2 * BB), req_id=2)
        code, message = raw.error()
        assert code is P.ErrorCode.BAD_REQUEST and "PUT_SHM" in message
        with pytest.raises(UsageError, match="put_device"):
            c.put_device(SMALL_NS, chain, device=0, handle=handle, offset=0, size=2 * BB)
        assert c.lookup(SMALL_NS, chain).num_blocks == 0
