"""Mooncake Store (``mooncake-transfer-engine-non-cuda``) under the peer workload.

A ``mooncake_master`` on loopback and one client in this process that mounts a segment of the
workload's capacity (``global_segment_size``) and moves chunks with ``batch_put_from`` /
``batch_get_into`` straight from and into the caller's buffers (registered once each), over
its TCP transport. Keys are the chunks' kvstore hashes in hex (Mooncake does not hash tokens).

The master evicts in the background once its segments pass a high watermark (0.95 here); a
put that finds no room fails for that key, so failed keys are put again, up to
``PUT_RETRIES`` times, and the retries are counted (``failed_puts``) and timed.

The client library binds its handshake and transfer listeners on every interface whatever it
is told (``MC_TCP_BIND_ADDRESS`` is set to 127.0.0.1 and honoured only in part), so the bench
runs this peer in a network namespace of its own with only loopback in it (``unshare -n`` as
root); what it listened on is reported in ``listening``.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.keys import hash_blocks
from tools.bench._peers.base import Adapter, PeerUnavailable
from tools.bench._peers.kv import namespace
from tools.bench._peers.procs import listening, mooncake_master, not_loopback
from tools.bench._peers.workload import Request, Workload

PUT_RETRIES = 200
RETRY_WAIT_S = 0.005
LOCAL_BUFFER = 64 << 20


class MooncakeStore(Adapter):
    def open(self, w: Workload) -> None:
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise PeerUnavailable(f"mooncake is not installed ({e}); run make bench-peers") from e
        self.w, self.ns = w, namespace(w)
        self._stack = ExitStack()
        self._dir = Path(self._stack.enter_context(tempfile.TemporaryDirectory(prefix="peers-mooncake-", dir=w.scratch)))
        rpc, self._master_listen = self._stack.enter_context(mooncake_master(self._dir))
        self.s = MooncakeDistributedStore()
        rc = self.s.setup("127.0.0.1", "P2PHANDSHAKE", w.capacity_bytes, LOCAL_BUFFER, "tcp", "", f"127.0.0.1:{rpc}")
        if rc != 0:
            self._stack.close()
            raise PeerUnavailable(f"MooncakeDistributedStore.setup returned {rc}")
        self._registered: set[int] = set()
        # The concurrent phase's clients share this adapter: two registering one buffer at once
        # made Mooncake refuse the second (register_buffer returned -600) and broke the phase.
        self._register_lock = threading.Lock()
        self.failed_puts = 0
        self._client_listen = listening(os.getpid())

    def _keys(self, req: Request) -> list[str]:
        return [h.hex() for h in hash_blocks(self.ns, req.tokens)]

    def _ptrs(self, buf: np.ndarray, n: int) -> tuple[list[int], list[int]]:
        base = buf.ctypes.data
        with self._register_lock:
            if base not in self._registered:
                rc = self.s.register_buffer(base, buf.nbytes)
                if rc != 0:
                    raise RuntimeError(f"Mooncake register_buffer of {buf.nbytes} bytes returned {rc}")
                self._registered.add(base)
        cb = self.w.geometry.chunk_bytes
        return [base + i * cb for i in range(n)], [cb] * n

    def store(self, req: Request, src: np.ndarray) -> None:
        keys = self._keys(req)
        ptrs, sizes = self._ptrs(src, len(keys))
        todo = list(range(len(keys)))
        for _ in range(PUT_RETRIES):
            rcs = self.s.batch_put_from([keys[i] for i in todo], [ptrs[i] for i in todo], [sizes[i] for i in todo])
            todo = [i for i, rc in zip(todo, rcs, strict=True) if rc != 0]
            if not todo:
                return
            self.failed_puts += len(todo)
            time.sleep(RETRY_WAIT_S)  # the master evicts in the background; give it a moment
        raise RuntimeError(f"Mooncake refused {len(todo)} of {len(keys)} chunks {PUT_RETRIES} times")

    def lookup(self, req: Request) -> int:
        found = self.s.batch_is_exist(self._keys(req))
        n = next((i for i, x in enumerate(found) if x != 1), len(found))
        return n * self.w.geometry.chunk_tokens

    def retrieve(self, req: Request, dst: np.ndarray) -> int:
        keys = self._keys(req)
        ptrs, sizes = self._ptrs(dst, len(keys))
        got = self.s.batch_get_into(keys, ptrs, sizes)
        n = next((i for i, x in enumerate(got) if x != sizes[i]), len(got))
        return n * self.w.geometry.chunk_tokens

    def close(self) -> None:
        for base in self._registered:
            self.s.unregister_buffer(base)
        self.s.close()
        self._stack.close()

    def info(self) -> dict[str, Any]:
        return {"failed_puts": self.failed_puts, "listening": self._master_listen,
                "client_listening_not_loopback": not_loopback(self._client_listen),
                "netns": os.environ.get("PEERS_NETNS", "shared")}
