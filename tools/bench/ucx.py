"""ucx: a hit through the daemon's UCX data plane, against raw ucxx messages of the same bytes.

Figure: ``Client.get_into`` with ``plane="ucx"`` of 64 blocks of 1 MiB from a daemon on
loopback (listener endpoints with peer error handling: see docs/daemon.md for why) into one
caller buffer: a GET_RUNS, so the daemon sends the blocks, back to back in its arena, as runs
of up to 16 MiB, one UCX message each. Two baselines, same run, interleaved: a raw ucxx
listener process sending 64 messages of 1 MiB per request to a ucxx endpoint of this process,
all posted at once on both sides, with the same UCX settings and the same progress
(:mod:`kvstore.ucxenv`) as the daemon and the client (what the daemon sent before GET_RUNS:
kept as it was, so the daemon now beats it by sending fewer, larger messages), and a raw socket
``recv_into`` of the same bytes from a sender process (the issue's yardstick, as for ``tcp``).
Goal: >= 80% of each.
Processor time: ``cpu_ucx_per_64MiB*`` rows sum this process's and the sending process's
processor time over every timed trial of each side, per 64 MiB (goal: at most 1.25x the raw
socket's, what 0.8 of its rate needs when no core is spare).
Measurement: one untimed round of each side first (endpoints, UCX's rendezvous state, the
daemon's pool warm), then ``rounds`` trials, each side once per trial in an order that rotates;
each rate is the trial with the median ratio (``trial_ratios`` lists them all).
Needs ucxx (``pip install 'kvstore-llm[ucx]'``); without it the benchmark prints why and no rows.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from tools.bench import tcp
from tools.bench._common import median_trial, result, rotating_trials
from tools.bench._daemon import BENCH_NS, TOKEN, bench_daemon, chain

_RAW_SENDER = """
import asyncio, sys
from kvstore.ucxenv import Progress, apply_ucx_env, recv_all, send_all
apply_ucx_env()  # the same UCX settings as the daemon and the client
import numpy as np, ucxx
n, bb = int(sys.argv[1]), int(sys.argv[2])
async def main():
    p = Progress.of_running_loop()
    if p is not None:
        p.hold()  # as the daemon's listener
    src = np.ones(bb, np.uint8)
    done = asyncio.Event()
    async def handler(ep):
        req = np.empty(1, np.uint8)
        try:
            while True:
                await recv_all(ep, [req])
                await send_all(ep, [src] * n)  # as the daemon sends
        except Exception:
            done.set()
    lf = ucxx.create_listener(handler, port=0, endpoint_error_handling=True, connect_timeout=60.0)
    print(lf.port, flush=True)
    await done.wait()
asyncio.run(main())
"""


def run(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    try:
        from kvstore.ucxenv import Progress, apply_ucx_env, recv_all, send_all

        apply_ucx_env()  # the client's UCX settings, before ucxx is imported
        import ucxx
    except ImportError as e:
        print(f"ucx: skipped: ucxx is not installed ({e}): pip install 'kvstore-llm[ucx]'", file=sys.stderr)
        return
    except Exception as e:
        print(f"ucx: skipped: {e}", file=sys.stderr)
        return
    from kvstore.client import connect

    n = 8 if args.quick else 64
    rounds = 3 if args.quick else 12
    bb = BENCH_NS.block_bytes
    hashes, blocks = chain(n)
    sender = subprocess.Popen([sys.executable, "-c", _RAW_SENDER, str(n), str(bb)], stdout=subprocess.PIPE, text=True)
    loop = asyncio.new_event_loop()
    try:
        port = _port(sender)

        async def connect_raw() -> tuple[Progress | None, Any]:
            p = Progress.of_running_loop()
            with p.held() if p else contextlib.nullcontext():
                return p, await ucxx.create_endpoint("127.0.0.1", port, connect_timeout=60.0)

        progress, ep = loop.run_until_complete(connect_raw())
        dst = np.ones(n * bb, np.uint8)
        views = [dst[i * bb : (i + 1) * bb] for i in range(n)]

        async def raw_round() -> None:
            await send_all(ep, [np.zeros(1, np.uint8)])
            await recv_all(ep, views)  # as the client receives

        sock_sender = subprocess.Popen([sys.executable, "-c", tcp.RAW_SENDER, str(n * bb)], stdout=subprocess.PIPE, text=True)
        sock = socket.create_connection(("127.0.0.1", _port(sock_sender)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            with bench_daemon(ucx=True) as d, connect(d.url, token=TOKEN, plane="ucx") as c, sock:
                c.put(BENCH_NS, hashes, blocks)
                cpu = {name: _CpuOf(pid) for name, pid in (("ours", d.pid), ("ucxx", sender.pid), ("socket", sock_sender.pid))}
                sides: list[tuple[str, Callable[[], None]]] = [
                    ("ours", cpu["ours"].timing(lambda: _check(c.get_into(BENCH_NS, hashes, dst), n))),
                    ("ucxx", cpu["ucxx"].timing(lambda: loop.run_until_complete(raw_round()))),
                    ("socket", cpu["socket"].timing(lambda: tcp.raw_round(sock, memoryview(dst)))),
                ]
                rates = rotating_trials(sides, rounds, n * bb / 1e9)
                c.get_into(BENCH_NS, hashes, dst)
                assert np.array_equal(dst, blocks)
                idle = _idle_ms_per_s({"client": 0, "daemon": d.pid, "raw_ucxx_sender": sender.pid})
        finally:
            sock_sender.kill()
            sock_sender.wait()
        if progress is not None:
            progress.hold()  # ucxx's close waits its own way
        loop.run_until_complete(ep.close())
        if progress is not None:
            progress.close()
    finally:
        sender.kill()
        sender.wait()
        loop.close()
    for base, metric, kind in (("ucxx", f"get_ucx_{n}x1MiB", "raw ucxx"),
                               ("socket", f"get_ucx_{n}x1MiB_vs_socket", "raw socket recv_into")):
        value, baseline, ratios = median_trial(list(zip(rates["ours"], rates[base], strict=True)))
        yield result("ucx", metric, value, "GB/s", baseline, goal_ratio=0.8, baseline_kind=kind, trial_ratios=ratios)
    # Processor time per 64 MiB moved, this process and the sending one together, summed over
    # every timed trial (the clock ticks are 10 ms; a trial is ~40 ms of it): what a plane
    # costs where every process waits for its share of the cores. 1.25x the socket's is what
    # 0.8 of its rate needs on a machine without a spare core.
    per = n * bb * rounds / (64 << 20)
    ours = cpu["ours"].total() / per * 1e3
    for base, metric, kind in (("ucxx", "cpu_ucx_per_64MiB", "raw ucxx"),
                               ("socket", "cpu_ucx_per_64MiB_vs_socket", "raw socket recv_into")):
        yield result("ucx", metric, ours, "ms", cpu[base].total() / per * 1e3, goal_ratio=1.25,
                     baseline_kind=kind, idle_ms_per_s=idle, receiver_ms=round(cpu["ours"].mine / per * 1e3, 3),
                     sender_ms=round(cpu["ours"].peer / per * 1e3, 3),
                     baseline_receiver_ms=round(cpu[base].mine / per * 1e3, 3),
                     baseline_sender_ms=round(cpu[base].peer / per * 1e3, 3))


class _CpuOf:
    """Processor seconds of this process and of process ``pid`` (the side's sender) over the
    calls of one bench side, the first (the warm-up) left out."""

    _TICK = os.sysconf("SC_CLK_TCK")

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.mine = self.peer = 0.0
        self._calls = 0

    def _peer_now(self) -> float:
        with open(f"/proc/{self.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / self._TICK  # utime + stime

    def timing(self, fn: Callable[[], None]) -> Callable[[], None]:
        def call() -> None:
            m0, p0 = time.process_time(), self._peer_now()
            fn()
            m1, p1 = time.process_time(), self._peer_now()
            self._calls += 1
            if self._calls > 1:
                self.mine += m1 - m0
                self.peer += p1 - p0
        return call

    def total(self) -> float:
        return self.mine + self.peer


def _idle_ms_per_s(pids: dict[str, int], seconds: float = 1.0) -> dict[str, float]:
    """Processor ms per second each process (0: this one) spends while nothing moves: a UCX
    progress that spins shows here (ucxx's own blocking mode: ~900), and would slow the socket
    baseline of the same run as much as the figure."""
    def now() -> dict[str, float]:
        return {k: time.process_time() if pid == 0 else _CpuOf(pid)._peer_now() for k, pid in pids.items()}

    t0, c0 = time.perf_counter(), now()
    time.sleep(seconds)  # the measurement itself: how much runs while this process sleeps
    c1, t1 = now(), time.perf_counter()
    return {k: round((c1[k] - c0[k]) / (t1 - t0) * 1e3, 1) for k in pids}


def _port(proc: subprocess.Popen[str]) -> int:
    """The port a sender process prints first (UCX writes its own log lines to stdout too)."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.strip().isdigit():
            return int(line)
        print(f"ucx: sender said: {line.rstrip()}", file=sys.stderr)
    raise RuntimeError(f"the sender process exited ({proc.wait()}) before it printed its port")


def _check(got: int, n: int) -> None:
    assert got == n, f"get_into loaded {got} of {n} blocks"
