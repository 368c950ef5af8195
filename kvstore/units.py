"""Parsing of sizes and durations as people write them in config files ("4GiB", "72h")."""

from __future__ import annotations

import math
import re

from kvstore.errors import ConfigError

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400, "w": 604800}
_NUM = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | float | str, what: str = "size") -> int:
    """Bytes from ``4096``, ``"64MiB"``, ``"1.5GB"``. Raises ConfigError with a hint."""
    if isinstance(value, bool):
        raise ConfigError(f"{what}: expected a size like '4GiB', got {value!r}")
    if not isinstance(value, int | float | str) or (isinstance(value, float) and not math.isfinite(value)):
        raise ConfigError(f"{what}: cannot read {value!r} as a size; write e.g. '512MiB' or '4GiB'")
    if isinstance(value, int | float):
        n = float(value)
    else:
        m = _NUM.match(value)
        unit = m.group(2).lower() if m else None
        if not m or unit not in _SIZE_UNITS:
            raise ConfigError(f"{what}: cannot read {value!r} as a size; write e.g. '512MiB' or '4GiB'")
        n = float(m.group(1)) * _SIZE_UNITS[unit]
    if n < 0:
        raise ConfigError(f"{what}: a size cannot be negative ({value!r})")
    return int(n)


def parse_duration(value: int | float | str, what: str = "duration") -> float:
    """Seconds from ``3600``, ``"72h"``, ``"30min"``, ``"3d"``. Raises ConfigError with a hint."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ConfigError(f"{what}: expected a duration like '72h', got {value!r}")
    if isinstance(value, int | float):
        s = float(value)
    else:
        m = _NUM.match(value)
        unit = m.group(2).lower() if m else None
        if not m or unit not in _DURATION_UNITS:
            raise ConfigError(f"{what}: cannot read {value!r} as a duration; write e.g. '72h' or '30min'")
        s = float(m.group(1)) * _DURATION_UNITS[unit]
    if s < 0:
        raise ConfigError(f"{what}: a duration cannot be negative ({value!r})")
    return s
