"""The yardsticks: the least a store can do, as stores under the same workload.

* ``memcpy``: a pool of chunk slots in this process, an ordered dict as index and LRU; a store
  or a retrieve is one ``np.copyto`` per chunk. What an in-process store costs with no
  bookkeeping at all.
* ``socket``: the same pool in a server process on loopback; a store is a header and
  ``sendall`` of the request's chunks, which the server ``recv_into``\\s its slots; a retrieve is
  a header, the server's ``sendall`` from its slots and this side's ``recv_into`` the caller's
  buffer. What a store behind one TCP connection costs with no protocol beyond a length.
"""

from __future__ import annotations

import socket
import struct
import subprocess
import sys
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.keys import hash_blocks
from tools.bench._peers.base import Adapter
from tools.bench._peers.kv import namespace
from tools.bench._peers.procs import check_loopback, listening
from tools.bench._peers.workload import Request, Workload


class SlotPool:
    """``slots`` chunk slots with an LRU index: the least any DRAM store keeps."""

    def __init__(self, slots: int, chunk_bytes: int) -> None:
        self.pool = np.empty((slots, chunk_bytes), np.uint8)
        self.pool.fill(0)  # faulted in up front, as LMCache's pool is
        self.free = list(range(slots))
        self.index: OrderedDict[bytes, int] = OrderedDict()

    def slot_for(self, key: bytes) -> int:
        """The slot to write ``key`` into (the least recently used one when full)."""
        slot = self.index.get(key)
        if slot is None:
            if not self.free:
                _, old = self.index.popitem(last=False)
                self.free.append(old)
            slot = self.free.pop()
        self.index[key] = slot
        self.index.move_to_end(key)
        return slot

    def hit(self, key: bytes) -> int | None:
        slot = self.index.get(key)
        if slot is not None:
            self.index.move_to_end(key)
        return slot


class MemcpyStore(Adapter):
    def open(self, w: Workload) -> None:
        self.w, self.ns = w, namespace(w)
        self.pool = SlotPool(w.capacity_bytes // w.geometry.chunk_bytes, w.geometry.chunk_bytes)
        self._lock = threading.Lock()

    def store(self, req: Request, src: np.ndarray) -> None:
        cb = self.w.geometry.chunk_bytes
        for i, h in enumerate(hash_blocks(self.ns, req.tokens)):
            with self._lock:
                slot = self.pool.slot_for(h)
            np.copyto(self.pool.pool[slot], src[i * cb : (i + 1) * cb])

    def lookup(self, req: Request) -> int:
        n = 0
        with self._lock:
            for h in hash_blocks(self.ns, req.tokens):
                if h not in self.pool.index:
                    break
                n += 1
        return n * self.w.geometry.chunk_tokens

    def retrieve(self, req: Request, dst: np.ndarray) -> int:
        cb = self.w.geometry.chunk_bytes
        n = 0
        for i, h in enumerate(hash_blocks(self.ns, req.tokens)):
            with self._lock:
                slot = self.pool.hit(h)
            if slot is None:
                break
            np.copyto(dst[i * cb : (i + 1) * cb], self.pool.pool[slot])
            n += 1
        return n * self.w.geometry.chunk_tokens

    def close(self) -> None:
        del self.pool


# The socket store's server: one thread per connection; "P" + n keys: recv n chunks into slots;
# "G" + n keys: a count, then the leading cached chunks; "L" + n keys: the cached prefix length.
SERVER = r"""
import socket, struct, sys, threading
sys.path[:0] = [sys.argv[3]]
from tools.bench._peers.baselines import SlotPool
slots, cb = int(sys.argv[1]), int(sys.argv[2])
pool = SlotPool(slots, cb)
lock = threading.Lock()
srv = socket.create_server(("127.0.0.1", 0))
print(srv.getsockname()[1], flush=True)

def recv_exact(c, view):
    got = 0
    while got < len(view):
        k = c.recv_into(view[got:])
        if not k:
            raise ConnectionError("client went away")
        got += k

def serve(c):
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    hdr = bytearray(5)
    try:
        while True:
            recv_exact(c, memoryview(hdr))
            op, n = hdr[:1], struct.unpack("<I", hdr[1:])[0]
            keys = bytearray(16 * n)
            recv_exact(c, memoryview(keys))
            keys = [bytes(keys[i * 16:(i + 1) * 16]) for i in range(n)]
            if op == b"P":
                for k in keys:
                    with lock:
                        s = pool.slot_for(k)
                    recv_exact(c, memoryview(pool.pool[s]))
                c.sendall(b"k")
            else:
                with lock:
                    found = []
                    for k in keys:
                        s = pool.hit(k) if op == b"G" else pool.index.get(k)
                        if s is None:
                            break
                        found.append(s)
                c.sendall(struct.pack("<I", len(found)))
                if op == b"G":
                    for s in found:
                        c.sendall(memoryview(pool.pool[s]))
    except ConnectionError:
        pass
    finally:
        c.close()

while True:
    conn, _ = srv.accept()
    threading.Thread(target=serve, args=(conn,), daemon=True).start()
"""


class SocketStore(Adapter):
    def open(self, w: Workload) -> None:
        self.w, self.ns = w, namespace(w)
        root = str(Path(__file__).resolve().parents[3])
        slots = w.capacity_bytes // w.geometry.chunk_bytes
        self._proc = subprocess.Popen([sys.executable, "-c", SERVER, str(slots), str(w.geometry.chunk_bytes), root],
                                      stdout=subprocess.PIPE, text=True)
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line.strip().isdigit():
            raise RuntimeError(f"the socket store did not start (exit {self._proc.poll()}): {line!r}")
        self._port = int(line)
        self._listen = check_loopback("socket store", listening(self._proc.pid))
        self._sock = self._connect()

    def _connect(self) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", self._port))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return s

    def _ask(self, op: bytes, req: Request) -> None:
        keys = hash_blocks(self.ns, req.tokens)
        self._sock.sendall(op + struct.pack("<I", len(keys)) + b"".join(keys))

    def _recv(self, view: memoryview) -> None:
        got = 0
        while got < len(view):
            k = self._sock.recv_into(view[got:])
            if not k:
                raise ConnectionError("the socket store went away")
            got += k

    def store(self, req: Request, src: np.ndarray) -> None:
        self._ask(b"P", req)
        self._sock.sendall(memoryview(src))
        self._recv(memoryview(bytearray(1)))

    def _count(self) -> int:
        b = bytearray(4)
        self._recv(memoryview(b))
        return struct.unpack("<I", b)[0]

    def lookup(self, req: Request) -> int:
        self._ask(b"L", req)
        return self._count() * self.w.geometry.chunk_tokens

    def retrieve(self, req: Request, dst: np.ndarray) -> int:
        self._ask(b"G", req)
        n = self._count()
        self._recv(memoryview(dst)[: n * self.w.geometry.chunk_bytes])
        return n * self.w.geometry.chunk_tokens

    def client(self) -> Adapter:
        other = object.__new__(SocketStore)
        other.w, other.ns, other._port, other._proc = self.w, self.ns, self._port, self._proc
        other._sock = other._connect()
        return other

    def close_client(self) -> None:
        self._sock.close()

    def close(self) -> None:
        self._sock.close()
        self._proc.kill()
        self._proc.wait()

    def info(self) -> dict[str, Any]:
        return {"listening": self._listen}
