"""Where the CUDA runtime library may be: the one list the GPU load path (``engine.gpu``) and
the daemon's PUT_DEVICE copies (``kvstore.server.devcopy``) try, without importing torch."""

from __future__ import annotations

import glob
import os


def cudart_candidates() -> list[str]:
    """Library names ``ctypes.CDLL`` tries in order: a ``libcudart`` this process has already
    loaded (torch's, so calls act on the runtime that made its allocations), the system's, then
    the ones in the pip CUDA runtime wheels (``nvidia/*/lib``) that torch installs."""
    names = _loaded() + ["libcudart.so"] + [f"libcudart.so.{v}" for v in (13, 12, 11)]
    try:
        import nvidia  # the pip CUDA runtime torch depends on

        for base in nvidia.__path__:
            names += sorted(glob.glob(os.path.join(base, "*", "lib", "libcudart.so*")))
    except ImportError:
        pass
    return names


def _loaded() -> list[str]:
    """Paths of the ``libcudart`` libraries mapped into this process (from ``/proc/self/maps``)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart.so" in line}
    except OSError:
        return []
    return sorted(p for p in paths if p.startswith("/"))
