"""Where the paged restore's fixed time goes, on a GPU (a diagnostic, not a figure).

``python -m tools.lab.probes.headprobe`` (CUDA only) prints JSON lines:

* ``link``: milliseconds of 512 MiB host-to-device copies, medians of 9: from torch's pinned
  tensor (the paged bench's baseline); from the store's registered shared-memory arena as one
  copy; as the restore does (2-D, by layer groups); split over 2 and 4 streams; and read by a
  kernel straight from the arena's mapped address (no DMA engine, ``index_select`` over int64);
* ``head``: microseconds of each host step of the restore's head (hash 16 blocks, lease them,
  wrap the lease, queue the copy, record the event, give the lease back) and of the rest's hash
  and lease, medians of 200, on a warm store holding a 4K prefix.
"""

from __future__ import annotations

import ctypes
import gc
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from engine.gpu import ArenaBlocks, arena_tensor
from kvstore.cudart import cudart_candidates
from kvstore.keys import hash_blocks
from tools.bench._peers.paged import BLOCK, Cache, KvstorePaged, page_spec
from tools.bench._peers.paged_run import _timed


def layer_groups(num_layers: int, size: int = 8, last: int = 2) -> list[tuple[int, int]]:
    """``(first, end)`` layer ranges of ``size`` layers, the last one cut so that its final
    ``last`` layers are a group of their own."""
    groups = [(g, min(g + size, num_layers)) for g in range(0, num_layers, size)]
    lo, hi = groups[-1]
    if hi - lo > last:
        groups[-1:] = [(lo, hi - last), (hi - last, hi)]
    return groups


def _ms(fn: Callable[[], Any], reps: int = 9) -> float:
    """Median milliseconds of ``reps`` synchronized calls, after one untimed."""
    out = [_timed(fn, torch.device("cuda"))[0] for _ in range(reps + 1)]
    return round(statistics.median(out[1:]) * 1e3, 4)


def _us(fn: Callable[[], Any], reps: int = 200) -> float:
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return round(statistics.median(out) * 1e6, 2)


class _Uva:
    """A CUDA view of host memory through ``__cuda_array_interface__`` (mapped, registered)."""

    def __init__(self, ptr: int, shape: tuple[int, ...], typestr: str) -> None:
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (ptr, False), "version": 3}


def main() -> None:
    dev = torch.device("cuda")
    spec = page_spec(32)
    tokens = 4096
    cache = Cache(spec, tokens, dev)
    s = KvstorePaged()
    s.open(cache, 2 << 30, "/tmp")
    s.prepare(tokens)
    src, dst = cache.blocks(tokens)
    prompt = np.random.default_rng(7).integers(0, 128_000, tokens, dtype=np.int64)
    s.save(prompt, src)
    torch.cuda.synchronize()
    n, bb, pb = tokens // BLOCK, spec.block_bytes, spec.page_bytes
    nbytes = n * bb
    hashes = hash_blocks(s.ns, prompt)
    lease = s.kv.acquire(s.ns, hashes)
    blocks = ArenaBlocks(s.kv, lease)
    offs = [o for o, _ in lease.locations]
    host_arena = arena_tensor(lease.arena)
    staging = torch.empty((n, bb), dtype=torch.uint8, device=dev)
    flat = staging.view(-1)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    contiguous = all(offs[i + 1] - offs[i] == bb for i in range(n - 1))
    a0 = offs[0]
    link: dict[str, Any] = {"bytes": nbytes, "arena_run_contiguous": contiguous,
                            "runs": len(blocks.runs_of(0, n))}
    link["pinned_1d"] = _ms(lambda: flat.copy_(pinned, non_blocking=True))
    link["arena_1d"] = _ms(lambda: flat.copy_(host_arena[a0 : a0 + nbytes], non_blocking=True))

    def groups() -> None:
        for lo, hi in layer_groups(spec.num_layers):
            blocks.copy_into(staging[:, lo * pb : hi * pb], lo * pb, hi * pb)

    link["arena_2d_groups"] = _ms(groups)
    link["arena_2d_whole_blocks"] = _ms(lambda: blocks.copy_into(staging, 0, bb))
    for k in (2, 4):
        streams = [torch.cuda.Stream() for _ in range(k)]
        step = nbytes // k

        def split(streams: list[Any] = streams, step: int = step) -> None:
            main = torch.cuda.current_stream()
            for i, st in enumerate(streams):
                st.wait_stream(main)
                with torch.cuda.stream(st):
                    flat[i * step : (i + 1) * step].copy_(pinned[i * step : (i + 1) * step], non_blocking=True)
            for st in streams:
                main.wait_stream(st)

        link[f"pinned_{k}_streams"] = _ms(split)
    try:  # a kernel reading the arena over the bus: its device address (UVA: the host address)
        dptr = ctypes.c_void_p()
        err = -1
        for name in cudart_candidates():
            try:
                fn = ctypes.CDLL(name).cudaHostGetDevicePointer
            except (OSError, AttributeError):
                continue
            err = fn(ctypes.byref(dptr), ctypes.c_void_p(host_arena.data_ptr() + a0), 0)
            break
        link["uva_device_pointer_err"] = int(err)
        if not err:
            rows = torch.as_tensor(_Uva(int(dptr.value or 0), (n, bb // 8), "<i8"), device=dev)
            idx = torch.arange(n, device=dev)
            out64 = staging.view(torch.int64).view(n, bb // 8)
            link["uva_index_select"] = _ms(lambda: torch.index_select(rows, 0, idx, out=out64))
            link["uva_copy"] = _ms(lambda: out64.copy_(rows))
    except (OSError, AttributeError, RuntimeError, TypeError) as e:
        link["uva_error"] = f"{type(e).__name__}: {e}"
    blocks.release()
    print(json.dumps({"probe": "link", "device": torch.cuda.get_device_name(dev), **link}), flush=True)

    h = 16
    head_tokens = prompt[: h * BLOCK]
    hh = hash_blocks(s.ns, head_tokens)
    rest = prompt[h * BLOCK :]
    copy = torch.cuda.Stream()
    ev = torch.cuda.Event()
    step: dict[str, float] = {}
    step["hash_head"] = _us(lambda: hash_blocks(s.ns, head_tokens))
    step["acquire_head"] = _us(lambda: s.kv.release(s.kv.acquire(s.ns, hh)))
    step["release_head"] = _us(lambda: s.kv.release(s.kv.acquire(s.ns, hh))) - step["acquire_head"]
    held = s.kv.acquire(s.ns, hh)
    step["wrap_head"] = _us(lambda: ArenaBlocks(s.kv, held))
    head = ArenaBlocks(s.kv, held)
    dsth = staging[:h]
    step["queue_head_copy"] = _us(lambda: head.copy_into(dsth, 0, bb, stream=copy), 100)
    step["event_record"] = _us(lambda: ev.record(copy))
    torch.cuda.synchronize()
    step["cuda_sync_idle"] = _us(torch.cuda.synchronize)
    s.kv.release(held)
    step["hash_rest"] = _us(lambda: hash_blocks(s.ns, rest, parent=hh[-1]))
    step["acquire_all"] = _us(lambda: s.kv.release(s.kv.acquire(s.ns, hashes)), 100)
    step["block_ids_256"] = _us(lambda: s.pages.block_ids(dst), 100)
    step["block_ids_256_pinned"] = _us(
        lambda: torch.as_tensor(dst, dtype=torch.long).pin_memory().to(dev, non_blocking=True), 100)
    print(json.dumps({"probe": "head", "us": step}), flush=True)
    # The bench's own loop (zero the pages, a timed pinned copy, a timed restore), with the
    # collector on and off: whether the head's time in the bench is the collector's.
    h2d = lambda: flat.copy_(pinned, non_blocking=True)  # noqa: E731
    for label, off in (("gc_on", False), ("gc_off", True), ("gc_on_again", False)):
        if off:
            gc.disable()
        before = sum(st["collections"] for st in gc.get_stats())
        s.phases = {}
        times = []
        for _ in range(16):
            cache.zero(dst)
            _ms(h2d, 1)
            torch.cuda.synchronize()
            t = time.perf_counter()
            s.restore(prompt, dst)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        gc.enable()
        phases = {k: round(statistics.median(v) * 1e3, 3) for k, v in s.phases.items()}
        print(json.dumps({"probe": "restore_loop", "gc": label, "ms": round(statistics.median(times[1:]) * 1e3, 3),
                          "ms_min": round(min(times[1:]) * 1e3, 3), "phases_ms": phases,
                          "collections": sum(st["collections"] for st in gc.get_stats()) - before}), flush=True)
    s.close()


if __name__ == "__main__":
    main()
