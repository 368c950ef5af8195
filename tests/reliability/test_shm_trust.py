"""Shared memory, tried from other processes (issue 14, item 8): a tenant without shared memory
that runs as the daemon's user used to map ``/dev/shm/kvs-<pid>-dram-*`` and read *and write*
every tenant's bytes, and a tenant with it could overwrite another's staging segment before its
PUT_SHM. Now no segment has a name to open, a client's arena mapping is read-only (and a process
of another user handed its descriptor cannot make it writable), and every PUT_SHM is checked
against the checksums the client computed."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from kvstore.client import connect
from kvstore.client.spawn import start_daemon
from kvstore.errors import UsageError
from kvstore.shm import _RECEIVED
from kvstore.wire import protocol as P
from tests.conftest import BB, SMALL_NS, chain_for, payload
from tests.reliability.harness import crash_tiers, write_config

TOKEN_A = "token-of-tenant-a-0123456789"
TOKEN_B = "token-of-tenant-b-0123456789"


def _blocks(chain: list[bytes]) -> np.ndarray:
    return np.frombuffer(b"".join(payload(x) for x in chain), np.uint8)


@pytest.fixture
def daemon(tmp_path: Path):  # type: ignore[no-untyped-def]
    cfg = write_config(tmp_path / "kvstore.toml", crash_tiers(), events=False, tenants=[
        {"name": "a", "token": TOKEN_A, "allow_shm": True},
        {"name": "b", "token": TOKEN_B},
    ])
    with start_daemon(tmp_path / "store", cfg) as d:
        yield d


def test_no_process_can_open_the_arena_or_a_staging_segment_by_name(daemon) -> None:  # type: ignore[no-untyped-def]
    with connect(daemon.url, token=TOKEN_A, plane="shm") as a:
        a.register_namespace(SMALL_NS)
        chain = chain_for(1, 4)
        assert a.put(SMALL_NS, chain, _blocks(chain)) == 4  # through a staging segment
        out = np.zeros(4 * BB, np.uint8)
        assert a.get_into(SMALL_NS, chain, out) == 4 and out.tobytes() == _blocks(chain).tobytes()
        names = sorted(os.listdir("/dev/shm"))
        mine = [n for n in names if n.startswith(f"kvs-{daemon.pid}-") or n.startswith("kvs-stage-")]
        assert not mine, f"segments anyone of this user can open: {mine}"


def test_a_clients_arena_mapping_is_read_only_and_stays_so_for_another_user(daemon) -> None:  # type: ignore[no-untyped-def]
    with connect(daemon.url, token=TOKEN_A, plane="shm") as a:
        a.register_namespace(SMALL_NS)
        chain = chain_for(2, 2)
        a.put(SMALL_NS, chain, _blocks(chain))
        with a.acquire(SMALL_NS, chain) as lease:
            assert bytes(lease.views[0]) == payload(chain[0])
        arena = a._arena  # noqa: SLF001 (the client's own mapping)
        assert arena is not None and arena.buf.readonly
        with pytest.raises(TypeError):
            arena.buf[0:1] = b"x"
        fd = _RECEIVED[a.info["arena"]]
        python = "/usr/bin/python3"  # one that user nobody may run (the venv's may sit under /root)
        if os.getuid() != 0 or not os.access(python, os.X_OK):
            pytest.skip("checking another user's view needs root and a system python3")
        probe = (
            "import mmap, os, sys\n"
            "fd = int(sys.argv[1]); size = os.fstat(fd).st_size\n"
            "m = mmap.mmap(fd, size, access=mmap.ACCESS_READ); m.close()\n"
            "for what, f in (('map writable', lambda: mmap.mmap(fd, size, access=mmap.ACCESS_WRITE)),\n"
            "                ('reopen writable', lambda: os.open(f'/proc/self/fd/{fd}', os.O_RDWR))):\n"
            "    try:\n"
            "        f(); print('WRITABLE', what); sys.exit(1)\n"
            "    except PermissionError:\n"
            "        pass\n"
            "print('read-only')\n"
        )
        r = subprocess.run([python, "-c", probe, str(fd)], pass_fds=[fd], capture_output=True, text=True,
                           user=65534, group=65534, timeout=60)
        assert r.returncode == 0 and "read-only" in r.stdout, r.stdout + r.stderr


def test_a_put_over_shm_whose_staged_bytes_do_not_match_their_checksums_is_refused(daemon) -> None:  # type: ignore[no-untyped-def]
    """What a forgery between the client's write and the daemon's read would look like: the
    daemon stores nothing and says why."""
    with connect(daemon.url, token=TOKEN_A, plane="shm") as a:
        a.register_namespace(SMALL_NS)
        chain = chain_for(3, 2)
        assert a.put(SMALL_NS, chain[:1], _blocks(chain[:1])) == 1  # makes the staging segment
        conn = a._conn  # noqa: SLF001
        staging = a._staging  # noqa: SLF001
        assert conn is not None and staging is not None
        staging.buf[:BB] = payload(chain[1])
        staged_checksum = P.encode_put(a._ns_id(SMALL_NS), chain, 1, False, 0, [12345])  # noqa: SLF001
        with pytest.raises(UsageError, match="does not match its checksum"):
            conn.call(P.Op.PUT_SHM, staged_checksum)
        assert a.lookup(SMALL_NS, chain).num_blocks == 1
        assert a.put(SMALL_NS, chain, _blocks(chain[1:]), start=1) == 1  # the right ones go in


def test_the_arena_has_no_name_wherever_it_is_in_the_tiers(tmp_path: Path) -> None:
    """The daemon maps, unlinks and hands out the store's arena (the tier its leases live in),
    here DRAM under a null tier: not the first tier's."""
    tiers = [("fast", "null", {"capacity_blocks": 2}), *crash_tiers()[:2]]
    cfg = write_config(tmp_path / "kvstore.toml", tiers, events=False)
    with start_daemon(tmp_path / "store", cfg) as d, connect(d.url, plane="shm") as c:
        c.register_namespace(SMALL_NS)
        chain = chain_for(3, 6)
        assert c.put(SMALL_NS, chain, _blocks(chain)) == 6
        with c.acquire(SMALL_NS, chain) as lease:
            assert lease.num_blocks == 6
        mine = [n for n in os.listdir("/dev/shm") if n.startswith(f"kvs-{d.pid}-")]
        assert not mine, f"segments anyone of this user can open: {mine}"
