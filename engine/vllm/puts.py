"""The vLLM connector's puts (:class:`engine.vllm.worker.Worker`'s saver thread): a save's
staged pages into the daemon by PUT_DEVICE (the daemon copies them from the GPU into its arena),
through the connection's staging segment (shared memory) or a pinned buffer (TCP, UCX), piece
by piece, or on the CPU build from the staged rows; a hybrid page's window pieces and recurrent
states under their full block."""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch

from engine.gpu import device_export, register_host, unregister_host
from engine.transfer import PagedSaver, StagedSave
from engine.vllm.config import ConnectorConfig
from engine.vllm.pages import PageSpec
from kvstore.client import Client
from kvstore.errors import UsageError
from kvstore.hybrid import HybridNamespaces
from kvstore.keys import BlockHash, Namespace

log = logging.getLogger("kvstore.vllm")

Pieces = tuple[list[int], StagedSave] | None
"""A save's window pieces (or recurrent states): the blocks (indices in the request) and their
sliding layers (states), staged."""


class SavePuts:
    """The put half of the worker's saves, run on its saver thread; the worker owns the state
    (declared here: what these methods read and set)."""

    saver: PagedSaver | None
    spec: PageSpec
    cfg: ConnectorConfig
    bt: int
    counters: Any
    _device_puts: bool
    _device_events: bool
    _said_staged: bool
    _sink: tuple[Any, torch.Tensor] | None
    _pinned: torch.Tensor | None
    _save_t0: float
    last_save_marks: list[tuple[str, float]]

    @property
    def _cuda(self) -> bool:
        """Whether the worker's pages are on a GPU (the worker's)."""
        raise NotImplementedError

    def _store(self, c: Client, ns: Namespace, chain: list[BlockHash], start: int, staged: StagedSave,
               tokens: np.ndarray, pieces: Pieces = None, states: Pieces = None) -> int:
        """Put ``staged`` (blocks ``start..`` of ``chain``), then a page with sliding layers'
        window ``pieces`` and a page with recurrent layers' ``states`` (each under its full
        block: ``HybridNamespaces.window_chain``, ``state_chain``)."""
        if not self.spec.hybrid:
            return self._put_blocks(c, ns, chain, start, staged, tokens)
        hyb = HybridNamespaces.of(ns)
        new = 0
        if hyb.full is not None and staged.num_blocks:
            new = self._put_blocks(c, hyb.full, chain, start, staged, tokens)
        for part, key_chain, got in ((hyb.window, hyb.window_chain, pieces), (hyb.state, hyb.state_chain, states)):
            if got is None or part is None:
                continue
            which, rows = got
            if rows.ready is not None:  # a GPU: the gather ran on the forward's stream
                rows.ready.synchronize()
            host = rows.rows.cpu()  # small (a window or a state per checkpoint): one plain copy
            for k, j in enumerate(which):
                kchain = key_chain(chain, j)
                stored = c.put(part, kchain, host[k].numpy(), start=len(kchain) - 1)
                if part is hyb.window:
                    self.counters.saved_pieces += stored
                else:
                    self.counters.saved_states += stored
        return new

    def _put_blocks(self, c: Client, ns: Namespace, chain: list[BlockHash], start: int, staged: StagedSave,
                    tokens: np.ndarray) -> int:
        """Put ``staged`` (blocks ``start..`` of ``chain``): on the CPU from the staged rows (the
        put copies them into the daemon); on a GPU, where the daemon on this node offers it, by
        PUT_DEVICE (the daemon copies the staged rows from the device straight into its arena);
        else from the device into this connection's staging segment (shared memory) or a pinned
        buffer (TCP, UCX), piece by piece, each piece put while the next one crosses the link."""
        saver = self.saver
        assert saver is not None
        if not self._cuda:
            return c.put(ns, chain, staged.rows.view(-1).numpy(), start=start, tokens=tokens)
        if c.plane == "shm" and self._device_puts and not c.info.get("put_device") and not self._said_staged:
            self._said_staged = True
            log.info("kvstore: saves go through the daemon's staging segment: the daemon cannot copy from "
                     "GPU memory (%s)", c.info.get("put_device_unavailable", "an older daemon"))
        if c.plane == "shm" and self._device_puts and c.info.get("put_device"):
            try:
                device, handle, offset, size = device_export(staged.rows)
            except OSError as e:  # memory CUDA cannot export: the staging segment from now on
                self._device_puts = False
                log.info("kvstore: saves go through the daemon's staging segment (%s)", e)
            else:
                try:
                    new = self._put_device(c, ns, chain, start, staged, device, handle, offset, size)
                    self.counters.device_puts += 1
                    return new
                except UsageError as e:  # refused, nothing stored: the staging segment from now on
                    self._device_puts = False
                    log.warning("kvstore: the daemon refused a save from GPU memory (%s); saves go through "
                                "its staging segment", e)
        bb, new = ns.block_bytes, 0
        if c.plane == "shm":
            seg, host = self._segment(c)

            def put(a: int, b: int, off: int) -> None:
                nonlocal new
                new += c.put_staged(ns, chain[: start + b], seg, start=start + a, offset=off)
        else:
            host = self._pinned_buffer()

            bt = self.bt

            def put(a: int, b: int, off: int) -> None:
                nonlocal new
                new += c.put(ns, chain[: start + b], host[off : off + (b - a) * bb].numpy(), start=start + a,
                             tokens=tokens[a * bt : b * bt])

        saver.drain(staged, host, put)
        self.counters.staged_puts += 1
        return new

    def _put_device(self, c: Client, ns: Namespace, chain: list[BlockHash], start: int, staged: StagedSave,
                    device: int, handle: bytes, offset: int, size: int) -> int:
        """PUT_DEVICE of ``staged``: sent at once with its gather's event where the daemon waits
        for one on its device (``put_device_event``: its reservation overlaps the gather), else
        after the gather has landed."""
        after = None
        if staged.ready is not None and self._device_events and c.info.get("put_device_event"):
            try:
                after = staged.ready.ipc_handle()
            except RuntimeError as e:  # an event CUDA cannot share: wait on the host from now on
                self._device_events = False
                log.info("kvstore: saves wait for their gather on the host (%s)", e)
        if after is not None:
            self._save_mark("sent")
            try:
                return c.put_device(ns, chain, start=start, device=device, handle=handle, offset=offset, size=size,
                                    after=after)
            except UsageError as e:  # the daemon could not wait for it: nothing stored
                self._device_events = False
                log.warning("kvstore: the daemon refused a save's CUDA event (%s); saves wait for their gather "
                            "on the host", e)
        if staged.ready is not None:
            staged.ready.synchronize()  # the gather has landed before the daemon reads it
        self._save_mark("gathered")
        return c.put_device(ns, chain, start=start, device=device, handle=handle, offset=offset, size=size)

    def _save_mark(self, what: str) -> None:
        """A point of the saver thread's current save (``last_save_marks``)."""
        self.last_save_marks.append((what, time.perf_counter() - self._save_t0))

    def _segment(self, c: Client) -> tuple[Any, torch.Tensor]:
        """This connection's staging segment on the daemon and its view, registered with CUDA
        once per segment (a new connection has a new one)."""
        limit = int(c.info.get("max_staging_bytes", 0))
        want = min(limit, max(2 * self.cfg.piece_bytes, self.spec.block_bytes))
        seg = c.staging(want)
        if self._sink is None or self._sink[0] is not seg:
            if self._sink is not None:
                unregister_host(self._sink[1])
            view = torch.frombuffer(seg.buf, dtype=torch.uint8)
            register_host(view)
            self._sink = (seg, view)
        return self._sink

    def _pinned_buffer(self) -> torch.Tensor:
        if self._pinned is None:
            n = max(2 * self.cfg.piece_bytes, self.spec.block_bytes)
            self._pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        return self._pinned
