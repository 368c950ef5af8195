"""The daemon: one asyncio process per node that owns the store and serves both planes.

Start-up: refuse a data directory another daemon holds (naming its pid), bind the data plane
and the HTTP socket (a port in use is found before a slab or an arena is made, and named), open
the store (a warm restart may take a while: in the pool, not on the loop), then report ready. Shutdown on SIGTERM or SIGINT:
readiness goes false, uvicorn finishes the HTTP requests in flight, data-plane sessions finish
their current request (bounded), leases are given back, and ``store.close()`` persists what must
survive (refreshed expiry, volatile blocks) before the process exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import uvicorn

from kvstore.clock import Clock, system_clock
from kvstore.config import StoreConfig
from kvstore.errors import KVStoreError
from kvstore.registry import tier_class
from kvstore.server.app import make_app
from kvstore.server.config import ServerConfig, check_exposure
from kvstore.server.dataplane import DataContext, TcpDataServer
from kvstore.server.devcopy import DeviceCopier
from kvstore.server.limits import (
    ConnectionGate,
    InflightBytes,
    descriptor_budget,
    gated_http_protocol,
    sweep_http,
)
from kvstore.server.metrics import Metrics
from kvstore.server.service import Service, load_secret
from kvstore.shm import attach_arena
from kvstore.store import KVStore
from kvstore.wire.fdpass import FdServer

log = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 10.0


def node_id() -> str:
    """Same value for every process of one booted machine (to tell a same-node client)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


class _Uvicorn(uvicorn.Server):
    """The daemon handles signals itself: uvicorn's handler re-raises the signal after its own
    shutdown, which would kill the process before the store is closed."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class Daemon:
    def __init__(self, store_config: StoreConfig, config: ServerConfig, *, clock: Clock = system_clock) -> None:
        """``clock``: the store's wall clock (a :class:`kvstore.clock.FakeClock` in tests)."""
        if store_config.events.enabled is None:  # the daemon keeps an access log unless told not to
            store_config = replace(store_config, events=replace(store_config.events, enabled=True))
        check_exposure(config, store_config.events.publish, store_config.events.replay)
        self.store_config = store_config
        self.config = config
        self.clock = clock
        self._ready = False
        self._server: _Uvicorn | None = None
        self._stop = asyncio.Event()

    def request_stop(self) -> None:
        """Begin a graceful shutdown (what SIGTERM does)."""
        self._ready = False
        self._stop.set()
        if self._server is not None:
            self._server.should_exit = True

    async def serve(self, on_ready: Callable[[dict[str, Any]], None] | None = None) -> None:
        cfg = self.config
        loop = asyncio.get_running_loop()
        on_main_thread = threading.current_thread() is threading.main_thread()
        self._refuse_held_directory()
        tcp_sock = _bind(cfg.host, cfg.data_port, "data")
        try:
            http_sock = _bind(cfg.host, cfg.http_port, "HTTP")
        except BaseException:
            tcp_sock.close()
            raise
        pool = ThreadPoolExecutor(cfg.threads, thread_name_prefix="kvstore")
        try:
            store = await loop.run_in_executor(pool, partial(KVStore, self.store_config, clock=self.clock))
        except BaseException:
            tcp_sock.close()
            http_sock.close()
            pool.shutdown(wait=False)
            raise
        arena_shm = None
        service: Service | None = None
        fds: FdServer | None = None
        arena_fd = -1
        try:
            service = Service(store, cfg, load_secret(self.store_config.root), clock=self.clock)
            await loop.run_in_executor(pool, self._attach_routing, service)  # kvevents.py, handoff.py
            arena_shm = attach_arena(service.arena) if service.arena else None
            # The store's arena (the tier its leases live in), which service.arena names.
            arena = store.arena_tier.arena() if store.arena_tier is not None else None
            if arena_shm is not None and arena is not None:
                # From here on the arena has no name: clients granted shared memory get a
                # read-only descriptor of it (docs/daemon.md, "Who is trusted with what").
                arena_fd = arena.readonly_fd()
                arena.unlink_name()
                fds = FdServer()
                fds.start()
            lim = cfg.limits
            metrics = Metrics(store.stats, service.namespace_tenants)
            if service.handoffs is not None:
                metrics.registry.register(service.handoffs.collector())
            tickets = fds.max_claims + fds.max_per_owner * len(service.tenants()) if fds else 0
            event_conns = 0
            if service.kv_events is not None:  # its ports' connections have their own limit
                event_conns = service.kv_events.gate.descriptors
                metrics.registry.register(service.kv_events.collector())
            gate = ConnectionGate(descriptor_budget(lim.max_connections, tickets + event_conns),
                                  lim.max_connections_per_peer, metrics.refused.inc)
            copier = None
            if arena_shm is not None and arena_shm.buf is not None:
                copier = DeviceCopier(arena_shm.buf, lim.put_device_timeout_s)
                metrics.put_device_quarantined.set_function(copier.quarantined_slots)
            ctx = DataContext(service, pool, metrics, arena_shm.buf if arena_shm else None, node_id(),
                              gate, InflightBytes(lim.max_inflight_bytes_per_tenant), fds, arena_fd, copier)
            planes: list[Any] = []
            tcp = TcpDataServer(ctx)
            data_port = tcp.adopt(tcp_sock)
            tcp.start()
            planes.append(tcp)
            ucx_port = None
            if cfg.ucx:
                from kvstore.server.ucx import UcxDataServer

                ucx = UcxDataServer(ctx)
                ucx_port = ucx.start(cfg.ucx_port)
                planes.append(ucx)
            http_port = http_sock.getsockname()[1]
            info = {"http_port": http_port, "data_port": data_port, "ucx_port": ucx_port}
            app = make_app(ctx, info, lambda: self._ready)
            self._server = _Uvicorn(
                uvicorn.Config(app, lifespan="off", log_level="warning", access_log=False,
                               timeout_graceful_shutdown=SHUTDOWN_GRACE_S,  # type: ignore[arg-type]  # annotated int; any number of seconds works
                               http=gated_http_protocol(gate, lim.request_timeout_s,
                                                        metrics.timeouts.labels("http", "request").inc,
                                                        service.accepts))
            )
            if on_main_thread:  # an embedded daemon (ThreadedDaemon) is stopped by its owner
                for sig in (signal.SIGTERM, signal.SIGINT):
                    loop.add_signal_handler(sig, self.request_stop)
            maint = loop.create_task(self._maintain(ctx))
            sweeper = loop.create_task(sweep_http(gate, min(1.0, lim.request_timeout_s / 4)))
            http = loop.create_task(self._server.serve(sockets=[http_sock]))
            while not self._server.started and not http.done():
                await asyncio.sleep(0.01)  # uvicorn reports no start event; bounded by its start-up
            if http.done():
                await http  # start-up failed: raise its error
                return
            self._ready = not self._stop.is_set()
            if on_main_thread:  # a process of its own (not embedded in a host's)
                freeze_startup_objects()
            if on_ready is not None:
                on_ready({
                    "pid": os.getpid(),
                    "url": f"http://{_url_host(cfg.host)}:{http_port}",
                    **info,
                    "root": str(self.store_config.root),
                    "arena": service.arena,
                    "tenants": [t.name for t in service.tenants()],
                    "events": service.kv_events.endpoints(None) if service.kv_events else None,
                })
            await self._stop.wait()
            await http  # uvicorn finishes the HTTP requests in flight
            for p in planes:
                await p.stop(SHUTDOWN_GRACE_S)
            for task in (maint, sweeper):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        finally:
            if on_main_thread:
                for sig in (signal.SIGTERM, signal.SIGINT):
                    loop.remove_signal_handler(sig)
            if fds is not None:
                fds.close()
            if arena_fd >= 0:
                os.close(arena_fd)
            if arena_shm is not None:
                with contextlib.suppress(BufferError):
                    arena_shm.close()
            tcp_sock.close()
            http_sock.close()
            await loop.run_in_executor(pool, _close_store, store)
            if service is not None and service.kv_events is not None:
                service.kv_events.close()
            pool.shutdown(wait=True)

    def _refuse_held_directory(self) -> None:
        """A second daemon on a directory gets the holder's pid, not RocksDB's lock error."""
        root = Path(self.store_config.root)
        for spec in self.store_config.tiers:
            if (pid := tier_class(spec.kind).holder(spec.name, root)) is not None:
                raise KVStoreError(
                    f"the store directory {root} is in use by process {pid} (another kvstore daemon, "
                    "or a program with the store open); stop it, or give this daemon another --data-dir"
                )

    async def _maintain(self, ctx: DataContext) -> None:
        while True:
            await asyncio.sleep(self.config.maintain_interval_s)
            try:
                if ctx.devcopy is not None:  # PUT_DEVICE slots set aside whose copies have landed
                    await ctx.run(ctx.devcopy.sweep)
                await ctx.run(ctx.service.store.maintain)
                await ctx.run(_log_usage, ctx.service.store)
                await ctx.run(ctx.service.refresh_usage)
                await ctx.run(ctx.service.handoffs.expire)
            except Exception:
                log.exception("periodic maintenance failed; will retry")

    def _attach_routing(self, service: Service) -> None:
        """Handoffs (always) and the KV event publisher (with ``[events] publish``)."""
        from kvstore.server.handoff import Handoffs

        service.handoffs = Handoffs(service, self.store_config.root, self.clock)
        if self.store_config.events.publish:
            from kvstore.server.kvevents import KVEventPublisher

            keyed = [(t.name, t.salt, t.spec.token, t.spec.admin) for t in service.tenants() if t.key]
            service.kv_events = KVEventPublisher(service.store, self.store_config.events, keyed)


def _log_usage(store: Any) -> None:
    """Tier fill and admission counters into the event log, for kvreport's "tier fill over
    time" and "admission"."""
    stats = store.stats()
    store.events.usage(stats["tiers"], store=stats)


SWITCH_INTERVAL_S = 0.0005
"""The daemon process's interpreter switch interval (``sys.setswitchinterval``; Python's default
is 5 ms). Its threads (the loop, the pool, the event log's and KV events' writers) share one
interpreter: a request whose thread gives up the interpreter for a moment (a lock, a syscall)
while another thread formats a batch of records waited up to a whole interval to get it back,
once or twice per request (a PUT_DEVICE's commit of 2,048 blocks took four to six times the
in-process store's on a GPU host; docs/daemon.md)."""


def freeze_startup_objects() -> None:
    """Move what start-up made (modules, the app, the store's index as loaded) out of the
    collector's reach (``gc.freeze``): a full collection then scans only what came since. In a
    daemon of ~86,000 objects at start a full collection stalled a PUT_DEVICE of 2,048 blocks
    by ~60 ms, every few requests. Also shortens the switch interval (:data:`SWITCH_INTERVAL_S`)."""
    gc.collect()
    gc.freeze()
    sys.setswitchinterval(SWITCH_INTERVAL_S)


class ThreadedDaemon:
    """A daemon on a background thread of this process (tests; embedding in a host process).

    ``with ThreadedDaemon(store_cfg, server_cfg) as d: connect(d.url)``; leaving the block
    shuts it down as SIGTERM would.
    """

    def __init__(self, store_config: StoreConfig, config: ServerConfig, timeout: float = 60.0, *,
                 clock: Clock = system_clock) -> None:
        self.daemon = Daemon(store_config, config, clock=clock)
        self.info: dict[str, Any] = {}
        self._started = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="kvstore-daemon", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout):
            raise TimeoutError(f"the daemon did not start within {timeout} s")
        if self._error is not None:
            raise self._error

    @property
    def url(self) -> str:
        return str(self.info["url"])

    def _main(self) -> None:
        def ready(info: dict[str, Any]) -> None:
            self.info = info
            self._started.set()

        async def run() -> None:
            self._loop = asyncio.get_running_loop()
            await self.daemon.serve(ready)

        try:
            asyncio.run(run())
        except BaseException as e:  # reported to the owner by __init__ or stop()
            self._error = e
        finally:
            self._started.set()

    def stop(self, timeout: float = 60.0) -> None:
        if self._loop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self.daemon.request_stop)
        self._thread.join(timeout)
        if self._error is not None:
            raise self._error

    def __enter__(self) -> ThreadedDaemon:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _bind(host: str, port: int, plane: str) -> socket.socket:
    """A listening socket on ``host:port``; an error that names the plane and the port."""
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.create_server((host, port), family=fam, backlog=1024)
    except OSError as e:
        hint = " (another daemon? pick another port, or 0 for a free one)" if e.errno == errno.EADDRINUSE else ""
        raise OSError(e.errno, f"cannot listen on the {plane} port {host}:{port}: {e.strerror}{hint}") from e
    if plane == "HTTP":
        # Accepted sockets inherit TCP_NODELAY on Linux. Without it uvicorn's separate writes
        # of headers and body meet the client's delayed ACK: 40 ms per request.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _close_store(store: KVStore) -> None:
    """Close the store; a failure to persist (a full or failed disk) is logged, not raised: the
    blocks already on persistent tiers are safe, and a shutdown the operator asked for ends."""
    try:
        store.close()
    except (KVStoreError, OSError) as e:
        log.error("closing the store did not persist everything (%s); blocks that lived only in "
                  "memory are lost, everything put durably or already on disk is kept", e)
        return
    log.info("kvstore daemon stopped; store closed")


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", "::", ""):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host
