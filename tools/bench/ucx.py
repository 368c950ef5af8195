"""ucx: a hit through the daemon's UCX data plane, against raw ucxx messages of the same bytes.

Figure: ``Client.get_into`` with ``plane="ucx"`` of 64 blocks of 1 MiB from a daemon on
loopback (listener endpoints with peer error handling: see docs/daemon.md for why) into one
caller buffer: a GET_RUNS, so the daemon sends the blocks, back to back in its arena, as runs
of up to 16 MiB, one UCX message each. Two baselines, same run, interleaved: a raw ucxx
listener process sending 64 messages of 1 MiB per request to a ucxx endpoint of this process,
all posted at once on both sides (the same kind of endpoint; what the daemon sent before
GET_RUNS: kept as it was, so the daemon now beats it by sending fewer, larger messages), and a
raw socket ``recv_into`` of the same bytes from a sender process (the issue's yardstick, as for
``tcp``). Goal: >= 80% of each.
Measurement: one untimed round of each side first (endpoints, UCX's rendezvous state, the
daemon's pool warm), then ``rounds`` trials, each side once per trial in an order that rotates;
each figure is the trial with the median ratio (``trial_ratios`` lists them all).
Needs ucxx (``pip install 'kvstore[ucx]'``); without it the benchmark prints why and no rows.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from tools.bench import tcp
from tools.bench._common import median_trial, result, rotating_trials
from tools.bench._daemon import BENCH_NS, TOKEN, bench_daemon, chain

_RAW_SENDER = """
import asyncio, sys
from kvstore.ucxenv import apply_ucx_env, transfer_all
apply_ucx_env()  # the same UCX settings as the daemon and the client
import numpy as np, ucxx
n, bb = int(sys.argv[1]), int(sys.argv[2])
async def main():
    src = np.ones(bb, np.uint8)
    done = asyncio.Event()
    async def handler(ep):
        req = np.empty(1, np.uint8)
        try:
            while True:
                await ep.recv(req)
                await transfer_all([ep.send(src) for _ in range(n)])  # as the daemon sends
        except Exception:
            done.set()
    lf = ucxx.create_listener(handler, port=0, endpoint_error_handling=True)
    print(lf.port, flush=True)
    await done.wait()
asyncio.run(main())
"""


def run(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    try:
        from kvstore.ucxenv import apply_ucx_env, transfer_all

        apply_ucx_env()  # the client's UCX settings, before ucxx is imported
        import ucxx
    except ImportError as e:
        print(f"ucx: skipped: ucxx is not installed ({e}): pip install 'kvstore[ucx]'", file=sys.stderr)
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
        assert sender.stdout is not None
        port = int(sender.stdout.readline())
        ep = loop.run_until_complete(ucxx.create_endpoint("127.0.0.1", port))
        dst = np.ones(n * bb, np.uint8)
        views = [dst[i * bb : (i + 1) * bb] for i in range(n)]

        async def raw_round() -> None:
            await ep.send(np.zeros(1, np.uint8))
            await transfer_all([ep.recv(v) for v in views])  # as the client receives

        sock_sender = subprocess.Popen([sys.executable, "-c", tcp.RAW_SENDER, str(n * bb)], stdout=subprocess.PIPE, text=True)
        assert sock_sender.stdout is not None
        sock = socket.create_connection(("127.0.0.1", int(sock_sender.stdout.readline())))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            with bench_daemon(ucx=True) as d, connect(d.url, token=TOKEN, plane="ucx") as c, sock:
                c.put(BENCH_NS, hashes, blocks)
                sides: list[tuple[str, Callable[[], None]]] = [
                    ("ours", lambda: _check(c.get_into(BENCH_NS, hashes, dst), n)),
                    ("ucxx", lambda: loop.run_until_complete(raw_round())),
                    ("socket", lambda: tcp.raw_round(sock, memoryview(dst))),
                ]
                rates = rotating_trials(sides, rounds, n * bb / 1e9)
                c.get_into(BENCH_NS, hashes, dst)
                assert np.array_equal(dst, blocks)
        finally:
            sock_sender.kill()
            sock_sender.wait()
        loop.run_until_complete(ep.close())
    finally:
        sender.kill()
        sender.wait()
        loop.close()
    for base, metric, kind in (("ucxx", f"get_ucx_{n}x1MiB", "raw ucxx"),
                               ("socket", f"get_ucx_{n}x1MiB_vs_socket", "raw socket recv_into")):
        value, baseline, ratios = median_trial(list(zip(rates["ours"], rates[base], strict=True)))
        yield result("ucx", metric, value, "GB/s", baseline, goal_ratio=0.8, baseline_kind=kind, trial_ratios=ratios)


def _check(got: int, n: int) -> None:
    assert got == n, f"get_into loaded {got} of {n} blocks"
