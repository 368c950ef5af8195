"""``KVStoreConnector``: kvstore as vLLM's external KV cache (a v1 KV connector).

Scheduler side (one per engine): for each new request, hash the prompt's full blocks under the
engine's namespace and ask the daemon once (one lookup RPC) how many leading blocks it holds;
answer vLLM with the blocks beyond its own prefix-cache hit, whole blocks only, always leaving
the last token to compute. Record which pages to load into and, step by step (chunked prefill
included), which newly full prompt blocks to save.

Worker side (one per rank, :class:`engine.vllm.worker.Worker`, importable without vLLM): loads
from leases on the daemon's shared-memory arena straight to the device (whole-block DMAs, a
device-side scatter, one CUDA event per layer), async or layer-wise; saves gathered on the device
and copied straight into the daemon's staging segment by a background thread; the forward pass
never waits on the daemon.

A dead or slow daemon costs a recompute, never an error or a wrong token: every call goes
through a circuit breaker (``engine.breaker``); blocks that fail to load are reported to
vLLM (``get_block_ids_with_load_errors``), which recomputes them; saves of a step in which a
load failed are dropped, so KV computed over a failed load never reaches the store.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from engine.vllm.config import ConnectorConfig
from engine.vllm.leases import LeaseBook
from engine.vllm.link import chain_namespace, make_link, model_identity, stored_namespaces
from engine.vllm.pages import PageSpec, page_spec
from engine.vllm.worker import (
    ConnectorCounters,
    LoadSpec,
    ReqInfo,
    SaveSpec,
    StateSave,
    StepPlan,
    Worker,
)
from kvstore.errors import UsageError
from kvstore.hybrid import CheckpointPolicy, HybridNamespaces
from kvstore.hybrid import lookup as hybrid_lookup
from kvstore.keys import BlockHash, Namespace, hash_blocks

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("kvstore.vllm")

VLLM_FENCES = "handle_preemptions" in vars(KVConnectorBase_V1)
"""Whether this vLLM calls a connector's ``handle_preemptions`` at the start of each step, before
it zeroes fresh blocks, copies blocks or runs the forward: then a save's gather on the CPU runs on
the saver thread and is settled there (an older vLLM: the gather stays in ``wait_for_save``)."""


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


@dataclass
class KVStoreMetadata(StepPlan, KVConnectorMetadata):
    """The step's plan (:class:`engine.vllm.worker.StepPlan`) as vLLM's connector metadata."""


@dataclass
class KVStoreHandshake(KVConnectorHandshakeMetadata):
    """Worker -> scheduler once, after the KV caches are registered: what the namespace needs
    that only the model knows (the digest of an fp8 cache's K/V scales)."""

    scales: str


@dataclass
class KVStoreWorkerMeta(KVConnectorWorkerMetadata):
    """Worker -> scheduler each step: requests whose loads from the scheduler's leases have
    landed (``Worker.take_landed``): their leases go back (``engine.vllm.leases``)."""

    landed: set[str]

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        more = other.landed if isinstance(other, KVStoreWorkerMeta) else set()
        return KVStoreWorkerMeta(self.landed | more)


def _found(answer: tuple[Any, Any]) -> tuple[int, Any]:
    """``(blocks found, lease)`` of a ``Client.lookup_lease`` answer."""
    return answer[0].num_blocks, answer[1]


def sliding_mode(spec: PageSpec, cfg: ConnectorConfig, prefix_caching: bool, log_it: bool = False) -> PageSpec:
    """``spec`` as this engine stores it: with its sliding layers stored as window pieces at
    checkpoints (``sliding = window``), or as a dense page of every layer (``every_layer``).

    With vLLM's hybrid KV cache manager (its sliding-window groups), or when every layer slides,
    vLLM keeps only each window's pages and knows which of its cached pages hold a window:
    windows are stored, whatever vLLM's prefix cache does. Without it (``--disable-hybrid-kv-
    cache-manager``), a model that mixes full and sliding layers has a page for every block of
    every layer, and vLLM's prefix cache would keep the pages of a window load whose sliding
    layers hold only the checkpoint's window; a later request served from there by vLLM would
    read stale sliding pages. So windows then need vLLM's prefix cache off."""
    if not spec.sliding:
        return spec
    if spec.vllm_windows:  # vLLM frees each sliding page once it leaves the window: windows only
        if cfg.sliding == "every_layer":
            raise UsageError(
                "kv_connector_extra_config.sliding = 'every_layer': vLLM keeps only each window's pages "
                "of this model's sliding layers (its hybrid KV cache manager is on, or every layer "
                "slides), so only windows can be stored; set sliding to 'window' or 'auto', or start "
                "vLLM with --disable-hybrid-kv-cache-manager"
            )
        if log_it:
            log.info("kvstore: %d of %d layers slide (window %d, %s): stored as window pieces every %d blocks",
                     len(spec.sliding), spec.num_layers, spec.window,
                     f"vLLM's hybrid KV cache manager, {spec.num_groups} KV cache groups" if spec.groups
                     else "vLLM's sliding-window pages", cfg.checkpoint_every_blocks)
        return spec
    mode = cfg.sliding
    if mode == "auto":
        mode = "every_layer" if prefix_caching else "window"
    if mode == "window" and prefix_caching:
        raise UsageError(
            "kv_connector_extra_config.sliding = 'window' stores a sliding-window model's windows at "
            "checkpoints only, which vLLM's own prefix cache cannot hold apart: start vLLM with "
            "--no-enable-prefix-caching, or set sliding to 'every_layer' (or 'auto')"
        )
    if log_it:
        log.info(
            "kvstore: %d of %d layers slide (window %d): %s", len(spec.sliding), spec.num_layers, spec.window,
            f"stored as window pieces every {cfg.checkpoint_every_blocks} blocks (the replay bound)"
            if mode == "window" else "every layer of every block is stored (vLLM's prefix cache is on; "
            "--no-enable-prefix-caching stores only the windows at checkpoints)",
        )
    return spec if mode == "window" else replace(spec, sliding=(), window=0)


# ---- scheduler side ----------------------------------------------------------------------------


KNOWN_MAX = 1 << 16
"""Chains the scheduler remembers kvstore holding (``_Scheduler._known``)."""


@dataclass(slots=True)
class _Req:
    request: Any
    hashes: list[BlockHash]
    prompt_blocks: int
    hit: int = -1  # leading blocks kvstore holds (-1: not looked up)
    local: int = 0
    want: tuple[int, int] = (0, 0)
    allocated: bool = False
    block_ids: list[list[int]] = field(default_factory=list)  # vLLM's pages, one list per KV cache group
    saved: int = 0
    sent_blocks: int = 0
    async_pending: bool = False
    loaded_tokens: int = 0
    cached: int = 0  # leading blocks whose full part kvstore holds (a hybrid page; else = hit)
    pieces: list[int] = field(default_factory=list)  # blocks whose window piece this request stores
    states: set[int] = field(default_factory=set)  # blocks whose recurrent state this request stored


class _Scheduler:
    def __init__(self, vllm_config: VllmConfig, cfg: ConnectorConfig, spec: PageSpec) -> None:
        self.cfg = cfg
        self.spec = spec
        self.bt = spec.block_size
        pc = vllm_config.parallel_config
        self.world = int(pc.tensor_parallel_size)
        self.model_id, self.revision = model_identity(vllm_config, cfg)
        self._ns: dict[str, Namespace] = {}
        ns0 = self.ns_for("")
        # What the link registers on every (re)connection: for an fp8 cache, once rank 0's scales
        # have come (``set_scales``).
        self._registered = [] if spec.quantized and not spec.scales else stored_namespaces(ns0)
        log.info(
            "kvstore: namespace %s for %s (%s, rank 0 of %d); blocks stored under any other page "
            "layout, TP degree or revision are not seen by this engine",
            bytes(ns0.root).hex()[:16], self.model_id, spec.describe(), self.world,
        )
        self.link = make_link(cfg, "kvstore-scheduler", cfg.lookup_timeout_s, self._registered, report_conflicts=True)
        self.reqs: dict[str, _Req] = {}
        self.pending_loads: list[LoadSpec] = []
        self.leases = LeaseBook()
        self._lease_at_lookup = cfg.lease_at_lookup and self.world == 1 and not spec.hybrid
        self.counters = ConnectorCounters()
        every = cfg.checkpoint_every_blocks
        if spec.state is not None:
            every = self._state_checkpoints(vllm_config, every)
        self.policy = CheckpointPolicy(every, cfg.checkpoint_at_end, cfg.checkpoint_at_hits)
        self.clock = time.monotonic
        self._known: OrderedDict[bytes, float] = OrderedDict()
        """The last block of chains kvstore was seen holding (a lookup's answer, a save this
        engine planned) -> when, newest last; at most KNOWN_MAX."""

    def _state_checkpoints(self, vllm_config: VllmConfig, every: int) -> int:
        """The checkpoint spacing of a model with recurrent layers: vLLM keeps (and offers the
        connector) a state only where its own prefix cache retains one, at the end of a prefill
        and, with ``--prefix-cache-retention-interval`` R, every R tokens that a prefill chunk
        ends on (``--max-num-batched-tokens`` R or a divisor of it). So the checkpoints are
        vLLM's: every R / block_size blocks, the replay bound."""
        interval = int(getattr(vllm_config.cache_config, "prefix_cache_retention_interval", 0) or 0)
        if interval and interval % self.bt == 0:
            every = interval // self.bt
            log.info("kvstore: %d recurrent layers: their state is stored where vLLM keeps it, at the end of each "
                     "prompt and every %d blocks (--prefix-cache-retention-interval %d; prefill chunks of at most "
                     "that many tokens): a hit replays at most %d blocks", self.spec.state.num_layers if self.spec.state
                     else 0, every, interval, every - 1)
        else:
            log.warning("kvstore: recurrent layers: vLLM keeps their state only at the end of each prefill "
                        "(--prefix-cache-retention-interval %s): a hit ends where a stored prompt ended or left "
                        "a cached prefix, and other prompts sharing a prefix replay it all; set "
                        "--prefix-cache-retention-interval to a multiple of %d tokens, and "
                        "--max-num-batched-tokens to it, for checkpoints every so many tokens", interval or 0, self.bt)
        return every

    def ns_for(self, lora: str) -> Namespace:
        ns = self._ns.get(lora)
        if ns is None:
            ns = self._ns[lora] = self.spec.namespace(self.model_id, self.revision, 0, self.world, lora)
        return ns

    def set_scales(self, scales: str) -> None:
        """Rank 0's fp8 scales (its worker reads them from the model; they reach the scheduler
        through vLLM's connector handshake, before any request): lookups use its namespace."""
        if not self.spec.quantized or scales == self.spec.scales:
            return
        self.spec = replace(self.spec, scales=scales)
        self._ns.clear()
        ns0 = self.ns_for("")
        self._registered[:] = stored_namespaces(ns0)
        for ns in self._registered:
            self.link.call(lambda c, ns=ns: c.register_namespace(ns, self.cfg.ttl_s or None), None)  # type: ignore[misc]  # mypy cannot infer a lambda with a default
        log.info("kvstore: fp8 KV scales %s from rank 0: namespace %s (%s)", scales,
                 bytes(ns0.root).hex()[:16], self.spec.describe())

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
            hashes = hash_blocks(chain_namespace(self.ns_for(self._lora(request))), tokens[: n_hash * bt],
                                 salt or None)
            r = _Req(request, hashes, request.num_prompt_tokens // bt)
            self.reqs[request.request_id] = r
        max_blocks = (request.num_tokens - 1) // bt  # the last token is always computed
        if self.spec.quantized and not self.spec.scales:
            # No handshake from rank 0 (yet): its namespace is not known, so no hit is possible.
            if not self.counters.lookups:
                log.warning("kvstore: no fp8 scales from the workers; no lookups until they come")
            return 0, False
        if r.hit < 0 and self._skip_lookup(r, num_computed_tokens // bt, max_blocks):
            self.counters.known_skips += 1
            self.counters.requested_tokens += request.num_tokens
        if r.hit < 0:
            self.counters.lookups += 1
            ns = self.ns_for(self._lora(request))
            want = r.hashes[:max_blocks]
            if self.spec.hybrid:
                self._hybrid_lookup(r, ns, want)
                r.saved = min(r.hit, r.prompt_blocks)
            else:
                # The prompt's last full block too: never loaded (vLLM computes the last token),
                # but a block kvstore holds already is not saved again.
                ask = r.hashes[: max(max_blocks, r.prompt_blocks)]
                if ask and self._lease_at_lookup:
                    found, lease = self.link.call(lambda c: _found(c.lookup_lease(ns, ask)), (0, None))
                    self.leases.take(request.request_id, lease)
                else:
                    found = self.link.call(lambda c: c.lookup(ns, ask).num_blocks, 0) if ask else 0
                if found:
                    self._seen(ask[found - 1])
                r.hit = r.cached = min(found, max_blocks)
                r.saved = min(found, r.prompt_blocks)
            self.counters.requested_tokens += request.num_tokens
        r.local = num_computed_tokens // bt
        if self.spec.sliding:
            self._plan_windows(r, self.ns_for(self._lora(request)))
        ext = min(r.hit, max_blocks) - r.local
        if ext < self.cfg.min_load_blocks or self.link.is_open:
            r.want = (r.local, r.local)
            return 0, False
        r.want = (r.local, r.local + ext)
        return ext * bt, self.cfg.load_mode == "async"

    def _skip_lookup(self, r: _Req, local: int, max_blocks: int) -> bool:
        """Whether ``r`` needs no lookup: vLLM's own prefix hit covers every block kvstore could
        load, and kvstore was seen holding the prompt's blocks less than ``known_s`` ago (the
        lookup would only have decided which of vLLM's blocks to save again). Then nothing is
        loaded or saved."""
        n = max(max_blocks, r.prompt_blocks)
        if self.spec.hybrid or not n or local < max_blocks or self.cfg.known_s <= 0:
            return False
        seen = self._known.get(bytes(r.hashes[n - 1]))
        if seen is None or self.clock() - seen >= self.cfg.known_s:
            return False
        r.hit = r.cached = max_blocks
        r.saved = r.prompt_blocks
        return True

    def _seen(self, last: BlockHash) -> None:
        """kvstore holds the chain ending at block hash ``last`` (now)."""
        if self.cfg.known_s <= 0:
            return
        key = bytes(last)
        self._known[key] = self.clock()
        self._known.move_to_end(key)
        if len(self._known) > KNOWN_MAX:
            self._known.popitem(last=False)

    def _hybrid_lookup(self, r: _Req, ns: Namespace, want: list[BlockHash]) -> None:
        """The hit of a page with sliding layers: the nearest checkpoint at or before the end of
        the cached full part (``kvstore.hybrid.lookup``); the blocks after it are recomputed
        (replayed), and the windows this request stores are planned."""
        hyb = HybridNamespaces.of(ns)
        where = self.link.call(lambda c: hybrid_lookup(c, hyb, want, self.policy), None) if want else None
        c = where.checkpoint if where is not None else -1
        r.hit, r.cached = c + 1, (where.full_blocks if where is not None else 0)
        self.counters.replayed_blocks += max(r.cached - r.hit, 0)

    def _plan_windows(self, r: _Req, ns: Namespace) -> None:
        """The window pieces this request stores: those of the checkpoints among the blocks it
        computes (from the first block past kvstore's and vLLM's own hits), and only pieces of
        blocks it computes (vLLM's own cached pages of a sliding layer may hold nothing)."""
        hyb = HybridNamespaces.of(ns)
        first, last = max(r.hit, r.local), r.prompt_blocks - 1
        ckpts = set(self.policy.new_checkpoints(first, last))
        if self.policy.at_hits and first < r.cached <= last + 1:
            ckpts.add(r.cached - 1)  # this request replays up to there: the next one need not
        r.pieces = sorted({j for p in ckpts for j in hyb.checkpoint_blocks(p) if j >= first})

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
        ids = self._pages([list(g) for g in blocks.get_block_ids()], start, start + n)
        is_async = self.cfg.load_mode == "async"
        lease = self.leases.lend(request.request_id, start, n)
        self.pending_loads.append(LoadSpec(request.request_id, start, ids, is_async, lease))
        r.async_pending = is_async
        r.loaded_tokens = num_external_tokens
        self.counters.hit_tokens += num_external_tokens

    def _pages(self, groups: list[list[int]], start: int, end: int) -> list[Any]:
        """The pages of blocks ``start..end-1``: vLLM's block ids, or with its hybrid KV cache
        manager a tuple per block (each KV cache group's id; a sliding group's is vLLM's null
        block outside the window)."""
        if not self.spec.groups:
            return groups[0][start:end]
        return list(zip(*(g[start:end] for g in groups), strict=False))  # groups: one length

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
        full = min(computed // self.bt, r.prompt_blocks, min((len(g) for g in r.block_ids), default=0))
        if full > r.saved:
            self._info(meta, req_id, r, full)
            pieces = [j for j in r.pieces if r.saved <= j < full]
            meta.saves.append(SaveSpec(req_id, r.saved, self._pages(r.block_ids, r.saved, full), pieces))
            r.saved = full
            if not self.spec.hybrid:
                self._seen(r.hashes[full - 1])

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
            r.block_ids = [list(g) for g in new.block_ids]
            self._plan_save(meta, new.req_id, r, new.num_computed_tokens + so.num_scheduled_tokens[new.req_id])
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            r = self.reqs.get(req_id)
            if r is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                r.block_ids = [list(g) for g in new_ids] if new_ids is not None else []
            elif new_ids is not None:
                if not r.block_ids:
                    r.block_ids = [[] for _ in new_ids]
                for mine, more in zip(r.block_ids, new_ids, strict=True):
                    mine.extend(more)
            self._plan_save(meta, req_id, r, cached.num_computed_tokens[i] + so.num_scheduled_tokens[req_id])
        if self.spec.state is not None and self.cfg.save:
            self._plan_states(meta, so)
        self.leases.end_step()  # looked up, but not loading in this step (none, or not allocated): nothing stays pinned
        return meta

    def _plan_states(self, meta: KVStoreMetadata, so: SchedulerOutput) -> None:
        """The recurrent states vLLM offers this step (``kv_connector_block_state``: each a KV
        cache group, the page holding it and the boundary it ends, as its prefix cache retains
        them; the forward pass of this step writes them) at the end of a block whose full part
        is saved: stored as that block's checkpoint state, except the state a hit loaded."""
        assert self.spec.state is not None
        block_state = getattr(so, "kv_connector_block_state", None)
        offers = block_state.boundary_state_offloads if block_state is not None else {}
        mine = set(self.spec.state.groups)
        for req_id, entries in offers.items():
            r = self.reqs.get(req_id)
            if r is None:
                continue
            at: dict[int, dict[int, int]] = {}
            for group, page, tokens in entries:
                if group in mine and tokens % self.bt == 0 and tokens:
                    at.setdefault(tokens // self.bt - 1, {})[group] = page
            for i, pages in sorted(at.items()):
                if set(pages) != mine or i >= min(r.saved, r.prompt_blocks) or i == r.hit - 1 or i in r.states:
                    continue
                ids = [0] * self.spec.num_groups
                for group, page in pages.items():
                    ids[group] = page
                self._info(meta, req_id, r, i + 1)
                meta.states.append(StateSave(req_id, i, tuple(ids)))
                r.states.add(i)

    def update_connector_output(self, output: Any) -> None:
        landed = getattr(output, "kv_connector_worker_meta", None)
        if isinstance(landed, KVStoreWorkerMeta):
            self.leases.landed(landed.landed)
        for req_id in output.finished_recving or ():
            r = self.reqs.get(req_id)
            if r is None:
                continue
            r.async_pending = False
            if r.request.is_finished():
                del self.reqs[req_id]

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        self.leases.drop(request.request_id)
        r = self.reqs.get(request.request_id)
        if r is None:
            return False, None
        # An async load still writing into this request's pages: vLLM frees them once the
        # worker reports the load finished.
        params = {"kvstore_hit_tokens": r.loaded_tokens}
        if self.spec.hybrid:  # blocks kvstore held past the checkpoint the hit ended on
            params["kvstore_replayed_tokens"] = max(r.cached - r.hit, 0) * self.bt if r.loaded_tokens else 0
        return r.async_pending, params

    def close(self) -> None:
        log.info("kvstore scheduler: %s", self.counters)
        self.leases.close()
        self.link.close()


# ---- the connector vLLM loads ----------------------------------------------------------------


class KVStoreConnector(KVConnectorBase_V1, SupportsHMA):
    """kvstore as vLLM's external KV cache; see the module docstring and docs/vllm.md.

    ``SupportsHMA``: vLLM keeps its hybrid KV cache manager on (unless started with
    ``--disable-hybrid-kv-cache-manager``): a model with sliding-window layers gets its own
    sliding-window KV cache groups, whose pages hold only the window, and the connector loads a
    checkpoint's window into them. A load that fails is then reported per request
    (``failed_recving``), since vLLM 0.32 refuses block-level load errors for several groups:
    such a model loads ``async`` only."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        self.cfg = ConnectorConfig.from_extra(ktc.kv_connector_extra_config)
        pc = vllm_config.parallel_config
        if int(getattr(pc, "pipeline_parallel_size", 1)) > 1:
            raise UsageError("kvstore's vLLM connector does not support pipeline parallelism yet (use TP)")
        spec = page_spec(kv_cache_config, getattr(kv_cache_config, "kv_cache_layout", None), vllm_config)
        if self.cfg.block_format != spec.block_format:
            spec = replace(spec, block_format=self.cfg.block_format)
        self.spec = sliding_mode(spec, self.cfg, bool(vllm_config.cache_config.enable_prefix_caching),
                                 log_it=role == KVConnectorRole.SCHEDULER)
        if self.spec.num_groups > 1 and self.cfg.load_mode != "async":
            raise UsageError(
                f"kv_connector_extra_config.load_mode = {self.cfg.load_mode!r}: with vLLM's hybrid KV cache "
                f"manager this model has {self.spec.num_groups} KV cache groups, and vLLM 0.32 takes a failed "
                "load of several groups only per request, which only an async load reports; set load_mode "
                "to 'async', or start vLLM with --disable-hybrid-kv-cache-manager"
            )
        self._scheduler: _Scheduler | None = None
        self._worker: Worker | None = None
        if role == KVConnectorRole.SCHEDULER:
            if self.cfg.load_failure_policy == "recompute" and ktc.kv_load_failure_policy != "recompute":
                # kvstore is a cache: a block that cannot be loaded is recomputed, never an error.
                # vLLM's scheduler reads the policy after building its connector.
                ktc.kv_load_failure_policy = "recompute"
                log.info("kvstore: kv_load_failure_policy set to 'recompute' (a failed load is a miss)")
            self._scheduler = _Scheduler(vllm_config, self.cfg, self.spec)
        else:
            self._worker = Worker(vllm_config, self.cfg, self.spec, fenced=VLLM_FENCES)

    # -- the handshake: rank 0's worker tells the scheduler what only the model knows --

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        if self._worker is None or not self.spec.quantized:
            return None
        return KVStoreHandshake(self._worker.spec.scales)

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        meta = metadata.get(0)
        if self._scheduler is not None and isinstance(meta, KVStoreHandshake):
            self._scheduler.set_scales(meta.scales)

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

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request)

    # -- worker --

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """vLLM calls this each step before it writes a page: the saves' gathers left to the
        saver thread (the CPU build) have run by then."""
        if self._worker is not None:
            self._worker.handle_preemptions()

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

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self._worker is not None
        done = self._worker.get_finished()
        return KVConnectorTransferResults(finished_recving=done, failed_recving=self._worker.take_failed_requests())

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self._worker is None:
            return None
        landed = self._worker.take_landed()
        return KVStoreWorkerMeta(landed) if landed else None

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

