"""Load: 64 concurrent clients (4 processes of 16; half on shared memory, half on TCP) mix
lookups, loads and puts against one daemon for a bounded time. Zero errors, zero wrong bytes;
p50/p99 latency per operation and throughput are reported (not asserted).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvstore.client import connect
from kvstore.client.spawn import start_daemon
from tests.conftest import SMALL_NS, payload
from tests.reliability.harness import Tally, chain_of, crash_tiers, percentiles, pick, write_config

CLIENTS, PROCESSES = 64, 4
SECONDS = pick(8.0, 120.0)
PRELOADED = 256
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_64_clients_mixing_lookups_loads_and_puts(tmp_path: Path, figures) -> None:
    config = write_config(tmp_path / "kvstore.toml", crash_tiers(dram_blocks=4096, nvme_blocks=8192))
    with start_daemon(tmp_path / "store", config) as d:
        with connect(d.url, plane="tcp") as c:
            for s in range(PRELOADED):
                chain = chain_of(s)
                c.put(SMALL_NS, chain, [payload(h) for h in chain])
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        cmd = [sys.executable, "-m", "tests.reliability.load_client", d.url, str(CLIENTS // PROCESSES), str(SECONDS)]
        t0 = time.perf_counter()
        procs = [subprocess.Popen([*cmd, str(p), str(PRELOADED)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for p in range(PROCESSES)]
        total = Tally()
        for p in procs:
            out, err = p.communicate(timeout=SECONDS + 300)
            assert p.returncode == 0, err[-3000:]
            total.merge(Tally.from_json(json.loads(out)))
        wall = time.perf_counter() - t0
        with connect(d.url, plane="tcp") as c:
            stats = c.stats()["store"]
        assert d.stop() == 0
    assert total.errors == [], total.errors[:5]
    assert total.wrong_blocks == []
    ops = sum(total.ops.values())
    figures(
        clients=CLIENTS, seconds=SECONDS, ops=dict(total.ops), errors=0, wrong_blocks=0,
        throughput_ops_s=round(ops / SECONDS, 1), wall_s_with_start_up=round(wall, 1),
        blocks_served_and_verified=total.served_blocks, block_hit_rate=round(stats["block_hit_rate"], 3),
        latencies={op: percentiles(xs) for op, xs in total.latencies.items()},
    )
