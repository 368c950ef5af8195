"""Servers the peers need, on loopback only, with the addresses they bound checked.

``listening(pid)`` reads what a process listens on from ``/proc`` (its sockets' inodes against
its network namespace's TCP tables), so a server told ``127.0.0.1`` that binds ``0.0.0.0``
anyway (mooncake_master's HTTP metadata server does) is caught, not trusted.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from tools.bench._peers.base import PeerUnavailable

START_TIMEOUT_S = 60.0  # generous: the box is shared and loaded
_LOOPBACK = ("127.", "::1", "[::1]")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _addr(hexaddr: str) -> str:
    ip, port = hexaddr.split(":")
    raw = bytes.fromhex(ip)
    if len(raw) == 4:
        host = socket.inet_ntop(socket.AF_INET, raw[::-1])
    else:  # /proc stores IPv6 as four little-endian 32-bit words
        host = "[" + socket.inet_ntop(socket.AF_INET6, b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))) + "]"
    return f"{host}:{int(port, 16)}"


def listening(pid: int) -> list[str]:
    """``host:port`` of every TCP socket process ``pid`` listens on."""
    inodes = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in fd_dir.iterdir() if fd_dir.exists() else ():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    out = []
    for table in ("tcp", "tcp6"):
        path = Path(f"/proc/{pid}/net/{table}")
        with contextlib.suppress(OSError):
            for line in path.read_text().splitlines()[1:]:
                f = line.split()
                if f[3] == "0A" and f[9] in inodes:  # 0A: LISTEN
                    out.append(_addr(f[1]))
    return sorted(set(out))


def not_loopback(addrs: list[str]) -> list[str]:
    return [a for a in addrs if not a.startswith(_LOOPBACK)]


def check_loopback(name: str, addrs: list[str]) -> list[str]:
    """``addrs``, or PeerUnavailable naming the addresses that are not loopback."""
    bad = not_loopback(addrs)
    if bad:
        raise PeerUnavailable(f"{name} listens on {', '.join(bad)} although told 127.0.0.1; refusing to run it")
    return addrs


def _wait_listening(proc: subprocess.Popen[bytes], name: str, port: int, log: Path) -> list[str]:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise PeerUnavailable(f"{name} exited with {proc.returncode} at start: {_tail(log)}")
        addrs = listening(proc.pid)
        if any(a.endswith(f":{port}") for a in addrs):
            return addrs
        time.sleep(0.05)
    raise PeerUnavailable(f"{name} did not listen on port {port} within {START_TIMEOUT_S:.0f} s: {_tail(log)}")


def _tail(log: Path, n: int = 600) -> str:
    with contextlib.suppress(OSError):
        return log.read_text(errors="replace")[-n:].strip()
    return ""


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _find(exe: str, hint: str) -> str:
    """``exe`` beside this Python (a venv's console scripts) or on the PATH."""
    here = Path(sys.executable).parent / exe
    found = str(here) if here.exists() else shutil.which(exe)
    if found is None:
        raise PeerUnavailable(f"{exe} is not installed: {hint}")
    return found


@contextlib.contextmanager
def _serve(name: str, cmd: list[str], port: int, log: Path) -> Iterator[list[str]]:
    """Run ``cmd`` until the block ends; yields what it listens on once ``port`` is among it
    (PeerUnavailable if it exits first, takes too long or listens beyond loopback)."""
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield check_loopback(name, _wait_listening(proc, name, port, log))
    finally:
        _stop(proc)


@contextlib.contextmanager
def redis_server(maxmemory: int, workdir: Path) -> Iterator[tuple[int, list[str]]]:
    """``redis-server`` on 127.0.0.1 with ``maxmemory`` of data (+5% and 16 MiB for its own keys
    and allocator) and LRU over all keys, no persistence. Yields its port and what it listens on."""
    exe = _find("redis-server", "apt-get install redis-server (make bench-peers does)")
    port = free_port()
    room = maxmemory + maxmemory // 20 + (16 << 20)
    cmd = [exe, "--bind", "127.0.0.1", "--port", str(port), "--protected-mode", "yes",
           "--maxmemory", str(room), "--maxmemory-policy", "allkeys-lru",
           "--save", "", "--appendonly", "no", "--dir", str(workdir), "--daemonize", "no"]
    with _serve("redis-server", cmd, port, workdir / "redis.log") as addrs:
        yield port, addrs


@contextlib.contextmanager
def mooncake_master(workdir: Path) -> Iterator[tuple[int, list[str]]]:
    """``mooncake_master`` with its RPC and metrics servers on 127.0.0.1 and no HTTP metadata
    server (it binds 0.0.0.0 whatever it is told; the clients handshake peer to peer instead).
    Yields the RPC port and what the master listens on."""
    exe = _find("mooncake_master", "pip install mooncake-transfer-engine-non-cuda (make bench-peers does)")
    rpc, metrics = free_port(), free_port()
    cmd = [exe, "--rpc_address=127.0.0.1", f"--rpc_port={rpc}", "--metrics_host=127.0.0.1",
           f"--metrics_port={metrics}", "--enable_http_metadata_server=false",
           "--eviction_high_watermark_ratio=0.95", "--rpc_thread_num=2"]
    with _serve("mooncake_master", cmd, rpc, workdir / "mooncake_master.log") as addrs:
        yield rpc, addrs
