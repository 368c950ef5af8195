"""Everything a store's config could be refused for, checked before the store allocates
anything (a tier's slab map, its preallocated file, the arena), in constant time and memory.

A misspelled policy or admission rule, or an option it does not take, used to be caught only
after the NVMe file was preallocated (a production config would leave 1 TiB behind); a capacity
far past the machine (``capacity_bytes = "1000TiB"``) built a slab map in proportion to it and
ended in a ``MemoryError``. Here each is a :class:`ConfigError` saying what to change.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvstore.config import StoreConfig
from kvstore.errors import ConfigError
from kvstore.registry import admission_class, build_config, policy_class, tier_class

SHM_DIR = Path("/dev/shm")


def check_store_config(config: StoreConfig) -> None:
    """ConfigError for the first thing :class:`kvstore.store.KVStore` would refuse later."""
    for spec in config.tiers:
        cls = tier_class(spec.kind)
        tier_cfg = build_config(cls.Config, dict(spec.options), f"tier {spec.name!r}")
        capacity = getattr(tier_cfg, "capacity_bytes", None)
        if isinstance(capacity, int):
            _check_capacity(spec.name, spec.kind, capacity, Path(config.root))
    pol = policy_class(config.policy)
    build_config(pol.Config, dict(config.policy_options), f"policy {config.policy!r}")
    adm = admission_class(config.admission)
    build_config(adm.Config, dict(config.admission_options), f"admission {config.admission!r}")


def _check_capacity(name: str, kind: str, capacity: int, root: Path) -> None:
    """A tier no larger than what holds it: the DRAM arena lives in /dev/shm (in memory), an
    NVMe tier's file on the store root's filesystem. Free room is checked by the tier itself
    (a file from an earlier run already holds its part)."""
    if kind == "dram":
        phys = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        shm = _fs_size(SHM_DIR)
        limit, where = min(phys, shm or phys), f"this machine's memory ({_gib(phys)}; /dev/shm {_gib(shm)})"
    elif kind == "nvme":
        limit, where = _fs_size(root), f"the filesystem of {root}"
    else:
        return
    if limit and capacity > limit:
        raise ConfigError(
            f"tier {name!r}: capacity_bytes of {_gib(capacity)} is more than {where} holds "
            f"({_gib(limit)}); lower capacity_bytes"
        )


def _fs_size(path: Path) -> int:
    """The size of the filesystem ``path`` is (or would be) on; 0 if none can be found."""
    for p in (path, *path.absolute().parents):
        try:
            st = os.statvfs(p)
        except OSError:
            continue
        return st.f_blocks * st.f_frsize
    return 0


def _gib(n: int) -> str:
    return f"{n / (1 << 30):,.1f} GiB"
