"""The UCX data plane (optional: ``pip install 'kvstore-llm[ucx]'``, which brings ``ucxx-cu12``).

Same sessions and frames as TCP (:mod:`kvstore.server.dataplane`); on UCX each header,
metadata and block (in a GET_RUNS reply: each run of blocks, up to 16 MiB) travels as one
tagged message.

The trade-off (measured on the 2-core dev machines, see docs/daemon.md): endpoints that a
*listener* makes always run with peer error handling, which keeps UCX on its TCP transport
(~1.6-1.8 GB/s); endpoints made from a *worker address* with error handling off reach 5-7 GB/s
over shared memory, but a client killed mid-transfer then aborts the whole server process. A
crashing client must never take the daemon down, so the daemon uses a listener with error
handling on. Same-node clients get more from the shared-memory plane anyway.

A UCX listener binds every interface (ucxx takes no bind address), so the config refuses
``ucx = true`` without ``[[tenants]]``: every session authenticates with its token.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvstore.errors import ConfigError
from kvstore.server.dataplane import (
    Channel,
    ChannelClosed,
    DataContext,
    Session,
    lease_check_interval,
    reap_leases,
    stop_sessions,
)
from kvstore.ucxenv import Progress, apply_ucx_env, recv_all, send_all

apply_ucx_env()  # before ucxx is imported


HANDSHAKE_S = 30.0
"""How long a new UCX connection may take to exchange ucxx's peer information (the client's
default timeout)."""


def import_ucxx() -> Any:
    """ucxx, or a ConfigError that says how to install it and why it may fail."""
    try:
        import ucxx
    except ImportError as e:
        raise ConfigError(
            f"the UCX data plane needs ucxx ({e}); install it with `pip install 'kvstore-llm[ucx]'` "
            "(ucxx-cu12, x86_64/aarch64 Linux wheels; it runs without a GPU) or set ucx = false"
        ) from e
    return ucxx


def as_array(buf: bytes | memoryview) -> np.ndarray:
    """A uint8 array over ``buf`` without a copy (ucxx takes array-interface objects)."""
    return np.frombuffer(buf, dtype=np.uint8)



class UcxChannel(Channel):
    plane = "ucx"

    def __init__(self, ep: Any, errors: tuple[type[BaseException], ...]) -> None:
        self.ep = ep
        self.local = False  # the shared-memory plane is offered over TCP on loopback only
        self._errors = errors

    async def recv_into(self, buf: memoryview) -> None:
        if not len(buf):
            return
        try:
            await recv_all(self.ep, [as_array(buf)])
        except self._errors as e:
            raise ChannelClosed(f"UCX receive failed: {e}") from e

    async def recv_many(self, bufs: Sequence[memoryview], received: Callable[[int], None]) -> None:
        try:  # all posted at once: one block's rendezvous overlaps the next
            await recv_all(self.ep, [as_array(b) for b in bufs if len(b)])
        except self._errors as e:
            raise ChannelClosed(f"UCX receive failed: {e}") from e
        received(sum(len(b) for b in bufs))

    async def send(self, bufs: Sequence[bytes | memoryview]) -> None:
        try:  # all posted at once: one block's rendezvous overlaps the next
            await send_all(self.ep, [as_array(b) for b in bufs if len(b)])
        except self._errors as e:
            raise ChannelClosed(f"UCX send failed: {e}") from e

    async def close(self) -> None:
        with contextlib.suppress(*self._errors):  # the peer is gone already
            await self.ep.close()


class UcxDataServer:
    def __init__(self, ctx: DataContext) -> None:
        self.ctx = ctx
        self.ucxx = import_ucxx()
        self.sessions: dict[asyncio.Task[None], Session] = {}
        self._listener: Any = None
        self._reaper: asyncio.Task[None] | None = None
        self._errors: tuple[type[BaseException], ...] = (self.ucxx.exceptions.UCXError,)  # the base class of every ucxx error
        self._progress: Progress | None = None

    def start(self, port: int) -> int:
        self._progress = Progress.of_running_loop()  # before ucxx would spin a task of its own
        if self._progress is not None:
            self._progress.hold()  # connections come in unasked: watch for as long as it listens
        # endpoint_error_handling=True: a client that dies must not abort the daemon.
        # connect_timeout: ucxx's 5 s for the handshake was too short on a loaded 2-core box.
        self._listener = self.ucxx.create_listener(self._handle, port=port, endpoint_error_handling=True,
                                                   connect_timeout=HANDSHAKE_S)
        self._reaper = asyncio.get_running_loop().create_task(reap_leases(self.sessions, lease_check_interval(self.ctx)))
        return int(self._listener.port)

    async def _handle(self, ep: Any) -> None:
        task = asyncio.current_task()
        assert task is not None
        peer = f"ucx-{id(ep)}"  # ucxx names no peer address: only the global limit applies
        ch = UcxChannel(ep, self._errors)
        if not self.ctx.gate.admit(peer):
            await ch.close()
            return
        s = Session(ch, self.ctx)
        self.sessions[task] = s
        try:
            await s.run()
        finally:
            self.sessions.pop(task, None)
            self.ctx.gate.leave(peer)

    async def stop(self, grace_s: float) -> None:
        if self._listener is not None:
            self._listener.close()
        if self._reaper is not None:
            self._reaper.cancel()
        await stop_sessions(self.sessions, grace_s)
        if self._progress is not None:
            self._progress.close()
            self._progress = None
