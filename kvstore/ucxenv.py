"""UCX settings the daemon and the client set before ucxx is imported (an operator's own
environment wins: only unset variables are filled in)."""

from __future__ import annotations

import os

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
}


def apply_ucx_env() -> None:
    for key, value in UCX_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
