"""The daemon process: graceful SIGTERM, and a client killed mid-lease cannot hurt it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

from kvstore.client import connect
from kvstore.client.spawn import start_daemon
from tests.conftest import BB, SMALL_NS, chain_for, payload
from tests.kvstore.conftest import eventually

ROOT = Path(__file__).resolve().parents[3]


def test_sigterm_closes_the_store_and_a_restart_keeps_the_blocks(tmp_path: Path) -> None:
    chain = chain_for(1, 4)
    with start_daemon(tmp_path / "store") as d:
        with connect(d.url) as c:
            c.put(SMALL_NS, chain, [payload(x) for x in chain])
        assert d.stop() == 0
        assert "Traceback" not in d.log()
    with start_daemon(tmp_path / "store") as d, connect(d.url, plane="tcp") as c:
        r = c.lookup(SMALL_NS, chain)
        assert r.num_blocks == 4 and "dram" not in r.tiers  # persisted on close, read back from disk
        out = np.zeros(4 * BB, np.uint8)
        assert c.get_into(SMALL_NS, chain, out) == 4
        assert bytes(out[:BB]) == payload(chain[0])


def test_a_client_killed_while_holding_a_lease(tmp_path: Path) -> None:
    chain = chain_for(2, 3)
    with start_daemon(tmp_path / "store") as d:
        with connect(d.url) as c:
            c.put(SMALL_NS, chain, [payload(x) for x in chain])
        script = textwrap.dedent(f"""
            import os, signal
            from kvstore.client import connect
            from tests.conftest import SMALL_NS, chain_for
            c = connect({d.url!r}, plane="shm")
            lease = c.acquire(SMALL_NS, chain_for(2, 3))
            assert lease.num_blocks == 3
            os.kill(os.getpid(), signal.SIGKILL)  # dies holding the lease and a mapping
        """)
        out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                             timeout=120, check=False)
        assert out.returncode == -9, out.stderr
        with connect(d.url) as c:
            assert eventually(lambda: c.delete(SMALL_NS, chain) == 3)  # the lease died with its connection
            assert c.stats()["store"]["blocks"] == 0
        assert d.proc.poll() is None


def test_startup_objects_are_frozen_out_of_the_collectors_reach() -> None:
    """What a daemon process made before it serves is moved to the permanent generation (a
    full collection then scans only later objects), and its threads trade the interpreter
    every half millisecond at most."""
    import gc
    import sys

    from kvstore.server.daemon import SWITCH_INTERVAL_S, freeze_startup_objects

    before, interval = gc.get_freeze_count(), sys.getswitchinterval()
    try:
        freeze_startup_objects()
        assert gc.get_freeze_count() > before
        assert sys.getswitchinterval() == SWITCH_INTERVAL_S < interval
    finally:
        gc.unfreeze()
        sys.setswitchinterval(interval)
