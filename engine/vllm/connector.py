"""``KVStoreConnector``: kvstore as vLLM's external KV cache (a v1 KV connector).

Scheduler side (one per engine): for each new request, hash the prompt's full blocks under the
engine's namespace and ask the daemon once (one lookup RPC) how many leading blocks it holds;
answer vLLM with the blocks beyond its own prefix-cache hit, whole blocks only, always leaving
the last token to compute. Record which pages to load into and, step by step (chunked prefill
included), which newly full prompt blocks to save.

Worker side (one per rank): load into vLLM's pages from leases on the daemon's shared-memory
arena (a TCP copy when the daemon is remote), layer by layer; in ``async`` mode the load runs
between scheduler steps and the request waits in ``WAITING_FOR_REMOTE_KVS``, in ``layerwise``
mode it runs beside the forward pass and each attention layer waits for its own layer only.
New full blocks are copied out of the pages at the end of the step and stored by a background
thread; the forward pass never waits on the daemon.

A dead or slow daemon costs a recompute, never an error or a wrong token: every call goes
through a circuit breaker (``engine.vllm.breaker``); blocks that fail to load are reported to
vLLM (``get_block_ids_with_load_errors``), which recomputes them; saves of a step in which a
load failed are dropped, so KV computed over a failed load never reaches the store.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from engine.vllm.breaker import DaemonLink
from engine.vllm.config import ConnectorConfig
from engine.vllm.pages import PagedKV, PageSpec, layer_rows, page_spec
from kvstore.client import Client, connect
from kvstore.errors import KVStoreError, UsageError
from kvstore.keys import BlockHash, Namespace, hash_blocks
from kvstore.shm import attach_arena

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("kvstore.vllm")


def _log_under_vllm(logger: logging.Logger) -> None:
    """vLLM configures only its own ``vllm`` logger (its handler, its level, no propagation):
    ``kvstore.vllm`` had no handler and the root's WARNING level, so the start-up line (INFO)
    never showed in the server's log. Share vLLM's handlers and level, unless the application
    configured logging itself (a root handler) or this logger already has a handler."""
    parent = logging.getLogger("vllm")
    if logger.handlers or logging.getLogger().handlers or not parent.handlers:
        return
    for h in parent.handlers:
        logger.addHandler(h)
    logger.setLevel(parent.level)


_log_under_vllm(log)


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
    block_ids: list[int]  # vLLM pages of blocks start..start+len-1
    is_async: bool


@dataclass(slots=True)
class SaveSpec:
    req_id: str
    start: int
    block_ids: list[int]


@dataclass
class KVStoreMetadata(KVConnectorMetadata):
    infos: dict[str, ReqInfo] = field(default_factory=dict)
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    finished: set[str] = field(default_factory=set)


# ---- shared set-up -----------------------------------------------------------------------------


def _model_identity(vllm_config: VllmConfig, cfg: ConnectorConfig) -> tuple[str, str]:
    mc = vllm_config.model_config
    model_id = cfg.model_id or str(mc.model)
    revision = cfg.model_revision or str(getattr(mc, "revision", None) or "main")
    quant = getattr(mc, "quantization", None)
    if quant:  # quantised weights compute other K/V
        revision = f"{revision}+{quant}"
    return model_id, revision


def make_link(cfg: ConnectorConfig, name: str, timeout: float, namespaces: list[Namespace],
              report_conflicts: bool = False) -> DaemonLink[Client]:
    """A breaker-guarded client that registers ``namespaces`` on every (re)connection;
    ``report_conflicts``: say loudly when the daemon holds this model deployment under another
    page layout (one link per engine does, the scheduler's)."""
    ttl = cfg.ttl_s or None

    def make() -> Client:
        return connect(cfg.daemon_url, token=cfg.daemon_token, plane=cfg.plane, timeout=timeout, retries=0)

    def on_connect(client: Client) -> None:
        for ns in namespaces:
            client.register_namespace(ns, ttl)
        mine = {bytes(ns.root).hex() for ns in namespaces}
        for w in client.layout_conflicts if report_conflicts else ():
            if w["namespaces"][0] in mine:
                log.warning(
                    "kvstore: the daemon already holds %r under another KV page layout (%s): this engine "
                    "and the one that stored those blocks never share them. If that is not meant, give "
                    "vLLM the same --block-size, --dtype and --kv-cache-dtype as that engine",
                    w["model_id"], "; ".join(w["differences"]),
                )

    return DaemonLink(make, name=name, on_connect=on_connect, backoff_s=cfg.backoff_s, max_backoff_s=cfg.max_backoff_s)


@dataclass(slots=True)
class ConnectorCounters:
    lookups: int = 0
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


# ---- scheduler side ----------------------------------------------------------------------------


@dataclass(slots=True)
class _Req:
    request: Any
    hashes: list[BlockHash]
    prompt_blocks: int
    hit: int = -1  # leading blocks kvstore holds (-1: not looked up)
    local: int = 0
    want: tuple[int, int] = (0, 0)
    allocated: bool = False
    block_ids: list[int] = field(default_factory=list)
    saved: int = 0
    sent_blocks: int = 0
    async_pending: bool = False
    loaded_tokens: int = 0


class _Scheduler:
    def __init__(self, vllm_config: VllmConfig, cfg: ConnectorConfig, spec: PageSpec) -> None:
        self.cfg = cfg
        self.spec = spec
        self.bt = spec.block_size
        pc = vllm_config.parallel_config
        self.world = int(pc.tensor_parallel_size)
        self.model_id, self.revision = _model_identity(vllm_config, cfg)
        self._ns: dict[str, Namespace] = {}
        ns0 = self.ns_for("")
        log.info(
            "kvstore: namespace %s for %s (%s, rank 0 of %d); blocks stored under any other page "
            "layout, TP degree or revision are not seen by this engine",
            bytes(ns0.root).hex()[:16], self.model_id, spec.describe(), self.world,
        )
        self.link = make_link(cfg, "kvstore-scheduler", cfg.lookup_timeout_s, [ns0], report_conflicts=True)
        self.reqs: dict[str, _Req] = {}
        self.pending_loads: list[LoadSpec] = []
        self.counters = ConnectorCounters()

    def ns_for(self, lora: str) -> Namespace:
        ns = self._ns.get(lora)
        if ns is None:
            ns = self._ns[lora] = self.spec.namespace(self.model_id, self.revision, 0, self.world, lora)
        return ns

    @staticmethod
    def _cacheable(request: Request) -> bool:
        return not request.mm_features and getattr(request, "prompt_embeds", None) is None

    @staticmethod
    def _lora(request: Request) -> str:
        lr = request.lora_request
        return "" if lr is None else str(lr.lora_name)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        if not self._cacheable(request):
            return 0, False
        bt = self.bt
        r = self.reqs.get(request.request_id)
        if r is None or r.allocated:  # new, or re-admitted after a preemption: look up afresh
            tokens = np.asarray(request.all_token_ids, dtype=np.int32)
            salt = (request.cache_salt or "").encode()
            n_hash = max((request.num_tokens - 1) // bt, request.num_prompt_tokens // bt)
            hashes = hash_blocks(self.ns_for(self._lora(request)), tokens[: n_hash * bt], salt or None)
            r = _Req(request, hashes, request.num_prompt_tokens // bt)
            self.reqs[request.request_id] = r
        max_blocks = (request.num_tokens - 1) // bt  # the last token is always computed
        if r.hit < 0:
            self.counters.lookups += 1
            ns = self.ns_for(self._lora(request))
            want = r.hashes[:max_blocks]
            r.hit = self.link.call(lambda c: c.lookup(ns, want).num_blocks, 0) if want else 0
            r.saved = min(r.hit, r.prompt_blocks)
            self.counters.requested_tokens += request.num_tokens
        r.local = num_computed_tokens // bt
        ext = min(r.hit, max_blocks) - r.local
        if ext < self.cfg.min_load_blocks or self.link.is_open:
            r.want = (r.local, r.local)
            return 0, False
        r.want = (r.local, r.local + ext)
        return ext * bt, self.cfg.load_mode == "async"

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        r = self.reqs.get(request.request_id)
        if r is None:
            return
        r.allocated = True
        if num_external_tokens == 0:
            return
        start, end = r.want
        n = num_external_tokens // self.bt
        if num_external_tokens % self.bt or n > end - start:
            raise AssertionError(
                f"vLLM asked to load {num_external_tokens} tokens of request {request.request_id}; "
                f"kvstore offered blocks {start}..{end} of {self.bt} tokens"
            )
        ids = list(blocks.get_block_ids()[0])
        is_async = self.cfg.load_mode == "async"
        self.pending_loads.append(LoadSpec(request.request_id, start, ids[start : start + n], is_async))
        r.async_pending = is_async
        r.loaded_tokens = num_external_tokens
        self.counters.hit_tokens += num_external_tokens

    def _info(self, meta: KVStoreMetadata, req_id: str, r: _Req, blocks: int) -> None:
        if blocks <= r.sent_blocks:
            return
        request = r.request
        tokens = np.asarray(request.all_token_ids[: blocks * self.bt], dtype=np.int32)
        meta.infos[req_id] = ReqInfo(tokens, self._lora(request), (request.cache_salt or "").encode())
        r.sent_blocks = blocks

    def _plan_save(self, meta: KVStoreMetadata, req_id: str, r: _Req, computed: int) -> None:
        if not self.cfg.save:
            return
        full = min(computed // self.bt, r.prompt_blocks, len(r.block_ids))
        if full > r.saved:
            self._info(meta, req_id, r, full)
            meta.saves.append(SaveSpec(req_id, r.saved, r.block_ids[r.saved : full]))
            r.saved = full

    def build_connector_meta(self, so: SchedulerOutput) -> KVStoreMetadata:
        meta = KVStoreMetadata()
        for req_id in so.finished_req_ids:
            r = self.reqs.get(req_id)
            if r is not None and not r.async_pending:
                del self.reqs[req_id]
            meta.finished.add(req_id)
        for ld in self.pending_loads:
            r = self.reqs[ld.req_id]
            self._info(meta, ld.req_id, r, ld.start + len(ld.block_ids))
            meta.loads.append(ld)
        self.pending_loads = []
        for new in so.scheduled_new_reqs:
            r = self.reqs.get(new.req_id)
            if r is None:
                continue
            r.block_ids = list(new.block_ids[0])
            self._plan_save(meta, new.req_id, r, new.num_computed_tokens + so.num_scheduled_tokens[new.req_id])
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            r = self.reqs.get(req_id)
            if r is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                r.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                r.block_ids.extend(new_ids[0])
            self._plan_save(meta, req_id, r, cached.num_computed_tokens[i] + so.num_scheduled_tokens[req_id])
        return meta

    def update_connector_output(self, output: Any) -> None:
        for req_id in output.finished_recving or ():
            r = self.reqs.get(req_id)
            if r is None:
                continue
            r.async_pending = False
            if r.request.is_finished():
                del self.reqs[req_id]

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        r = self.reqs.get(request.request_id)
        if r is None:
            return False, None
        # An async load still writing into this request's pages: vLLM frees them once the
        # worker reports the load finished.
        return r.async_pending, {"kvstore_hit_tokens": r.loaded_tokens}

    def close(self) -> None:
        log.info("kvstore scheduler: %s", self.counters)
        self.link.close()


# ---- worker side -------------------------------------------------------------------------------


class _LoadJob:
    """One step's loads of one kind (layerwise or async), run on the loader thread."""

    def __init__(self, specs: list[tuple[LoadSpec, Namespace, list[BlockHash]]], num_layers: int) -> None:
        self.specs = specs
        self.layer_done = [threading.Event() for _ in range(num_layers)]
        self.done = threading.Event()
        self.failed: set[int] = set()
        self.loaded = 0
        self.abandoned = False
        self.lock = threading.Lock()

    def fail_all(self) -> None:
        for spec, _, _ in self.specs:
            self.failed.update(spec.block_ids)


class _Worker:
    def __init__(self, vllm_config: VllmConfig, cfg: ConnectorConfig, spec: PageSpec,
                 tp: tuple[int, int] | None = None) -> None:
        """``tp``: (rank, world size); default vLLM's tensor-parallel group (a worker outside
        vLLM's processes, in a test, names its own)."""
        if tp is None:
            from vllm.distributed.parallel_state import (
                get_tensor_model_parallel_rank,
                get_tensor_model_parallel_world_size,
            )

            tp = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        self.cfg = cfg
        self.spec = spec
        self.bt = spec.block_size
        self.rank, self.world = tp
        self.model_id, self.revision = _model_identity(vllm_config, cfg)
        self._ns: dict[str, Namespace] = {}
        ns0 = self.ns_for("")
        self.load_link = make_link(cfg, f"kvstore-load-r{self.rank}", cfg.load_timeout_s, [ns0])
        self.save_link = make_link(cfg, f"kvstore-save-r{self.rank}", cfg.save_timeout_s, [ns0])
        self.kv: PagedKV | None = None
        self.infos: dict[str, ReqInfo] = {}
        self.chains: dict[str, list[BlockHash]] = {}
        self.meta: KVStoreMetadata | None = None
        self.counters = ConnectorCounters()
        self._arenas: dict[str, tuple[Any, torch.Tensor]] = {}
        self._layer_job: _LoadJob | None = None
        self._async_jobs: dict[str, _LoadJob] = {}
        self._errors: set[int] = set()
        self._step_failed = False
        self._lock = threading.Lock()
        self._loads: deque[_LoadJob] = deque()
        self._load_wake = threading.Condition(self._lock)
        self._saves: deque[tuple[Namespace, list[BlockHash], int, torch.Tensor, np.ndarray]] = deque()
        self._save_wake = threading.Condition(threading.Lock())
        self._save_slots = threading.BoundedSemaphore(cfg.max_pending_saves)
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
            ns = self._ns[lora] = self.spec.namespace(self.model_id, self.revision, self.rank, self.world, lora)
        return ns

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.kv = PagedKV(self.spec, kv_caches)

    def _chain(self, req_id: str, blocks: int) -> tuple[Namespace, list[BlockHash]]:
        info = self.infos[req_id]
        ns = self.ns_for(info.lora)
        chain = self.chains.get(req_id)
        if chain is None or len(chain) < blocks:
            chain = self.chains[req_id] = hash_blocks(ns, info.tokens, info.salt or None)
        return ns, chain

    # -- per step --

    def bind(self, meta: KVStoreMetadata) -> None:
        self.meta = meta
        self.infos.update(meta.infos)
        for req_id in meta.infos:
            self.chains.pop(req_id, None)  # longer tokens: hash again

    def start_load_kv(self) -> None:
        meta = self.meta
        if meta is None or self.kv is None:
            return
        self._step_failed = False
        by_kind: dict[bool, list[tuple[LoadSpec, Namespace, list[BlockHash]]]] = {True: [], False: []}
        for ld in meta.loads:
            ns, chain = self._chain(ld.req_id, ld.start + len(ld.block_ids))
            by_kind[ld.is_async].append((ld, ns, chain[ld.start : ld.start + len(ld.block_ids)]))
        for is_async, specs in by_kind.items():
            if not specs:
                continue
            job = _LoadJob(specs, self.kv.num_layers)
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
            with job.lock:  # the loader checks this before each layer it writes
                if not job.layer_done[i].is_set():
                    job.abandoned = True
                    job.fail_all()

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
        if not meta.saves:
            return
        if self._step_failed or self.save_link.is_open:
            # KV computed this step over a failed load must not reach the store; with the
            # daemon down a save would only be dropped later.
            self.counters.saves_dropped += len(meta.saves)
            return
        for sv in meta.saves:
            if not self._save_slots.acquire(blocking=False):
                self.counters.saves_dropped += 1
                continue
            ns, chain = self._chain(sv.req_id, sv.start + len(sv.block_ids))
            try:
                buf = self._gather(sv.block_ids)
            except (torch.OutOfMemoryError, MemoryError) as e:
                # The save's host buffer or its device staging did not fit: vLLM's step must go
                # on, and the pages are recomputed the next time they are needed.
                self._save_slots.release()
                self.counters.saves_dropped += 1
                log.warning("kvstore save of %d blocks dropped: out of memory (%s)", len(sv.block_ids), e)
                continue
            self.counters.saves_submitted += 1
            end = sv.start + len(sv.block_ids)
            # The blocks' token ids go with the save (4 bytes a token): the daemon's KV events
            # carry them in BlockStored.token_ids, as vLLM's own events do.
            tokens = self.infos[sv.req_id].tokens[sv.start * self.bt : end * self.bt]
            with self._save_wake:
                self._saves.append((ns, chain[:end], sv.start, buf, tokens))
                self._save_wake.notify()

    def _gather(self, block_ids: list[int]) -> torch.Tensor:
        """The pages of ``block_ids`` in one host buffer (pinned on CUDA), copied and synchronised."""
        assert self.kv is not None
        buf = torch.empty((len(block_ids), self.spec.block_bytes), dtype=torch.uint8,
                          pin_memory=self.kv.device.type == "cuda")
        self.kv.gather(block_ids, buf)
        if self.kv.device.type == "cuda":
            torch.cuda.current_stream(self.kv.device).synchronize()
        return buf

    def _collect(self, job: _LoadJob, in_step: bool = False) -> None:
        with job.lock:
            if job.failed:
                self._step_failed |= in_step
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

    def take_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    # -- loader thread --

    def _load_loop(self) -> None:
        while True:
            with self._load_wake:
                while not self._loads and not self._stop:
                    self._load_wake.wait()
                if self._stop:
                    return
                job = self._loads.popleft()
            try:
                self._run_load(job)
            finally:
                with job.lock:
                    for ev in job.layer_done:
                        ev.set()
                    job.done.set()

    def _arena(self, name: str) -> torch.Tensor:
        entry = self._arenas.get(name)
        if entry is None:
            self._arenas.clear()  # a restarted daemon has a new arena
            shm = attach_arena(name)
            entry = self._arenas[name] = (shm, torch.frombuffer(shm.buf, dtype=torch.uint8))
        return entry[1]

    def _run_load(self, job: _LoadJob) -> None:
        kv = self.kv
        assert kv is not None
        pb = self.spec.page_bytes
        sources: list[tuple[torch.Tensor, Any]] = []  # (dst ids, source) per spec
        leases: list[Any] = []
        try:
            for spec, ns, hashes in job.specs:
                n, src = self._fetch(ns, hashes, leases)
                job.loaded += n
                if n < len(hashes):
                    job.failed.update(spec.block_ids[n:])
                if n:
                    sources.append((kv.block_ids(spec.block_ids[:n]), src))
            for layer in range(kv.num_layers):
                with job.lock:
                    if job.abandoned:
                        return
                    for ids, src in sources:
                        if isinstance(src, tuple):  # (arena tensor, offsets)
                            rows = layer_rows(src[0], src[1], layer, pb)
                        else:  # host buffer of whole blocks
                            rows = src[:, layer * pb : (layer + 1) * pb]
                        kv.scatter_layer(layer, ids, rows)
                    job.layer_done[layer].set()
        finally:
            for lease in leases:
                self.load_link.call(lambda c, lease=lease: c.release(lease), None)

    def _fetch(self, ns: Namespace, hashes: list[BlockHash], leases: list[Any]) -> tuple[int, Any]:
        """The leading cached blocks of ``hashes``: (count, source)."""
        client = self.load_link.client
        if client is None:
            return 0, None
        try:
            if client.plane == "shm":
                lease = self.load_link.call(lambda c: c.acquire(ns, hashes), None)
                if lease is None:
                    return 0, None
                leases.append(lease)
                offsets = [off for off, _ in lease.locations]
                return len(offsets), (self._arena(lease.arena), offsets)
            buf = torch.empty((len(hashes), self.spec.block_bytes), dtype=torch.uint8)
            n = self.load_link.call(lambda c: c.get_into(ns, hashes, buf.view(-1).numpy()), 0)
            return n, buf[:n]
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
                ns, chain, start, buf, tokens = self._saves.popleft()
            try:
                src = buf.view(-1).numpy()
                n = self.save_link.call(
                    lambda c, ns=ns, chain=chain, src=src, start=start, tokens=tokens: c.put(
                        ns, chain, src, start=start, tokens=tokens), -1)
                if n < 0:
                    self.counters.saves_dropped += 1
                else:
                    self.counters.saved_blocks += len(chain) - start
            except KVStoreError as e:  # a prefix evicted since the lookup, a full store
                self.counters.save_errors += 1
                log.info("kvstore save of %d blocks failed: %s", len(chain) - start, e)
            finally:
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
        self.load_link.close()
        self.save_link.close()
        self._arenas.clear()


# ---- the connector vLLM loads ----------------------------------------------------------------


class KVStoreConnector(KVConnectorBase_V1):
    """kvstore as vLLM's external KV cache; see the module docstring and docs/vllm.md."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        self.cfg = ConnectorConfig.from_extra(ktc.kv_connector_extra_config)
        pc = vllm_config.parallel_config
        if int(getattr(pc, "pipeline_parallel_size", 1)) > 1:
            raise UsageError("kvstore's vLLM connector does not support pipeline parallelism yet (use TP)")
        self.spec = page_spec(kv_cache_config, getattr(kv_cache_config, "kv_cache_layout", None))
        self._scheduler: _Scheduler | None = None
        self._worker: _Worker | None = None
        if role == KVConnectorRole.SCHEDULER:
            if self.cfg.load_failure_policy == "recompute" and ktc.kv_load_failure_policy != "recompute":
                # kvstore is a cache: a block that cannot be loaded is recomputed, never an error.
                # vLLM's scheduler reads the policy after building its connector.
                ktc.kv_load_failure_policy = "recompute"
                log.info("kvstore: kv_load_failure_policy set to 'recompute' (a failed load is a miss)")
            self._scheduler = _Scheduler(vllm_config, self.cfg, self.spec)
        else:
            self._worker = _Worker(vllm_config, self.cfg, self.spec)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a dropped save is a future miss

    # -- scheduler --

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        if self._scheduler is not None:
            self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request)

    # -- worker --

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            assert isinstance(connector_metadata, KVStoreMetadata)
            self._worker.bind(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        assert self._worker is not None
        self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        return  # whole blocks are copied out once per step, in wait_for_save

    def wait_for_save(self) -> None:
        assert self._worker is not None
        self._worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self._worker is not None
        return None, self._worker.get_finished() or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.take_errors()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()

    def flush(self) -> None:
        """Wait until this worker's submitted saves have run (benchmarks, tests)."""
        if self._worker is not None:
            self._worker.flush()

    def namespace(self, lora: str = "") -> Namespace:
        """The namespace this side stores under: the scheduler's is rank 0's, a worker's its own
        rank's."""
        part = self._scheduler or self._worker
        assert part is not None
        return part.ns_for(lora)

    @property
    def counters(self) -> ConnectorCounters:
        part = self._scheduler or self._worker
        assert part is not None
        return part.counters

