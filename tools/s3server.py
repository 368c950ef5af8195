"""A local S3-compatible server for tests and benchmarks: ``moto_server`` on 127.0.0.1, run as a
separate process (as s3fs's own test suite does), so that it can be killed, paused and restarted
like a real endpoint.

    with LocalS3() as s3:
        s3.make_bucket("kv")
        options = {"url": "s3://kv/prefix", **s3.tier_options()}

moto keeps objects in memory: a restarted server is empty. Credentials are dummies (moto accepts
any); no region is sent, because a region of us-east-1 makes moto refuse bucket creation with
InvalidLocationConstraint.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ACCESS_KEY = "kvstore-test"
SECRET_KEY = "kvstore-test-secret"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    """Linux: the server gets SIGKILL when the process that started it dies, so a test run
    killed mid-way leaves no server behind."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _command(port: int) -> list[str]:
    exe = Path(sys.executable).with_name("moto_server")
    if exe.exists():
        return [str(exe), "-H", "127.0.0.1", "-p", str(port)]
    return [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]


class LocalS3:
    """One moto_server process on a fixed loopback port (picked free at construction)."""

    keeps_objects = False
    """Whether objects survive a kill and restart (moto keeps them in memory: no)."""

    def __init__(self, port: int | None = None, *, ready_timeout_s: float = 60.0) -> None:
        self.port = port or free_port()
        self.ready_timeout_s = ready_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def tier_options(self) -> dict[str, Any]:
        """Object tier options that reach this server (add ``url``)."""
        return {
            "endpoint_url": self.endpoint,
            "access_key_id": ACCESS_KEY,
            "secret_access_key": SECRET_KEY,
        }

    def start(self) -> LocalS3:
        """Start the server and wait, bounded, until it accepts connections."""
        if self.running:
            return self
        self._proc = subprocess.Popen(
            _command(self.port),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=_die_with_parent,
        )
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"moto_server exited with {self._proc.returncode} before listening on "
                    f"{self.endpoint}; is the port taken? (pip install 'moto[server]')"
                )
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), 0.2):
                return self
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"moto_server did not listen on {self.endpoint} within {self.ready_timeout_s} s")
            time.sleep(0.02)  # polling the port, not waiting for time to pass

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def kill(self) -> None:
        """SIGKILL, as a crash or a network cut would look: the port refuses connections."""
        if self._proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()
            self._proc.wait()
            self._proc = None

    def pause(self) -> None:
        """SIGSTOP: connections are accepted by the kernel but never answered (a hung server)."""
        assert self._proc is not None
        self._proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self._proc is not None
        self._proc.send_signal(signal.SIGCONT)

    def restart(self) -> LocalS3:
        """Kill and start again on the same port (moto starts empty)."""
        self.kill()
        return self.start()

    def make_bucket(self, name: str) -> str:
        """Create bucket ``name`` (no region: see the module docstring); returns ``s3://name``."""
        self.fs.mkdir(name)
        return f"s3://{name}"

    @property
    def fs(self) -> Any:
        """An s3fs filesystem on this server, for test set-up and inspection."""
        import s3fs

        return s3fs.S3FileSystem(key=ACCESS_KEY, secret=SECRET_KEY, endpoint_url=self.endpoint)

    def __enter__(self) -> LocalS3:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.kill()
