"""The UCX data plane (runs where ucxx is installed: `pip install 'kvstore-llm[ucx]'`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from kvstore.errors import ConfigError, DaemonUnavailableError
from kvstore.server.config import ServerConfig
from kvstore.server.daemon import ThreadedDaemon
from tests.conftest import BB, SMALL_NS, chain_for, payload
from tests.kvstore.conftest import TENANTS, TOKEN_A, TOKEN_B

ROOT = Path(__file__).resolve().parents[3]


def test_ucx_needs_tenants_because_its_listener_binds_every_interface() -> None:
    with pytest.raises(ConfigError, match="binds every"):
        ServerConfig(ucx=True)


def test_round_trip_over_ucx(start_daemon: Callable[..., ThreadedDaemon]) -> None:
    pytest.importorskip("ucxx", reason="ucxx not installed (pip install 'kvstore-llm[ucx]')")
    from kvstore.client import connect

    d = start_daemon(TENANTS, ucx=True)
    assert d.info["ucx_port"]
    chain = chain_for(1, 6)
    blocks = np.frombuffer(b"".join(payload(x) for x in chain), np.uint8)
    with connect(d.url, token=TOKEN_A, plane="ucx") as a:
        assert a.plane == "ucx"
        assert a.put(SMALL_NS, chain, blocks) == 6
        out = np.zeros(6 * BB, np.uint8)
        assert a.get_into(SMALL_NS, chain, out) == 6
        assert np.array_equal(out, blocks)
        # No loop of this process progresses ucxx's worker by spinning: the daemon's and the
        # client's loops are driven by kvstore.ucxenv.Progress (ucxx's own blocking mode spins),
        # and a client with nothing in flight does not even watch the worker's fd.
        from ucxx._lib_async.application_context import ProgressTasks

        from kvstore.ucxenv import Progress

        assert ProgressTasks and all(isinstance(t, Progress) for t in ProgressTasks.values())
        assert a._conn is not None
        client = a._conn.t._progress  # type: ignore[union-attr]
        assert isinstance(client, Progress) and not client.watching, "an idle client does not watch"
        assert any(p.watching for p in Progress._all.values()), "the daemon's listener does"
    with connect(d.url, token=TOKEN_B, plane="ucx") as b:  # isolation holds on UCX too
        assert b.get_into(SMALL_NS, chain, np.zeros(6 * BB, np.uint8)) == 0


def test_a_ucx_client_called_from_inside_a_running_event_loop(start_daemon: Callable[..., ThreadedDaemon]) -> None:
    """The client runs its UCX loop in the calling thread; a caller already inside an event loop
    (a blocking call from async code) gets it run on a helper thread, and the calls still work."""
    pytest.importorskip("ucxx", reason="ucxx not installed (pip install 'kvstore-llm[ucx]')")
    import asyncio

    from kvstore.client import connect

    d = start_daemon(TENANTS, ucx=True)
    chain = chain_for(3, 4)
    blocks = np.frombuffer(b"".join(payload(x) for x in chain), np.uint8)

    async def inside() -> np.ndarray:
        with connect(d.url, token=TOKEN_A, plane="ucx") as c:
            assert c.put(SMALL_NS, chain, blocks) == 4
            out = np.zeros(4 * BB, np.uint8)
            assert c.get_into(SMALL_NS, chain, out) == 4
            return out

    assert np.array_equal(asyncio.run(inside()), blocks)


def _ucx_config(tmp_path: Path) -> Path:
    """A daemon config with the UCX listener on and one tenant (``TOKEN_A``), for a daemon
    started as its own process."""
    config = tmp_path / "kvstore.toml"
    config.write_text(textwrap.dedent(f"""
        [server]
        ucx = true
        [[tenants]]
        name = "a"
        token = "{TOKEN_A}"
    """))
    return config


def test_clients_killed_mid_transfer_over_ucx_never_take_the_daemon_down(tmp_path: Path) -> None:
    """The trade-off docs/daemon.md describes, checked with real processes: the daemon's UCX
    endpoints run with peer error handling, so a client SIGKILLed in the middle of its puts and
    gets ends its own session only; the daemon (its own process) keeps serving UCX clients."""
    pytest.importorskip("ucxx", reason="ucxx not installed (pip install 'kvstore-llm[ucx]')")
    from kvstore.client import connect
    from kvstore.client.spawn import start_daemon

    config = _ucx_config(tmp_path)
    script = textwrap.dedent("""
        import sys
        import numpy as np
        from kvstore.client import connect
        from tests.conftest import BB, SMALL_NS, chain_for, payload
        url, token = sys.argv[1], sys.argv[2]
        with connect(url, token=token, plane="ucx") as c:
            chain = chain_for(7, 32)
            blocks = np.frombuffer(b"".join(payload(x) for x in chain), np.uint8)
            out = np.zeros(32 * BB, np.uint8)
            print("ready", flush=True)
            while True:  # killed somewhere in here, mid-frame sooner or later
                c.put(SMALL_NS, chain, blocks)
                c.get_into(SMALL_NS, chain, out)
    """)
    with start_daemon(tmp_path / "store", config=config) as d:
        for i, kill_after in enumerate((0.05, 0.2, 0.5)):
            chain = chain_for(100 + i, 6)
            blocks = np.frombuffer(b"".join(payload(x) for x in chain), np.uint8)
            child = subprocess.Popen([sys.executable, "-c", script, d.url, TOKEN_A], cwd=ROOT,
                                     stdout=subprocess.PIPE, text=True)
            try:
                assert child.stdout is not None and child.stdout.readline().strip() == "ready"
                time.sleep(kill_after)  # lets the child get into its transfers; not a timing check
            finally:
                child.kill()
                child.wait(timeout=30)
            assert d.proc.poll() is None, d.log()[-2000:]
            with connect(d.url, token=TOKEN_A, plane="ucx") as c:
                assert c.put(SMALL_NS, chain, blocks) == 6
                out = np.zeros(6 * BB, np.uint8)
                assert c.get_into(SMALL_NS, chain, out) == 6 and np.array_equal(out, blocks)
        assert d.proc.poll() is None


def test_a_frozen_daemon_fails_a_ucx_call_with_daemon_unavailable_not_a_hang(tmp_path: Path) -> None:
    """The UCX client runs its loop in the calling thread now: a call to a daemon that stopped
    answering (SIGSTOP, a real process) must still end within the client's timeout with
    DaemonUnavailableError, the error an engine treats as a miss, and the same client must
    work again once the daemon resumes."""
    pytest.importorskip("ucxx", reason="ucxx not installed (pip install 'kvstore-llm[ucx]')")
    from kvstore.client import connect
    from kvstore.client.spawn import start_daemon

    config = _ucx_config(tmp_path)
    chain = chain_for(5, 4)
    blocks = np.frombuffer(b"".join(payload(x) for x in chain), np.uint8)
    with (
        start_daemon(tmp_path / "store", config=config) as d,
        connect(d.url, token=TOKEN_A, plane="ucx", timeout=10.0, retries=1) as c,
    ):
        assert c.put(SMALL_NS, chain, blocks) == 4
        out = np.zeros(4 * BB, np.uint8)
        os.kill(d.pid, signal.SIGSTOP)
        try:
            with pytest.raises(DaemonUnavailableError):
                c.get_into(SMALL_NS, chain, out)
        finally:
            os.kill(d.pid, signal.SIGCONT)
        out[:] = 0
        assert c.get_into(SMALL_NS, chain, out) == 4
        assert out.tobytes() == blocks.tobytes()
