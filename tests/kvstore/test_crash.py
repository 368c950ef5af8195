"""Crash safety: SIGKILL a writer in the middle of sustained durable puts, reopen, verify.

Nothing acknowledged as durable may be lost, and no torn or corrupt block may ever be served.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np

from kvstore.config import StoreConfig
from kvstore.store import KVStore
from tests.conftest import BB, SMALL_NS, chain_for, payload, small_tiers

REPO = Path(__file__).resolve().parents[2]


def run_writer_until(root: Path, first: int, acks_wanted: int) -> list[int]:
    """Start the writer, read its acks until ``acks_wanted``, then SIGKILL it mid-stream."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.kvstore.crash_writer", str(root), str(first)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    acked: list[int] = []
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            acked.append(int(line))
            if len(acked) >= acks_wanted:
                break
    finally:
        proc.send_signal(signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, err
    assert len(acked) >= acks_wanted, f"writer stopped early: {err}"
    return acked


def verify(root: Path, acked: list[int], upto: int) -> int:
    """Every acked chain is whole and correct; anything else served is correct too."""
    with KVStore(StoreConfig(root=root, tiers=small_tiers(8, 64, 4096))) as store:
        assert [ns for ns, _ in store.namespaces()] == [SMALL_NS]
        served = 0
        ackset = set(acked)
        for i in range(upto):
            chain = chain_for(i, 3, shared_prefix_blocks=1)
            buf = np.zeros(3 * BB, dtype=np.uint8)
            n = store.get_into(SMALL_NS, chain, buf)
            if i in ackset:
                assert n == 3, f"acknowledged durable chain {i} lost ({n} of 3 blocks)"
            for b in range(n):
                assert buf[b * BB : (b + 1) * BB].tobytes() == payload(chain[b]), f"chain {i} block {b} is wrong"
            served += n
        assert store.stats()["corrupt_blocks"] == 0
        return served


def test_sigkill_during_durable_puts_loses_nothing_acknowledged(tmp_path: Path) -> None:
    root = tmp_path / "store"
    acked: list[int] = []
    first = 0
    for want in (25, 40, 15):  # three crashes, each reopening what the last one left
        got = run_writer_until(root, first, want)
        acked += got
        first = got[-1] + 1
        served = verify(root, acked, first + 3)
        assert served >= 3 * len(acked)
