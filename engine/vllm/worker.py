"""The vLLM connector's worker side (one per rank), importable without vLLM.

Loads go into vLLM's pages from leases on the daemon's shared-memory arena (a pinned copy over
TCP or UCX when the daemon is remote) through :class:`engine.transfer.PagedLoader`: on a GPU,
whole-block DMAs from the arena (registered with CUDA once) into device staging on the
connector's own copy stream and a device-side scatter on its scatter stream, one CUDA event per
layer; on the CPU build, a scatter straight from the arena's rows. In ``async`` mode a load runs
between scheduler steps and the request waits in ``WAITING_FOR_REMOTE_KVS``; in ``layerwise``
mode it runs beside the forward pass and each attention layer's stream waits for that layer's
event only.

Saves: at the end of a step the new full blocks' pages are gathered into device staging on the
forward pass's stream (gather kernels only: the host never waits), and a saver thread copies them
to the host in pieces straight into this connection's staging segment on the daemon (registered
with CUDA once), which the daemon copies into its store while the next piece crosses the link
(:class:`engine.transfer.PagedSaver`). The forward pass never waits on the daemon.

A dead or slow daemon costs a recompute, never an error or a wrong token: every call goes
through a circuit breaker (``engine.breaker``); blocks that fail to load are reported to
vLLM (``get_block_ids_with_load_errors``), which recomputes them; saves of a step in which a
load failed are dropped, so KV computed over a failed load never reaches the store.

``tools.bench peers --device cuda`` drives this class as vLLM does (``engine.vllm.harness``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from engine.gpu import (
    ArenaBlocks,
    HeldBlocks,
    HostBlocks,
    release_arenas,
    unregister_host,
)
from engine.transfer import (
    ConcatSource,
    DeferredGather,
    DeviceLoad,
    PagedLoader,
    PagedSaver,
    StagedSave,
)
from engine.vllm.config import ConnectorConfig
from engine.vllm.leases import PreLease, lease_chunks
from engine.vllm.link import chain_namespace, make_link, model_identity, stored_namespaces
from engine.vllm.pages import PagedKV, PagedState, PageSpec, kv_order_of, scales_digest
from engine.vllm.puts import Pieces, SavePuts
from kvstore.errors import KVStoreError
from kvstore.hybrid import HybridNamespaces
from kvstore.keys import BlockHash, Namespace, hash_blocks

log = logging.getLogger("kvstore.vllm")


# ---- metadata: scheduler -> workers, once per step -------------------------------------------


@dataclass(slots=True)
class ReqInfo:
    """What a worker needs to hash a request's blocks under its own rank's namespace."""

    tokens: np.ndarray  # int32, whole blocks
    lora: str
    salt: bytes


@dataclass(slots=True)
class LoadSpec:
    req_id: str
    start: int  # first block (index in the request) to load
    block_ids: list[Any]
    """vLLM's pages of blocks start..start+len-1: block ids, or with its hybrid KV cache manager a
    tuple per block (each KV cache group's block id)."""
    is_async: bool
    lease: PreLease | None = None
    """Where the leading blocks lie in the arena, held by the scheduler's lease from its lookup
    (``engine.vllm.leases``): copied without an ACQUIRE."""


@dataclass(slots=True)
class SaveSpec:
    req_id: str
    start: int
    block_ids: list[Any]  # as LoadSpec's
    pieces: list[int] = field(default_factory=list)
    """A page with sliding layers: the blocks (indices in the request, among ``start..``) whose
    window piece is stored (checkpoints' windows)."""


@dataclass(slots=True)
class StateSave:
    """A recurrent state vLLM offered at a block boundary (``boundary_state_offloads``), to store
    as checkpoint ``block``'s state."""

    req_id: str
    block: int
    """The block (index in the request) the state ends."""
    pages: tuple[int, ...]
    """vLLM's page ids holding it, indexed by KV cache group (the recurrent groups' are set)."""


@dataclass
class StepPlan:
    """What the scheduler tells the workers once per step (vLLM's connector metadata)."""

    infos: dict[str, ReqInfo] = field(default_factory=dict)
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    finished: set[str] = field(default_factory=set)
    states: list[StateSave] = field(default_factory=list)
    """Saved after this step's ``saves`` (a state is put under its full block)."""


# ---- shared set-up -----------------------------------------------------------------------------


def attention_layers(vllm_config: Any, spec: PageSpec) -> list[Any]:
    """vLLM's attention layers of ``spec`` (its static forward context; a layer not found there,
    as outside vLLM, is a bare object)."""
    ctx = getattr(getattr(vllm_config, "compilation_config", None), "static_forward_context", None) or {}
    layers = [ctx.get(n) for n in spec.layer_names]
    return [layer if layer is not None else object() for layer in layers]


def layer_scales(vllm_config: Any, spec: PageSpec) -> str:
    """The digest of the K/V scales of ``spec``'s layers (:func:`engine.vllm.pages.scales_digest`),
    read from vLLM's attention layers (a layer not found there counts as unscaled: 1.0)."""
    return scales_digest(attention_layers(vllm_config, spec))


@dataclass(slots=True)
class ConnectorCounters:
    lookups: int = 0
    known_skips: int = 0
    """Lookups not made: vLLM's own prefix cache held the whole prompt and kvstore was seen
    holding it less than ``known_s`` ago."""
    requested_tokens: int = 0
    hit_tokens: int = 0
    """Tokens found in kvstore beyond vLLM's own prefix hit and handed to vLLM to load."""
    loads: int = 0
    loaded_blocks: int = 0
    failed_blocks: int = 0
    saves_submitted: int = 0
    saved_blocks: int = 0
    saves_dropped: int = 0
    save_errors: int = 0
    replayed_blocks: int = 0
    """A page with sliding layers: cached blocks after the checkpoint a hit ended on (recomputed)."""
    saved_pieces: int = 0
    """A page with sliding layers: window pieces stored."""
    saved_states: int = 0
    """A page with recurrent layers: checkpoints' states stored."""
    device_puts: int = 0
    """Puts the daemon copied straight from GPU memory (PUT_DEVICE)."""
    staged_puts: int = 0
    """Puts through the daemon's staging segment or a pinned buffer (a GPU without PUT_DEVICE)."""
    load_fetch_s: float = 0.0
    """Seconds the loader thread spent taking leases (or remote blocks) from the daemon."""
    preleased_blocks: int = 0
    """Blocks loaded from the scheduler's lease (no ACQUIRE of the worker's own)."""
    load_copy_s: float = 0.0
    """Seconds from a load's first queued copy until its last scatter landed."""
    save_put_s: float = 0.0
    """Seconds the saver thread spent in puts (the daemon's copy and commit included)."""



# ---- worker side -------------------------------------------------------------------------------


class _Chain:
    """The block hashes of one load (blocks ``start .. start+count-1`` of a request's chain),
    hashed on the loader thread when first asked for (off vLLM's step: 0.7 ms at 32K tokens),
    the head alone first if asked (its lease goes out while the rest is hashed)."""

    def __init__(self, worker: Worker, req_id: str, info: ReqInfo, ns: Namespace, start: int, count: int) -> None:
        self.worker, self.req_id, self.info, self.ns = worker, req_id, info, ns
        self.start, self.count = start, count
        self._done: list[BlockHash] | None = None
        cached = worker.chains.get(req_id)
        if cached is not None and len(cached) >= start + count:
            self._done = cached
        self._head: list[BlockHash] = []

    def head(self, k: int) -> list[BlockHash]:
        """Hashes of the load's first ``k`` blocks (the blocks before them hashed too)."""
        if self._done is not None:
            return self._done[self.start : self.start + k]
        bt = self.worker.bt
        self._head = hash_blocks(chain_namespace(self.ns), self.info.tokens[: (self.start + k) * bt],
                                 self.info.salt or None)
        return self._head[self.start :]

    def all(self, keep: bool = True) -> list[BlockHash]:
        """Hashes of every block of the load; ``keep``: for the request's later loads and saves
        (not from the saver thread: the request may have finished and been forgotten since)."""
        if self._done is None:
            bt, head = self.worker.bt, self._head
            rest = hash_blocks(chain_namespace(self.ns), self.info.tokens[len(head) * bt :], self.info.salt or None,
                               parent=head[-1] if head else None)
            self._done = head + rest
            if keep:  # (a shorter chain of older tokens is a prefix of it)
                self.worker.chains[self.req_id] = self._done
        return self._done[self.start : self.start + self.count]

    def prefix(self) -> list[BlockHash]:
        """The chain up to the end of these blocks (a save's), hashed on the saver thread."""
        self.all(keep=False)
        assert self._done is not None
        return self._done[: self.start + self.count]


class _LoadJob:
    """One step's loads of one kind (layerwise or async), run on the loader thread."""

    def __init__(self, specs: list[tuple[LoadSpec, Namespace, _Chain]], num_layers: int,
                 after: Any = None) -> None:
        self.specs = specs
        self.after = after
        """CUDA event on the engine's stream when the loads were started (the scatters wait for it)."""
        self.layer_done = [threading.Event() for _ in range(num_layers)]
        """Set once the layer's scatter is queued (on the CPU: written)."""
        self.layer_events: list[Any] = [None] * num_layers
        """The CUDA event after which the layer's pages hold the blocks (None on the CPU)."""
        self.done = threading.Event()
        self.failed: set[Any] = set()
        """Pages that failed to load (with several KV cache groups, tuples of page ids)."""
        self.failed_reqs: set[str] = set()
        self.loaded = 0
        self.abandoned = False
        self.lock = threading.Lock()
        self.t0 = time.perf_counter()
        """When the step started the load (``start_load_kv``)."""
        self.marks: list[tuple[str, float]] = []
        """The loader thread's host timeline, (what, seconds since :attr:`t0`): where the time
        of a load goes before its first DMA and after its last scatter (``Worker.last_marks``)."""

    def mark(self, what: str) -> None:
        self.marks.append((what, time.perf_counter() - self.t0))

    def fail(self, spec: LoadSpec, pages: list[Any]) -> None:
        """Pages of ``spec`` did not load: its request failed (reported per request with several
        KV cache groups, whose page ids vLLM cannot map back)."""
        if pages:
            self.failed.update(pages)
            self.failed_reqs.add(spec.req_id)

    def fail_all(self) -> None:
        for spec, _, _ in self.specs:
            self.fail(spec, spec.block_ids)


class Worker(SavePuts):
    """The connector's worker side; vLLM's ``KVStoreConnector`` forwards its worker calls here."""

    def __init__(self, vllm_config: Any, cfg: ConnectorConfig, spec: PageSpec,
                 tp: tuple[int, int] | None = None, fenced: bool = False) -> None:
        """``tp``: (rank, world size); default vLLM's tensor-parallel group (a worker outside
        vLLM's processes, in a test or a benchmark, names its own). ``fenced``: the engine calls
        :meth:`handle_preemptions` each step before it writes a page (vLLM does where its
        connector base has that hook), so a save's gather on the CPU leaves the step."""
        if tp is None:
            from vllm.distributed.parallel_state import (
                get_tensor_model_parallel_rank,
                get_tensor_model_parallel_world_size,
            )

            tp = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        self.cfg = cfg
        self._vllm_config = vllm_config
        if spec.quantized and not spec.scales:
            spec = replace(spec, scales=layer_scales(vllm_config, spec))
        self.spec = spec
        self.bt = spec.block_size
        self.rank, self.world = tp
        self.model_id, self.revision = model_identity(vllm_config, cfg)
        self._ns: dict[str, Namespace] = {}
        ns0 = self.ns_for("")
        self.load_link = make_link(cfg, f"kvstore-load-r{self.rank}", cfg.load_timeout_s, stored_namespaces(ns0))
        self.save_link = make_link(cfg, f"kvstore-save-r{self.rank}", cfg.save_timeout_s, stored_namespaces(ns0))
        self.kv: PagedKV | None = None
        self.full_kv: PagedKV | None = None  # a page with sliding layers: its full-attention layers
        self.window_kv: PagedKV | None = None  # ... and its sliding layers
        self.state: PagedState | None = None  # a page with recurrent layers: their states
        self._part_layers: tuple[list[int], list[int]] = ([], [])  # their indices in ``kv``
        self.loader: PagedLoader | None = None
        self.saver: PagedSaver | None = None
        self.infos: dict[str, ReqInfo] = {}
        self.chains: dict[str, list[BlockHash]] = {}
        self.meta: StepPlan | None = None
        self.counters = ConnectorCounters()
        self._layer_job: _LoadJob | None = None
        self._async_jobs: dict[str, _LoadJob] = {}
        self._errors: set[int] = set()
        self._failed_reqs: set[str] = set()
        self._step_failed = False
        self._lock = threading.Lock()
        self._loads: deque[_LoadJob] = deque()
        self._load_wake = threading.Condition(self._lock)
        self._arena = ""  # the daemon arena this worker's loads last read
        self._landed: set[str] = set()  # loads from the scheduler's leases whose copies landed
        self._device_puts = cfg.device_puts  # PUT_DEVICE where the daemon offers it
        self._device_events = True  # ... sent before the gather lands, where the daemon waits for it
        self._said_staged = False  # logged once why a GPU's saves go through the staging segment
        self.last_load: DeviceLoad | None = None
        """The last (non-hybrid) load, once landed: diagnostics (its per-tile timeline when
        ``loader.timing`` is on)."""
        self.last_marks: list[tuple[str, float]] = []
        """The last load's host timeline (:attr:`_LoadJob.marks`): benchmarks read it."""
        self.last_t0 = 0.0  # when the load of last_marks was started (its marks count from there)
        self.last_save_marks: list[tuple[str, float]] = []
        """The last save's host timeline on the saver thread, seconds since ``wait_for_save``
        queued it: benchmarks read it."""
        self._pinned: torch.Tensor | None = None  # a remote plane's save buffer
        self._load_host: torch.Tensor | None = None  # a remote plane's load buffer
        self._sink: tuple[Any, torch.Tensor] | None = None  # (staging segment, its registered view)
        self._saves: deque[tuple[Namespace, list[BlockHash] | _Chain, int, StagedSave | DeferredGather, np.ndarray,
                                 Pieces, Pieces, float]] = deque()
        self._save_t0 = 0.0  # when the saver thread's current save was queued (its marks)
        self._save_wake = threading.Condition(threading.Lock())
        self._save_slots = threading.BoundedSemaphore(cfg.max_pending_saves)
        self._fenced = fenced
        self._gathers: list[DeferredGather] = []
        """CPU saves' gathers left to the saver thread, settled by the next :meth:`handle_preemptions`."""
        self._stop = False
        self._threads = [
            threading.Thread(target=self._load_loop, name="kvstore-load", daemon=True),
            threading.Thread(target=self._save_loop, name="kvstore-save", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def ns_for(self, lora: str) -> Namespace:
        ns = self._ns.get(lora)
        if ns is None:
            # MLA: the latent cache is the same on every rank: one copy, rank 0's, for all.
            rank = 0 if self.spec.shared_by_ranks else self.rank
            ns = self._ns[lora] = self.spec.namespace(self.model_id, self.revision, rank, self.world, lora)
        return ns

    @property
    def saves_here(self) -> bool:
        """Whether this rank stores blocks: every rank its own heads; MLA rank 0 only."""
        return not self.spec.shared_by_ranks or self.rank == 0

    def hyb_for(self, lora: str) -> HybridNamespaces:
        return HybridNamespaces.of(self.ns_for(lora))

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.spec.block_format == "kvstore" and not self.spec.kv_order:
            self.spec = replace(self.spec, kv_order=kv_order_of(attention_layers(self._vllm_config, self.spec),
                                                                self.spec.dtype))
        self.kv = PagedKV(self.spec, kv_caches, one_launch=self.cfg.page_kernel)
        if self.spec.hybrid:
            full, window = self.spec.part(False), self.spec.part(True)
            self.full_kv = PagedKV(full, kv_caches, one_launch=self.cfg.page_kernel) if full.num_layers else None
            self.window_kv = PagedKV(window, kv_caches, one_launch=self.cfg.page_kernel) if window.num_layers else None
            self._part_layers = ([self.kv.index[n] for n in full.layer_names],
                                 [self.kv.index[n] for n in window.layer_names])
        if self.spec.state is not None:
            self.state = PagedState(self.spec.state, kv_caches)
        self.loader = PagedLoader(self.kv.device, piece_bytes=self.cfg.piece_bytes, stage_bytes=self.cfg.stage_bytes)
        self.saver = PagedSaver(self.kv.device, piece_bytes=self.cfg.piece_bytes)

    @property
    def _cuda(self) -> bool:
        return self.kv is not None and self.kv.device.type == "cuda"

    def _lazy_chain(self, req_id: str, start: int, count: int) -> tuple[Namespace, _Chain]:
        """Blocks ``start .. start+count-1`` of a request's chain, hashed when first asked for."""
        info = self.infos[req_id]
        ns = self.ns_for(info.lora)
        return ns, _Chain(self, req_id, info, ns, start, count)

    def _chain(self, req_id: str, blocks: int) -> tuple[Namespace, list[BlockHash]]:
        """The first ``blocks`` hashes of a request's chain, now (kept for its later calls)."""
        ns, chain = self._lazy_chain(req_id, 0, blocks)
        return ns, chain.all()

    # -- per step --

    def handle_preemptions(self) -> None:
        """Before the step writes any page (vLLM zeroes fresh blocks, copies blocks and runs
        the forward after it): every save's gather left to the saver thread has run; one it has
        not begun runs here (a copy of the pages, never a call to the daemon)."""
        gathers, self._gathers = self._gathers, []
        for g in gathers:
            g.settle()

    def bind(self, meta: StepPlan) -> None:
        # vLLM has called handle_preemptions already (nothing is left then); a driver that only
        # binds still never lets the deferred gathers pile up.
        self.handle_preemptions()
        self.meta = meta
        self.infos.update(meta.infos)
        for req_id in meta.infos:
            self.chains.pop(req_id, None)  # longer tokens: hash again

    def start_load_kv(self) -> None:
        meta = self.meta
        if meta is None or self.kv is None:
            return
        self._step_failed = False
        by_kind: dict[bool, list[tuple[LoadSpec, Namespace, _Chain]]] = {True: [], False: []}
        for ld in meta.loads:  # hashed on the loader thread
            by_kind[ld.is_async].append((ld, *self._lazy_chain(ld.req_id, ld.start, len(ld.block_ids))))
        for is_async, specs in by_kind.items():
            if not specs:
                continue
            after = None
            if self._cuda:  # the pages' earlier readers on the engine's stream come first
                after = torch.cuda.Event()
                after.record(torch.cuda.current_stream(self.kv.device))
            job = _LoadJob(specs, self.kv.num_layers, after)
            if is_async:
                for ld, _, _ in specs:
                    self._async_jobs[ld.req_id] = job
            else:
                self._layer_job = job
            with self._load_wake:
                self._loads.append(job)
                self._load_wake.notify()

    def wait_for_layer_load(self, layer_name: str) -> None:
        job = self._layer_job
        if job is None or self.kv is None:
            return
        i = self.kv.index.get(layer_name)
        if i is None:
            return
        if not job.layer_done[i].wait(self.cfg.load_timeout_s * 2):
            with job.lock:  # the loader checks this before each tile it queues
                if not job.layer_done[i].is_set():
                    job.abandoned = True
                    job.fail_all()
                    return
        ev = job.layer_events[i]
        if ev is not None:  # the forward's stream waits on the device, the host goes on
            torch.cuda.current_stream(self.kv.device).wait_event(ev)

    def wait_for_save(self) -> None:
        meta = self.meta
        if meta is None or self.kv is None:
            return
        job, self._layer_job = self._layer_job, None
        if job is not None:
            if not job.done.wait(self.cfg.load_timeout_s * 2):
                with job.lock:
                    job.abandoned = True
                    job.fail_all()
            self._collect(job, in_step=True)
        for req_id in meta.finished:
            self.infos.pop(req_id, None)
            self.chains.pop(req_id, None)
        if not meta.saves or not self.saves_here:
            return
        if self._step_failed or self.save_link.is_open:
            # KV computed this step over a failed load must not reach the store; with the
            # daemon down a save would only be dropped later.
            self.counters.saves_dropped += len(meta.saves)
            return
        assert self.saver is not None
        for sv in meta.saves:
            if not self._save_slots.acquire(blocking=False):
                self.counters.saves_dropped += 1
                continue
            end = sv.start + len(sv.block_ids)
            ns, chain = self._lazy_chain(sv.req_id, 0, end)  # hashed on the saver thread
            try:
                staged, pieces = self._stage(sv)
                if isinstance(staged, DeferredGather):
                    self._gathers.append(staged)
            except (torch.OutOfMemoryError, MemoryError) as e:
                # The save's device staging did not fit: vLLM's step must go on, and the pages
                # are recomputed the next time they are needed.
                self._save_slots.release()
                self.counters.saves_dropped += 1
                log.warning("kvstore save of %d blocks dropped: out of memory (%s)", len(sv.block_ids), e)
                continue
            self.counters.saves_submitted += 1
            # The blocks' token ids go with the save (4 bytes a token): the daemon's KV events
            # carry them in BlockStored.token_ids, as vLLM's own events do.
            tokens = chain.info.tokens[sv.start * self.bt : end * self.bt]
            with self._save_wake:
                self._saves.append((ns, chain, sv.start, staged, tokens, pieces, None, time.perf_counter()))
                self._save_wake.notify()
        for st in meta.states:
            self._save_state(st)

    def _save_state(self, st: StateSave) -> None:
        """Queue the state vLLM offered at the end of block ``st.block`` (after the step's block
        saves: it is put under its full block)."""
        assert self.saver is not None and self.state is not None
        if not self._save_slots.acquire(blocking=False):
            self.counters.saves_dropped += 1
            return
        ns, chain = self._chain(st.req_id, st.block + 1)
        pages: list[Any] = [st.pages]  # a tuple of page ids per block, as with several KV cache groups
        rows = self.saver.stage(self.state, pages)
        none = StagedSave(torch.empty((0, 0), dtype=torch.uint8, device=self.state.device))
        with self._save_wake:
            self._saves.append((ns, chain[: st.block + 1], st.block + 1, none, np.empty(0, np.int32), None,
                                ([st.block], rows), time.perf_counter()))
            self._save_wake.notify()

    def _stage(self, sv: SaveSpec) -> tuple[StagedSave | DeferredGather, tuple[list[int], StagedSave] | None]:
        """The pages a save stores, gathered: every layer of its blocks; for a page with sliding
        layers, the full layers of its blocks and the sliding layers of its window pieces. On
        the CPU, where the engine fences its page writes, the gather of a save's blocks is left
        to the saver thread."""
        assert self.saver is not None and self.kv is not None
        if not self.spec.hybrid:
            if self._fenced and not self._cuda:
                return self.saver.defer(self.kv, sv.block_ids), None
            return self.saver.stage(self.kv, sv.block_ids), None
        kv = self.full_kv
        if kv is not None:
            full = self.saver.stage(kv, sv.block_ids)
        else:  # every layer slides: windows only
            full = StagedSave(torch.empty((0, 0), dtype=torch.uint8, device=self.kv.device))
        if not sv.pieces:
            return full, None
        assert self.window_kv is not None
        ids = [sv.block_ids[j - sv.start] for j in sv.pieces]
        return full, (sv.pieces, self.saver.stage(self.window_kv, ids))

    def _collect(self, job: _LoadJob, in_step: bool = False) -> None:
        with job.lock:
            if job.failed:
                self._step_failed |= in_step
                if self.spec.groups:  # several KV cache groups: vLLM takes failures per request
                    self._failed_reqs |= job.failed_reqs
                else:
                    self._errors |= job.failed
                self.counters.failed_blocks += len(job.failed)
            self.counters.loaded_blocks += job.loaded

    def get_finished(self) -> set[str]:
        done: set[str] = set()
        for req_id, job in list(self._async_jobs.items()):
            if job.done.is_set():
                done.add(req_id)
                del self._async_jobs[req_id]
                if not any(j is job for j in self._async_jobs.values()):
                    self._collect(job)
        return done

    def take_landed(self) -> set[str]:
        """Requests whose loads read the scheduler's leases and whose copies have all landed (or
        stopped) since the last call: their leases may go back (vLLM's worker metadata)."""
        with self._lock:
            landed, self._landed = self._landed, set()
        return landed

    def take_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def take_failed_requests(self) -> set[str]:
        """Requests whose async load failed (several KV cache groups: ``failed_recving``; each is
        also among the requests :meth:`get_finished` has returned, this step or before)."""
        failed, self._failed_reqs = self._failed_reqs, set()
        return failed

    # -- loader thread --

    def _load_loop(self) -> None:
        while True:
            with self._load_wake:
                while not self._loads and not self._stop:
                    self._load_wake.wait()
                if self._stop:
                    return
                job = self._loads.popleft()
            held: list[Any] = []
            job.mark("thread")
            try:
                self._run_load(job, held)
            except Exception:  # a bug: never into vLLM's step; its blocks are recomputed
                log.exception("kvstore load failed; vLLM recomputes its blocks")
                with job.lock:
                    job.fail_all()
                if self._cuda and self.kv is not None:  # copies it queued read the leases
                    # (a broken CUDA context raises here too: the loader thread must live on)
                    with contextlib.suppress(RuntimeError):
                        torch.cuda.synchronize(self.kv.device)
            finally:
                job.mark("landed")
                self.last_marks, self.last_t0 = job.marks, job.t0
                with self._lock:  # their copies have landed: the scheduler may give the leases back
                    self._landed.update(spec.req_id for spec, _, _ in job.specs if spec.lease is not None)
                with job.lock:
                    for ev in job.layer_done:
                        ev.set()
                    job.done.set()
                # The copies from the leases have landed (or none was queued): vLLM may go on
                # while they are given back.
                for lease in held:
                    if not isinstance(lease, HostBlocks):
                        self.load_link.call(lambda c, lease=lease: c.release(lease), None)  # type: ignore[misc]  # mypy cannot infer a lambda with a default

    def _run_load(self, job: _LoadJob, held: list[Any]) -> None:
        """Fetch and queue ``job``'s blocks, and wait until they have landed; the leases taken
        are left in ``held`` (the caller gives them back)."""
        kv, loader = self.kv, self.loader
        assert kv is not None and loader is not None
        parts: list[tuple[Any, int]] = []
        ids: list[int] = []
        if self.spec.hybrid:
            self._run_hybrid_load(job, held)
            return

        def ready(lo: int, hi: int, event: Any) -> None:
            for layer in range(lo, hi):
                job.layer_events[layer] = event
                job.layer_done[layer].set()

        def cancelled() -> bool:
            with job.lock:
                return job.abandoned

        group = self.cfg.layer_group if job.specs and not job.specs[0][0].is_async else 0
        client = self.load_link.client
        if group == 0 and self.cfg.lease_head_bytes > 0 and client is not None and client.plane == "shm":
            self._run_chunked_load(job, held, ready, cancelled)
            return
        t0 = time.perf_counter()
        for spec, ns, chain in job.specs:
            held_src = self._held(spec, held, whole=True)  # the scheduler's lease: no fetch
            n, src = (chain.count, held_src) if held_src is not None else self._fetch(ns, chain.all(), held)
            job.loaded += n
            if n < chain.count:
                job.fail(spec, spec.block_ids[n:])
            if n:
                parts.append((src, n))
                ids.extend(spec.block_ids[:n])
        t1 = time.perf_counter()
        self.counters.load_fetch_s += t1 - t0
        if not ids:
            return
        src = parts[0][0] if len(parts) == 1 else ConcatSource(parts)
        load = loader.load(src, kv, ids, layer_group=group, after=job.after, on_layers=ready,
                           cancelled=cancelled)
        load.synchronize()  # the leases are read until the last copy lands
        self.counters.load_copy_s += time.perf_counter() - t1
        self.last_load = load

    def _run_chunked_load(self, job: _LoadJob, held: list[Any], ready: Callable[[int, int, Any], None],
                          cancelled: Callable[[], bool]) -> None:
        """An async load over shared memory, lease by lease (``lease_head_bytes``, then 4x
        larger): every lease is asked for at once (``Client.acquire_each``) and each chunk's
        copies are queued as soon as its lease is back, so only the first lease's round trip
        comes before the first DMA; the leases are held (``held``) until the last copy has
        landed."""
        kv, loader = self.kv, self.loader
        assert kv is not None and loader is not None
        head = max(1, self.cfg.lease_head_bytes // kv.block_bytes)
        loads: list[DeviceLoad] = []
        fetch_s, t0 = 0.0, time.perf_counter()
        try:  # each chunk's last scatters wait for the next chunk's first DMA (hold_last)
            for spec, ns, chain in job.specs:
                if cancelled():
                    break
                got = 0
                src = self._held(spec, held)
                if src is not None:  # the scheduler's lease: queued at once, no round trip
                    got = src.num_blocks
                    job.loaded += got
                    loads.append(loader.load(src, kv, spec.block_ids[:got], after=job.after,
                                             cancelled=cancelled, hold_last=True))
                    job.mark(f"held {got}")
                    if got == chain.count:
                        continue
                bounds = [(a + got, b + got) for a, b in lease_chunks(chain.count - got, head)]

                def pieces(chain: _Chain = chain, bounds: list[tuple[int, int]] = bounds) -> Iterator[list[BlockHash]]:
                    yield chain.head(bounds[0][1])[bounds[0][0]:]  # its lease goes out while the rest is hashed
                    hashes = chain.all()
                    for a, b in bounds[1:]:
                        yield hashes[a:b]

                f0 = time.perf_counter()
                with contextlib.closing(self._fetch_each(ns, pieces(), held)) as leases:
                    for (a, b), (n, src) in zip(bounds, leases, strict=False):
                        fetch_s += time.perf_counter() - f0
                        job.mark(f"lease {b - a}")
                        job.loaded += n
                        if n:
                            loads.append(loader.load(src, kv, spec.block_ids[a : a + n], after=job.after,
                                                     cancelled=cancelled, hold_last=True))
                        job.mark("queued")
                        got = a + n
                        if n < b - a or cancelled():
                            break
                        f0 = time.perf_counter()
                if got < chain.count and not cancelled():  # not cached further (or the daemon failed)
                    job.fail(spec, spec.block_ids[got:])
        finally:
            loader.flush()
        if loads:
            last = loads[-1]
            ready(0, kv.num_layers, last.done)
            for load in loads:
                load.synchronize()  # the leases are read until the last copy lands
            self.last_load = DeviceLoad(last.layer_events, last.done, [t for ld in loads for t in ld.tiles])
        self.counters.load_fetch_s += fetch_s
        self.counters.load_copy_s += time.perf_counter() - t0 - fetch_s

    def _run_hybrid_load(self, job: _LoadJob, held: list[Any]) -> None:
        """A page with sliding layers: for each request, the full part of its blocks into the
        full-attention layers and the window pieces of its last block (the checkpoint) into the
        sliding layers. A request missing any of them fails whole (its sliding pages before the
        checkpoint's window hold nothing: vLLM must recompute from its first block)."""
        loader = self.loader
        assert loader is not None
        full: list[tuple[Any, int]] = []
        full_ids: list[int] = []
        window: list[tuple[Any, int]] = []
        window_ids: list[int] = []
        states: list[tuple[Any, int]] = []
        state_ids: list[Any] = []
        for spec, ns, chain in job.specs:
            hashes = chain.all()
            hyb, n, start = HybridNamespaces.of(ns), len(hashes), spec.start
            got_full: Any = None
            if hyb.full is not None:
                m, got_full = self._fetch(hyb.full, hashes, held)
                if m < n:
                    job.fail(spec, spec.block_ids)
                    continue
            pieces: list[int] = []
            got_window: Any = None
            if hyb.window is not None:
                pieces = [j for j in hyb.checkpoint_blocks(start + n - 1) if j >= start]
                m, got_window = self._fetch(hyb.window, [hyb.window_key(hashes[j - start]) for j in pieces], held)
                if m < len(pieces):
                    job.fail(spec, spec.block_ids)
                    continue
            got_state: Any = None
            if hyb.state is not None:  # the checkpoint's state, into the page vLLM keeps it in
                m, got_state = self._fetch(hyb.state, [hyb.state_key(hashes[-1])], held)
                if m < 1:
                    job.fail(spec, spec.block_ids)
                    continue
            job.loaded += n
            if got_full is not None:
                full.append((got_full, n))
                full_ids.extend(spec.block_ids)
            if got_window is not None:
                window.append((got_window, len(pieces)))
                window_ids.extend(spec.block_ids[j - start] for j in pieces)
            if got_state is not None:
                states.append((got_state, 1))
                state_ids.append(spec.block_ids[-1])

        def cancelled() -> bool:
            with job.lock:
                return job.abandoned

        group = self.cfg.layer_group if job.specs and not job.specs[0][0].is_async else 0
        loads: list[DeviceLoad] = []
        if self.state is not None and state_ids:  # before the layers' events: async loads only
            src = states[0][0] if len(states) == 1 else ConcatSource(states)
            loads.append(loader.load(src, self.state, state_ids, after=job.after, cancelled=cancelled))
        for kv, parts, ids, where in ((self.full_kv, full, full_ids, self._part_layers[0]),
                                      (self.window_kv, window, window_ids, self._part_layers[1])):
            if kv is None or not ids:
                continue

            def ready(lo: int, hi: int, event: Any, where: list[int] = where) -> None:
                for layer in range(lo, hi):
                    job.layer_events[where[layer]] = event
                    job.layer_done[where[layer]].set()

            src = parts[0][0] if len(parts) == 1 else ConcatSource(parts)
            # queued right after the full part's (each ring slot waits for its last scatter)
            loads.append(loader.load(src, kv, ids, layer_group=group, after=job.after, on_layers=ready,
                                     cancelled=cancelled))
        for load in loads:
            load.synchronize()  # the leases are read until the last copy lands

    def _load_buffer(self, n: int, bb: int, reserved: int) -> torch.Tensor:
        """``n`` rows of ``bb`` bytes at byte ``reserved`` of the remote planes' load buffer
        (pinned on a GPU), grown as needed and kept: a step's loads fill it back to back, and
        the next step's start once this one's copies are done (loads run one at a time)."""
        need = reserved + n * bb
        if self._load_host is None or self._load_host.numel() < need:
            if reserved:  # earlier rows of this step are still to be read: a buffer of its own
                return torch.empty((n, bb), dtype=torch.uint8, pin_memory=self._cuda)
            self._load_host = None
            self._load_host = torch.empty(need, dtype=torch.uint8, pin_memory=self._cuda)
        return self._load_host[reserved:need].view(n, bb)

    def _held(self, spec: LoadSpec, held: list[Any], whole: bool = False) -> HeldBlocks | None:
        """The blocks of ``spec`` that the scheduler's lease holds (``whole``: only if it holds
        them all), where this worker reads the same arena (a restarted daemon's new one: None,
        the worker takes its own leases)."""
        pre, client = spec.lease, self.load_link.client
        if pre is None or not pre.num_blocks or client is None or client.plane != "shm":
            return None
        if whole and pre.num_blocks < len(spec.block_ids):
            return None
        if pre.arena != client.info.get("arena"):
            return None
        self._reading(pre.arena, held)
        src = HeldBlocks(pre.arena, pre.locations[: len(spec.block_ids)])
        self.counters.preleased_blocks += src.num_blocks
        return src

    def _fetch_each(self, ns: Namespace, chunks: Iterable[list[BlockHash]],
                    held: list[Any]) -> Generator[tuple[int, Any], None, None]:
        """:meth:`_fetch` of each of ``chunks`` (consecutive pieces of one chain) over shared
        memory, pipelined (``Client.acquire_each``); stops at a short one, a failure (logged),
        or the breaker. Close it to give back the leases still on their way."""
        client = self.load_link.client
        leases = None if client is None else self.load_link.call(lambda c: c.acquire_each(ns, chunks), None)
        if client is None or leases is None:
            return
        with contextlib.closing(leases):
            while True:
                try:
                    lease = self.load_link.call(lambda c: next(leases, None), None)
                except KVStoreError as e:  # answered: an unknown namespace after a restart, say
                    log.warning("kvstore load failed (%s); vLLM recomputes these blocks", e)
                    return
                if lease is None:
                    return
                self._hold(lease, held)
                yield lease.num_blocks, ArenaBlocks(client, lease)

    def _hold(self, lease: Any, held: list[Any]) -> None:
        """Keep ``lease`` in ``held`` (given back once its copies have landed)."""
        if lease.num_blocks:
            self._reading(lease.arena, held)
        held.append(lease)

    def _reading(self, arena: str, held: list[Any]) -> None:
        """This load reads ``arena``: a restarted daemon has a new one, so let go of the old
        one's mapping (no lease on it is held, no copy from it is in flight: loads run one at a
        time)."""
        if arena != self._arena and not any(not isinstance(h, HostBlocks) for h in held):
            release_arenas()
            self._arena = arena

    def _fetch(self, ns: Namespace, hashes: list[BlockHash], held: list[Any]) -> tuple[int, Any]:
        """The leading cached blocks of ``hashes``: (count, source): a lease on the daemon's arena
        (shared memory) or a host buffer a remote plane filled (pinned on a GPU)."""
        client = self.load_link.client
        if client is None:
            return 0, None
        held_host = [h for h in held if isinstance(h, HostBlocks)]
        try:
            if client.plane == "shm":
                lease = self.load_link.call(lambda c: c.acquire(ns, hashes), None)
                if lease is None:
                    return 0, None
                self._hold(lease, held)
                return lease.num_blocks, ArenaBlocks(client, lease)
            buf = self._load_buffer(len(hashes), ns.block_bytes, reserved=sum(h.blocks.numel() for h in held_host))
            n = self.load_link.call(lambda c: c.get_into(ns, hashes, buf.view(-1).numpy()), 0)
            held.append(HostBlocks(buf[:n]))
            return n, held[-1]
        except KVStoreError as e:  # answered: an unknown namespace after a restart, say
            log.warning("kvstore load failed (%s); vLLM recomputes these blocks", e)
            return 0, None

    # -- saver thread --

    def _save_loop(self) -> None:
        while True:
            with self._save_wake:
                while not self._saves and not self._stop:
                    self._save_wake.wait()
                if self._stop and not self._saves:
                    return
                ns, lazy, start, queued, tokens, pieces, states, self._save_t0 = self._saves.popleft()
            t0 = time.perf_counter()
            blocks = queued.num_blocks
            self.last_save_marks = []
            self._save_mark("thread")
            try:
                if isinstance(queued, DeferredGather):
                    try:
                        staged = queued.run()
                    except (torch.OutOfMemoryError, MemoryError) as e:
                        self.counters.saves_dropped += 1
                        log.warning("kvstore save of %d blocks dropped: out of memory (%s)", blocks, e)
                        continue
                    self._save_mark("gathered")
                else:
                    staged = queued
                chain = lazy.prefix() if isinstance(lazy, _Chain) else lazy  # while the gather runs
                self._save_mark("hashed")
                n = self.save_link.call(
                    lambda c, ns=ns, chain=chain, start=start, staged=staged, tokens=tokens, pieces=pieces, states=states: self._store(  # type: ignore[misc]  # as above
                        c, ns, chain, start, staged, tokens, pieces, states), -1)
                if n < 0:
                    self.counters.saves_dropped += 1
                else:
                    self.counters.saved_blocks += blocks  # (windows only: none)
            except KVStoreError as e:  # a prefix evicted since the lookup, a full store
                self.counters.save_errors += 1
                log.info("kvstore save of %d blocks failed: %s", blocks, e)
            except Exception:  # a bug: never into vLLM; the blocks are computed again next time
                self.counters.save_errors += 1
                log.exception("kvstore save of %d blocks failed", blocks)
            finally:
                self.counters.save_put_s += time.perf_counter() - t0
                self._save_mark("stored")
                self._save_slots.release()

    def flush(self) -> None:
        """Wait until every submitted save has run (tests, shutdown)."""
        for _ in range(self.cfg.max_pending_saves):
            self._save_slots.acquire()
        for _ in range(self.cfg.max_pending_saves):
            self._save_slots.release()

    def close(self) -> None:
        self.flush()
        self._stop = True
        with self._load_wake:
            self._load_wake.notify_all()
        with self._save_wake:
            self._save_wake.notify_all()
        for t in self._threads:
            t.join(timeout=5)
        log.info("kvstore worker rank %d: %s", self.rank, self.counters)
        if self._sink is not None:
            unregister_host(self._sink[1])
            self._sink = None
        self.load_link.close()
        self.save_link.close()
