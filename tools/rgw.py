"""A one-node Ceph cluster on loopback with a RADOS Gateway: a production S3 implementation for
the object tier's tests (moto stays for the fast unit tests). Debian's ``ceph-mon``,
``ceph-osd`` and ``radosgw`` packages; one monitor, one OSD on ``memstore`` (in memory: no
disk, nothing to clean up but a directory), one gateway. Every daemon runs in the foreground as
a child of this process and dies with it.

    with RgwCluster(tmp) as cluster, LocalRGW(cluster) as s3:
        s3.make_bucket("kv")
        options = {"url": "s3://kv/prefix", **s3.tier_options()}

:class:`LocalRGW` has :class:`tools.s3server.LocalS3`'s surface (``endpoint``, ``tier_options``,
``make_bucket``, ``fs``, ``kill``, ``pause``, ``resume``, ``start``, ``restart``): killing it
kills the gateway, while the cluster keeps the objects (unlike moto, a restarted gateway is not
empty). ``python -m tools.rgw DIR`` starts a cluster and prints its endpoint, for a shell.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from tools.s3server import LocalS3, _die_with_parent, free_port

ACCESS_KEY = "kvstore-rgw-test"
SECRET_KEY = "kvstore-rgw-test-secret-key"
BINARIES = ("ceph-mon", "ceph-osd", "radosgw", "ceph", "radosgw-admin", "monmaptool", "ceph-authtool")
INSTALL = "apt-get install ceph-mon ceph-osd radosgw"


def _child() -> None:
    """In each daemon before exec: die with this process, and take SIGTERM (``main`` blocks it
    here to wait for it; a blocked mask is inherited)."""
    _die_with_parent()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if shutil.which(b) is None]


def _conf(d: Path, fsid: str, mon_v2: int, mon_v1: int) -> str:
    return f"""[global]
fsid = {fsid}
mon host = [v2:127.0.0.1:{mon_v2},v1:127.0.0.1:{mon_v1}]
public addr = 127.0.0.1
cluster addr = 127.0.0.1
ms bind ipv4 = true
ms bind ipv6 = false
keyring = {d}/keyring
auth allow insecure global id reclaim = false
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd crush chooseleaf type = 0
mon allow pool size one = true
mon max pg per osd = 1000
mon warn on pool no redundancy = false
mon data avail warn = 1
mon data avail crit = 0
osd objectstore = memstore
memstore device bytes = 1073741824
run dir = {d}/run
admin socket = {d}/run/$name.asok
log file = {d}/log/$name.log
[mon.a]
mon data = {d}/mon.a
[osd.0]
osd data = {d}/osd.0
"""


class RgwCluster:
    """One monitor and one memstore OSD under ``root`` (created; a started cluster owns it)."""

    def __init__(self, root: str | os.PathLike[str], *, ready_timeout_s: float = 180.0) -> None:
        self.root = Path(root)
        self.ready_timeout_s = ready_timeout_s
        self.conf = self.root / "ceph.conf"
        self._procs: list[subprocess.Popen[bytes]] = []
        self.seconds_to_start = 0.0

    def _run(self, *argv: str, timeout: float = 120.0) -> str:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {out.returncode}: {out.stderr.strip()[-2000:]}")
        return out.stdout

    def ceph(self, *args: str, timeout: float = 60.0) -> str:
        return self._run("ceph", "-c", str(self.conf), *args, timeout=timeout)

    def _daemon(self, *argv: str) -> subprocess.Popen[bytes]:
        log = (self.root / "log" / f"{Path(argv[0]).name}.out").open("ab")
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_child)
        log.close()
        self._procs.append(p)
        return p

    def start(self) -> RgwCluster:
        if missing := missing_binaries():
            raise RuntimeError(f"a one-node Ceph needs {', '.join(missing)}: {INSTALL}")
        t0 = time.monotonic()
        d = self.root
        shutil.rmtree(d, ignore_errors=True)
        for sub in ("run", "log", "mon.a", "osd.0"):
            (d / sub).mkdir(parents=True)
        fsid = str(uuid.uuid4())
        v2, v1 = free_port(), free_port()
        self.conf.write_text(_conf(d, fsid, v2, v1))
        kr = str(d / "keyring")
        self._run("ceph-authtool", "--create-keyring", kr, "--gen-key", "-n", "mon.", "--cap", "mon", "allow *")
        self._run("ceph-authtool", kr, "--gen-key", "-n", "client.admin", "--cap", "mon", "allow *",
                  "--cap", "osd", "allow *", "--cap", "mgr", "allow *")
        self._run("monmaptool", "--create", "--addv", "a", f"[v2:127.0.0.1:{v2},v1:127.0.0.1:{v1}]",
                  "--fsid", fsid, str(d / "monmap"))
        self._run("ceph-mon", "-c", str(self.conf), "--mkfs", "-i", "a", "--monmap", str(d / "monmap"), "--keyring", kr)
        self._daemon("ceph-mon", "-f", "-c", str(self.conf), "-i", "a")
        osd_uuid, key = str(uuid.uuid4()), self._run("ceph-authtool", "--gen-print-key").strip()
        (d / "osd.json").write_text(json.dumps({"cephx_secret": key}))
        osd_id = self.ceph("osd", "new", osd_uuid, "-i", str(d / "osd.json")).strip()
        osd_kr = str(d / "osd.0" / "keyring")
        self._run("ceph-authtool", "--create-keyring", osd_kr, "--name", f"osd.{osd_id}", "--add-key", key)
        self._run("ceph-osd", "-c", str(self.conf), "-i", osd_id, "--mkfs", "--osd-uuid", osd_uuid, "--keyring", osd_kr)
        self._daemon("ceph-osd", "-f", "-c", str(self.conf), "-i", osd_id, "--keyring", osd_kr)
        deadline = time.monotonic() + self.ready_timeout_s
        while json.loads(self.ceph("osd", "stat", "--format", "json")).get("num_up_osds", 0) < 1:
            for p in self._procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{p.args[0]} exited {p.returncode}: see {d / 'log'}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the OSD did not come up within {self.ready_timeout_s} s: see {d / 'log'}")
            time.sleep(0.2)  # polling the cluster, not waiting for time to pass
        rgw_kr = d / "rgw.keyring"
        self.ceph("auth", "get-or-create", "client.rgw", "mon", "allow rw", "osd", "allow rwx", "-o", str(rgw_kr))
        self._run("radosgw-admin", "-c", str(self.conf), "user", "create", "--uid", "kvstore", "--display-name",
                  "kvstore tests", "--access-key", ACCESS_KEY, "--secret-key", SECRET_KEY, timeout=180)
        self.seconds_to_start = time.monotonic() - t0
        return self

    def stop(self) -> None:
        for p in reversed(self._procs):
            with contextlib.suppress(ProcessLookupError):
                p.terminate()
        for p in reversed(self._procs):
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self._procs.clear()

    def __enter__(self) -> RgwCluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()


class LocalRGW(LocalS3):
    """One radosgw process of ``cluster`` on a loopback port (picked free at construction); the
    rest of :class:`LocalS3`'s surface (``kill``, ``pause``, ``resume``, ``restart``) as is."""

    keeps_objects = True  # they live in the cluster's OSD, not in the gateway

    def __init__(self, cluster: RgwCluster, port: int | None = None, *, ready_timeout_s: float = 120.0) -> None:
        super().__init__(port, ready_timeout_s=ready_timeout_s)
        self.cluster = cluster

    def tier_options(self) -> dict[str, Any]:
        """Object tier options that reach this gateway (add ``url``)."""
        return {"endpoint_url": self.endpoint, "access_key_id": ACCESS_KEY, "secret_access_key": SECRET_KEY}

    def start(self) -> LocalRGW:
        if self.running:
            return self
        c = self.cluster
        log = (c.root / "log" / "radosgw.out").open("ab")
        self._proc = subprocess.Popen(
            ["radosgw", "-f", "-c", str(c.conf), "-n", "client.rgw", "--keyring", str(c.root / "rgw.keyring"),
             f"--rgw-frontends=beast endpoint=127.0.0.1:{self.port}"],
            stdout=log, stderr=subprocess.STDOUT, preexec_fn=_child)
        log.close()
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(f"radosgw exited {self._proc.returncode}: see {c.root / 'log'}")
            try:
                with urllib.request.urlopen(self.endpoint, timeout=2):
                    return self
            except urllib.error.HTTPError:
                return self  # it answers
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"radosgw did not answer on {self.endpoint} within {self.ready_timeout_s} s")
            time.sleep(0.05)  # polling the port, not waiting for time to pass

    def make_bucket(self, name: str) -> str:
        """Create bucket ``name`` if it does not exist (a restarted gateway keeps its buckets;
        names have at least 3 characters, as S3 requires and moto does not check)."""
        fs = self.fs
        if not fs.exists(name):
            fs.mkdir(name)
        return f"s3://{name}"

    @property
    def fs(self) -> Any:
        import s3fs

        return s3fs.S3FileSystem(key=ACCESS_KEY, secret=SECRET_KEY, endpoint_url=self.endpoint, skip_instance_cache=True)


def main(argv: list[str] | None = None) -> int:
    import argparse

    from kvstore.version import version

    p = argparse.ArgumentParser(prog="python -m tools.rgw", description=__doc__.splitlines()[0])
    p.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    p.add_argument("dir", type=Path, help="the cluster's directory (wiped)")
    args = p.parse_args(argv)
    stop = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)  # taken by sigwait below, then a clean stop
    try:
        with RgwCluster(args.dir) as cluster, LocalRGW(cluster) as s3:
            print(json.dumps({"endpoint": s3.endpoint, "access_key": ACCESS_KEY, "secret_key": SECRET_KEY,
                              "seconds_to_start": round(cluster.seconds_to_start, 1)}), flush=True)
            signal.sigwait(stop)
    except RuntimeError as e:
        print(f"python -m tools.rgw: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
