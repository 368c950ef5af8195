"""UCX settings the daemon and the client set before ucxx is imported (an operator's own
environment wins: only unset variables are filled in), and how both sides post transfers."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine
from typing import Any

UCX_ENV_DEFAULTS: dict[str, str] = {
    # A blocking progress thread: no core busy-polling on a small machine.
    "UCXPY_PROGRESS_MODE": "blocking",
    # UCX must not warn about the variables below when a transport does not use them.
    "UCX_WARN_UNUSED_ENV_VARS": "n",
    # The TCP transport copies through segments of 8 KiB (send) and 64 KiB (receive) by
    # default; 1 MiB ones moved 1 MiB blocks several times faster here (docs/benchmarks.md).
    # Over 16 MiB UCX fails (openucx/ucx#7043).
    "UCX_TCP_TX_SEG_SIZE": "1M",
    "UCX_TCP_RX_SEG_SIZE": "1M",
    # Rendezvous by the receiver reading (get) instead of the sender writing, over socket buffers
    # of 4 MiB: raw ucxx moved 64 x 1 MiB at 0.66-0.77 of a raw socket with both, 0.40-0.47
    # with UCX's defaults, in the same minutes (load 15-22, docs/benchmarks.md). Each alone
    # gave about half of that; 16 MiB buffers less than 4 MiB.
    "UCX_RNDV_SCHEME": "get_zcopy",
    "UCX_TCP_SNDBUF": "4M",
    "UCX_TCP_RCVBUF": "4M",
}


def apply_ucx_env() -> None:
    for key, value in UCX_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)


async def transfer_all(ops: list[Coroutine[Any, Any, Any]]) -> None:
    """Run ucxx sends or receives of one endpoint concurrently; the first failure is raised once
    every one has ended.

    Each posts its request at its first step, in list order, and messages of one tag match in
    the order they were posted, so the bytes land as if awaited one by one. Awaited one by one,
    every 1 MiB message waited for its own rendezvous round trips (a wake-up of both processes
    each): on a loaded 2-core machine that ran at a tenth of a raw socket."""
    if len(ops) == 1:
        await ops[0]
        return
    for r in await asyncio.gather(*ops, return_exceptions=True):
        if isinstance(r, BaseException):
            raise r
