"""The peer benchmark's parts (``tools/bench/peers.py``): one small adapter per store.

* ``base.py``: the :class:`~tools.bench._peers.base.Adapter` contract every store meets;
* ``workload.py``: the geometry, the requests, the buffers and the driver that times an adapter;
* ``kv.py``: kvstore in process and through its daemon (shared memory, TCP);
* ``lmcache.py``: LMCache's ``LMCacheEngine`` with a CPU copy connector (CPU, disk, Redis);
* ``mooncake.py``: Mooncake Store over its TCP transport;
* ``baselines.py``: a memcpy store and a raw-socket store, the yardsticks;
* ``procs.py``: redis-server and mooncake_master on loopback, with their bound addresses checked;
* ``child.py``: one adapter at one request size in its own process (memory freed, a crash
  contained).

``PEERS`` maps a peer name to ``"module:Class"`` (imported only when that peer runs, so a
missing package costs only its own peer).
"""

from __future__ import annotations

PEERS: dict[str, str] = {
    "memcpy": "tools.bench._peers.baselines:MemcpyStore",
    "socket": "tools.bench._peers.baselines:SocketStore",
    "kvstore": "tools.bench._peers.kv:InProcess",
    "kvstore-shm": "tools.bench._peers.kv:DaemonShm",
    "kvstore-tcp": "tools.bench._peers.kv:DaemonTcp",
    "lmcache-cpu": "tools.bench._peers.lmcache:LocalCpu",
    "lmcache-cpu-mt": "tools.bench._peers.lmcache:LocalCpuMt",
    "lmcache-disk": "tools.bench._peers.lmcache:LocalDisk",
    "lmcache-redis": "tools.bench._peers.lmcache:Redis",
    "mooncake": "tools.bench._peers.mooncake:MooncakeStore",
}
